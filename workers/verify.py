"""Verification: does a candidate model compute what the original computes?

``Verifier`` runs the original once per input set with every ORT graph optimization off (so ORT's own
fusions cannot hide a bug), then ``check(candidate)`` compares each output: max abs/rel error, cosine
similarity, ``numpy.isclose`` mismatches, NaN/Inf counts, shape and dtype. A candidate whose file holds the
original's bytes (the upload handed back) is compared from the reference itself, without a session. When the
original refuses a generated input set, the Verifier tries that set's next plausible guess
(``InputSet.next_guess``: longer sequences, special tokens, no padding) before asking the user for shapes or
samples, and the set keeps the record of what was tried (``InputSet.provenance``).

The inputs themselves are made in ``core.inputs`` (by input role, one implementation for every caller) and
the sessions in ``workers.sessions``.
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.adapters import run_options as run_options_with
from core.config import Tolerance
from core.errors import InvalidInputError, InvalidModelError, UnavailableError
from core.inputs import (
    InputSet,
)
from workers.sessions import make_session


@dataclasses.dataclass
class OutputStats:
    """How one output of the candidate compares with the reference on one input set."""

    input_set: str
    name: str
    ok: bool
    reason: str | None
    shape_ref: list[int] | None
    shape_got: list[int] | None
    dtype_ref: str | None
    dtype_got: str | None
    elements: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mismatches: int = 0
    mismatch_ratio: float = 0.0
    nan_ref: int = 0
    nan_got: int = 0
    inf_ref: int = 0
    inf_got: int = 0
    # "all", or "valid" when a pass (padding_elimination) left pad positions undefined and only the
    # positions the mask marks valid were compared.
    positions: str = "all"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VerificationResult:
    ok: bool
    outputs: list[OutputStats]
    reason: str | None = None

    def worst(self) -> dict[str, Any]:
        """A one-line summary for the ledger: worst errors over every output and input set."""
        finite = [o for o in self.outputs if o.max_abs is not None]
        cosines = [o.cosine for o in self.outputs if o.cosine is not None]
        return {
            "ok": self.ok,
            "reason": self.reason,
            "max_abs": max((o.max_abs for o in finite if o.max_abs is not None), default=None),
            "max_rel": max((o.max_rel for o in finite if o.max_rel is not None), default=None),
            "min_cosine": min(cosines, default=None),
            "mismatches": sum(o.mismatches for o in self.outputs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "outputs": [o.to_dict() for o in self.outputs]}


def _as_float(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def compare_output(input_set: str, name: str, ref: np.ndarray, got: np.ndarray, tolerance: Tolerance) -> OutputStats:
    """Compare one output. Floats: numpy.isclose(atol, rtol, equal_nan) plus cosine; other dtypes: exact."""
    ref, got = np.asarray(ref), np.asarray(got)
    stats = OutputStats(
        input_set,
        name,
        ok=True,
        reason=None,
        shape_ref=list(ref.shape),
        shape_got=list(got.shape),
        dtype_ref=str(ref.dtype),
        dtype_got=str(got.dtype),
        elements=int(ref.size),
    )
    if ref.dtype != got.dtype:
        stats.ok, stats.reason = False, f"dtype {got.dtype} instead of {ref.dtype}"
        return stats
    if ref.shape != got.shape:
        stats.ok, stats.reason = False, f"shape {list(got.shape)} instead of {list(ref.shape)}"
        return stats
    atol, rtol = tolerance.atol, tolerance.rtol
    if ref.dtype.kind in "fc":
        r64, g64 = ref.astype(np.float64), got.astype(np.float64)
        stats.nan_ref, stats.nan_got = int(np.isnan(r64).sum()), int(np.isnan(g64).sum())
        stats.inf_ref, stats.inf_got = int(np.isinf(r64).sum()), int(np.isinf(g64).sum())
        atol, rtol = tolerance.bounds(ref.dtype)
        close = tolerance.close(r64, g64, ref.dtype)
        both = np.isfinite(r64) & np.isfinite(g64)
        if both.any():
            diff = np.abs(g64[both] - r64[both])
            stats.max_abs = _as_float(diff.max())
            stats.max_rel = _as_float((diff / np.maximum(np.abs(r64[both]), np.finfo(np.float64).tiny)).max())
            a, b = r64[both].ravel(), g64[both].ravel()
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            if na == 0 and nb == 0:
                stats.cosine = 1.0
            elif na == 0 or nb == 0:
                stats.cosine = 0.0
            else:
                stats.cosine = float(np.clip(np.dot(a, b) / (na * nb), -1.0, 1.0))
        elif ref.size:
            stats.max_abs, stats.max_rel = 0.0, 0.0
    else:
        close = ref == got
        if ref.size and ref.dtype.kind in "iub":  # strings (a classifier's labels) have equality only
            stats.max_abs = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max())
    stats.mismatches = int(ref.size - int(np.count_nonzero(close)))
    stats.mismatch_ratio = stats.mismatches / ref.size if ref.size else 0.0
    problems = []
    if stats.mismatch_ratio > tolerance.max_mismatch_ratio:
        problems.append(
            f"{stats.mismatches}/{ref.size} elements outside atol={atol:g} rtol={rtol:g} (max abs {stats.max_abs:.3g})"
            if stats.max_abs is not None
            else f"{stats.mismatches}/{ref.size} elements differ"
        )
    if stats.cosine is not None and stats.cosine < tolerance.min_cosine and ref.size > 1:
        problems.append(f"cosine {stats.cosine:.6f} < {tolerance.min_cosine}")
    if stats.nan_got != stats.nan_ref or stats.inf_got != stats.inf_ref:
        problems.append(f"NaN/Inf counts {stats.nan_got}/{stats.inf_got} instead of {stats.nan_ref}/{stats.inf_ref}")
    if problems:
        stats.ok, stats.reason = False, "; ".join(problems)
    return stats


def _valid_mask(spec: Mapping[str, Any], feeds: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """Boolean mask over an output's leading axes: True where the position is defined."""
    if "mask_input" in spec and spec["mask_input"] in feeds:
        return np.asarray(feeds[spec["mask_input"]]) != 0
    if "ids_input" in spec and spec["ids_input"] in feeds:
        return np.asarray(feeds[spec["ids_input"]]) != spec.get("pad_token_id")
    return None


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (a size check first: different models rarely share a size)."""
    try:
        if os.path.samefile(a, b):
            return True
        if os.stat(a).st_size != os.stat(b).st_size:
            return False
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _run_original(session: Any, input_set: InputSet) -> list[np.ndarray]:
    """The original's outputs on ``input_set``; when it refuses a generated set, the set's next guesses in
    turn, the one that runs replacing the set in place (with the refused ones in its provenance)."""
    attempts: list[dict[str, Any]] = []
    current = input_set
    while True:
        try:
            outputs = session.run(None, current.feeds)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            attempts.append({"guess": current.provenance.get("guess"), "input_set": current.name, "error": error[:500]})
            following = current.next_guess() if current.next_guess is not None else None
            if following is not None:
                current = following
                continue
            tried = f" (also tried: {', '.join(str(a['guess']) for a in attempts[1:])})" if len(attempts) > 1 else ""
            raise InvalidInputError(
                f"the original model fails on input set {input_set.name!r}: {attempts[0]['error']}{tried}; "
                "give shapes in the config or upload samples.npz",
                code="MODEL_RUN_FAILED",
            ) from exc
        if current is not input_set:
            input_set.adopt(current, attempts)
        return outputs


class Verifier:
    """Reference outputs of the original, computed once; ``check`` compares any candidate with them."""

    def __init__(
        self,
        original_path: Path,
        input_sets: Sequence[InputSet],
        tolerance: Tolerance,
        *,
        target: str = "cpu",
        intra_op_threads: int = 0,
    ) -> None:
        self.input_sets = list(input_sets)
        self.original_path = Path(original_path)
        self.sessions_built = 0  # candidate sessions check() built (the original's bytes need none)
        self.tolerance = tolerance
        self.target = target
        self.intra_op_threads = intra_op_threads
        try:
            session = make_session(original_path, target=target, intra_op_threads=intra_op_threads)
        except UnavailableError:
            raise
        except Exception as exc:
            raise InvalidModelError(
                f"ONNX Runtime cannot load the original model: {type(exc).__name__}: {exc}",
                code="INVALID_MODEL",
            ) from exc
        self.output_names = [o.name for o in session.get_outputs()]
        # What a feed must name: an input set made for other inputs (a pass's, before an input change) is
        # carried to this reference by these names (``workers.ledger``).
        self.input_names = [i.name for i in session.get_inputs()]
        self.refused: dict[str, str] = {}  # add_sets' sets the original refused, name -> error
        self.reference: list[list[np.ndarray]] = []
        for input_set in self.input_sets:
            self.reference.append(_run_original(session, input_set))

    def add_sets(self, input_sets: Sequence[InputSet]) -> dict[str, str]:
        """Verify every later candidate on ``input_sets`` too (a pass's ``PassResult.verify_inputs``), the
        original's outputs computed now; a set held already (by name) is skipped. Returns the sets the original
        refused, name -> its error: they are dropped, since the upload defines no output there."""
        held = {s.name for s in self.input_sets}
        new = [s for s in input_sets if s.name not in held and s.name not in self.refused]
        if new:
            session = make_session(self.original_path, target=self.target, intra_op_threads=self.intra_op_threads)
        for input_set in new:
            try:
                outputs = session.run(None, input_set.feeds)
            except Exception as exc:
                self.refused[input_set.name] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            self.input_sets.append(input_set)
            self.reference.append(outputs)
        return {s.name: self.refused[s.name] for s in input_sets if s.name in self.refused}

    def drift(self, outputs: Callable[[int], Sequence[np.ndarray]]) -> dict[str, Any]:
        """The upload as users run it (``outputs(i)``: input set ``i``'s outputs at ORT's default level, the
        baseline's session) against the reference (optimizations off) on every input set, summed up as
        ``VerificationResult.worst``: how far ORT's own rewrites move its outputs. Beyond the tolerance, the
        outputs are not continuous in rounding (a TopK, ArgMax or NMS over near-tied scores: RT-DETR picks its
        queries that way), and no rewrite that changes rounding can verify on these inputs."""
        return self._compare([outputs(i) for i in range(len(self.input_sets))], {}).worst()

    def check(
        self,
        candidate_path: Path,
        valid_positions: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        adapter: Path | None = None,
    ) -> VerificationResult:
        """Compare a candidate with the reference. ``valid_positions`` maps an output name to the input that
        says which positions are defined (``{"mask_input": name, "axes": [0, 1]}`` or ``{"ids_input": name,
        "pad_token_id": id, "axes": [0, 1]}``): those outputs are compared at valid positions only.
        ``adapter``: an ``.onnx_adapter`` active on every run (extract_adapters moved the uploaded model's LoRA
        weights into it: only with it does the candidate compute what the original computes)."""
        valid_positions = valid_positions or {}
        if adapter is None and same_bytes(Path(candidate_path), self.original_path):
            # The original's bytes (the upload returned): ORT with optimizations off computes the reference
            # again, so the reference is compared with itself rather than rebuilt for a large model.
            return self._compare(self.reference, valid_positions)
        try:
            self.sessions_built += 1
            session = make_session(candidate_path, target=self.target, intra_op_threads=self.intra_op_threads)
        except UnavailableError:
            raise
        except Exception as exc:
            return VerificationResult(False, [], f"ONNX Runtime cannot load the candidate: {type(exc).__name__}: {exc}")
        try:
            run_options, _active = run_options_with(adapter)  # _active: ORT does not keep the adapter alive
        except Exception as exc:
            return VerificationResult(False, [], f"ONNX Runtime cannot load the adapter: {type(exc).__name__}: {exc}")
        names = [o.name for o in session.get_outputs()]
        if names != self.output_names:
            return VerificationResult(False, [], f"outputs {names} instead of {self.output_names}")
        results: list[list[np.ndarray]] = []
        for input_set in self.input_sets:
            try:
                results.append(session.run(None, input_set.feeds, run_options))
            except Exception as exc:
                done = self._compare(results, valid_positions).outputs
                return VerificationResult(
                    False, done, f"the candidate fails on {input_set.name!r}: {type(exc).__name__}: {exc}"
                )
        return self._compare(results, valid_positions)

    def _compare(
        self, results: Sequence[Sequence[np.ndarray]], valid_positions: Mapping[str, Mapping[str, Any]]
    ) -> VerificationResult:
        """The candidate's outputs (one list per input set, in order; fewer when it failed) against the reference."""
        outputs: list[OutputStats] = []
        for input_set, reference, got in zip(self.input_sets, self.reference, results, strict=False):
            for name, ref, value in zip(self.output_names, reference, got, strict=True):
                spec = valid_positions.get(name)
                if spec is None:
                    outputs.append(compare_output(input_set.name, name, ref, value, self.tolerance))
                    continue
                mask = _valid_mask(spec, input_set.feeds)
                if mask is None or ref.shape != value.shape or ref.shape[: mask.ndim] != mask.shape:
                    stats = compare_output(input_set.name, name, ref, value, self.tolerance)
                else:
                    stats = compare_output(input_set.name, name, ref[mask], value[mask], self.tolerance)
                    stats.shape_ref, stats.shape_got = list(ref.shape), list(value.shape)
                    stats.positions = "valid"
                outputs.append(stats)
        bad = [o for o in outputs if not o.ok]
        if bad:
            first = bad[0]
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            return VerificationResult(
                False, outputs, f"output {first.name!r} on {first.input_set}: {first.reason}{more}"
            )
        return VerificationResult(True, outputs, None)
