"""Rebuild every committed test model (``make models``); needs the ``dev`` extra (torch, transformers, peft).

Each builder runs as ``python -m <module>`` would, with its defaults (the committed tiny files). They are
byte-for-byte reproducible with the pinned versions, so a rebuild that changes a committed file is a change
to review. A builder added under ``tests/models/`` gets one line in ``BUILDERS``.
"""

from __future__ import annotations

import runpy
import sys

BUILDERS = (
    "tests.models.build_basic",
    "tests.models.build_hf",
    "tests.models.build_lora",
    "tests.models.build_prepost",
    "tests.models.build_roles",
    "tests.models.build_cls_pool",
    "tests.models.build_torchscript",
    "tests.models.build_decoders",
    "tests.models.corpus",
)


def main() -> int:
    argv = sys.argv
    try:
        for module in BUILDERS:
            print(f"== python -m {module}", flush=True)
            sys.argv = [module]  # each builder parses its own (empty) command line
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                if exc.code:
                    return int(exc.code) if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return 0


if __name__ == "__main__":
    sys.exit(main())
