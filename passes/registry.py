"""The explicit pass registry and the presets.

Adding a pass: write ``passes/<name>.py``, its tests in ``tests/passes/test_<name>.py``, add the class to
``PASSES`` below (one line), and a CHANGELOG entry. Nothing registers itself by import side effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from onnxforge.config import EXACT_TOLERANCE, PassSpec, Tolerance
from onnxforge.errors import UnknownPassError
from passes._infra import Pass
from passes.common_subexpression_elimination import CommonSubexpressionElimination
from passes.constant_folding import ConstantFolding
from passes.dead_node_elimination import DeadNodeElimination
from passes.identity_elimination import IdentityElimination
from passes.label_sparsity import LabelSparsity
from passes.padding_elimination import PaddingElimination
from passes.shape_inference import ShapeInference

PASSES: tuple[type[Pass], ...] = (
    ShapeInference,
    IdentityElimination,
    ConstantFolding,
    CommonSubexpressionElimination,
    DeadNodeElimination,
    LabelSparsity,
    PaddingElimination,
)

_BY_NAME: dict[str, type[Pass]] = {cls.name: cls for cls in PASSES}
assert len(_BY_NAME) == len(PASSES), "two registered passes share a name"


class Preset:
    def __init__(self, name: str, summary: str, passes: Sequence[str], tolerance: Tolerance) -> None:
        self.name = name
        self.summary = summary
        self.passes = list(passes)
        self.tolerance = tolerance

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "passes": self.passes,
            "tolerance": self.tolerance.model_dump(),
        }


_CLEANUP = [
    "shape_inference",
    "identity_elimination",
    "constant_folding",
    "common_subexpression_elimination",
    "dead_node_elimination",
]

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "safe",
            "Exact graph cleanups only; the result computes the same function.",
            _CLEANUP,
            EXACT_TOLERANCE,
        ),
        Preset(
            "fast",
            "Every pass that is exact within tolerance and expected to pay on the target.",
            _CLEANUP,
            EXACT_TOLERANCE,
        ),
    )
}


def _unknown(kind: str, name: str, known: Sequence[str]) -> UnknownPassError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
    error = UnknownPassError(f"unknown {kind} {name!r}{hint}", detail={"name": name, "close_matches": close})
    if kind == "preset":
        error.code = "UNKNOWN_PRESET"
    return error


def get_pass_class(name: str) -> type[Pass]:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise _unknown("pass", name, list(_BY_NAME)) from None


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise _unknown("preset", name, list(PRESETS)) from None


def build_passes(specs: Sequence[PassSpec]) -> list[Pass]:
    """Instantiate passes from specs, validating every name and option before anything runs."""
    return [get_pass_class(spec.name)(spec.options) for spec in specs]


def catalogue() -> list[dict[str, Any]]:
    return [
        {
            "name": cls.name,
            "summary": cls.summary,
            "exact": cls.exact,
            "in_place": cls.in_place,
            "options_schema": cls.options_schema(),
        }
        for cls in PASSES
    ]
