"""Copy held-out probe round 9's exports the regression tests read into ``tests/models/heldout/``.

Run ``python -m tests.models.build_heldout_round9 [NAME ...]`` (needs torch and transformers): the same as
``python -m tests.models.build_heldout_probe heldout_round9 NAME ...``. Default: ``conditional_detr``
(``tests/passes/test_heldout_conditional_detr.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.models.build_heldout_probe import build as build_probe  # noqa: E402

DEFAULT = ("conditional_detr",)


def build(names: tuple[str, ...] = DEFAULT) -> list[Path]:
    return build_probe("heldout_round9", names)


if __name__ == "__main__":
    for made in build(tuple(sys.argv[1:]) or DEFAULT):
        print(made, made.stat().st_size, "bytes")
