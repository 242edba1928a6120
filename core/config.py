"""The job configuration: what a client sends in the ``config`` field, and what ``onnxforge optimize`` reads.

The same JSON serves the API, the CLI (``--config FILE.json``) and the pipeline, so a job submitted over
HTTP and a local run with the same file produce the same artifact.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import InvalidConfigError

Target = Literal["cpu", "cuda", "tensorrt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PassSpec(_Strict):
    name: str = Field(description="A pass name from GET /v1/passes.")
    options: dict[str, Any] = Field(default_factory=dict, description="The pass's options (see its schema).")


class Tolerance(_Strict):
    """An element passes when |got - ref| <= atol + rtol * |ref| (numpy.isclose)."""

    atol: float = Field(1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance.")
    min_cosine: float = Field(0.999, ge=-1, le=1, description="Least cosine similarity per output.")
    max_mismatch_ratio: float = Field(
        0.0, ge=0, le=1, description="Share of elements allowed outside atol/rtol (0: none)."
    )
    half_precision_floor: bool = Field(
        True,
        description="A float16 or bfloat16 output is compared with atol and rtol of at least 4 units in the last "
        "place of its type (float16 3.9e-3, bfloat16 3.1e-2): a fused kernel sums in another order, and a bound "
        "finer than the type resolves refuses every fusion of a half-precision model. So is every float output of "
        "a model whose float weights are mostly of that type (float32 inputs and outputs around half-precision "
        "arithmetic). False: atol/rtol as given.",
    )

    def bounds(self, dtype: Any) -> tuple[float, float]:
        """(atol, rtol) for an output of ``dtype`` (a numpy dtype or its name)."""
        try:
            name = np.dtype(dtype).name
        except TypeError:  # a name numpy does not know (bfloat16 without ml_dtypes)
            name = str(dtype)
        floor = HALF_PRECISION_FLOOR.get(name) if self.half_precision_floor else None
        if floor is None:
            return self.atol, self.rtol
        return max(self.atol, floor), max(self.rtol, floor)

    def close(self, ref: np.ndarray, got: np.ndarray, dtype: Any) -> np.ndarray:
        """Which elements of ``got`` are within this tolerance of ``ref`` (float64 arrays of an output of ``dtype``):
        ``numpy.isclose`` at ``bounds(dtype)``, NaN matching NaN. The engine's verification and the quantizers'
        budget count mismatches by this one rule."""
        atol, rtol = self.bounds(dtype)
        return np.isclose(got, ref, atol=atol, rtol=rtol, equal_nan=True)

    def in_precision(self, compute: str | None) -> Tolerance:
        """This tolerance for a model that computes in ``compute`` ("float16", "bfloat16" or None) whatever
        its outputs' type: a half-precision model with float32 inputs and outputs (ORT's float16 converter with
        ``keep_io_types``) has float32 outputs that are only as exact as its float16 arithmetic, so every float
        output gets the floor of ``compute`` (with ``half_precision_floor``)."""
        floor = HALF_PRECISION_FLOOR.get(compute or "") if self.half_precision_floor else None
        if floor is None or (self.atol >= floor and self.rtol >= floor):
            return self
        return self.model_copy(update={"atol": max(self.atol, floor), "rtol": max(self.rtol, floor)})


# 4 units in the last place (machine epsilon) of each half-precision type: float16 2**-10, bfloat16 2**-7.
HALF_PRECISION_FLOOR = {"float16": 4 * 2.0**-10, "bfloat16": 4 * 2.0**-7}


class DecoderBenchmark(_Strict):
    """Prefill and decode figures of a decoder with a KV cache (workers/decoder_benchmark.py)."""

    enabled: bool = Field(True, description="Measure prefill and decode when the model has a KV cache.")
    prompt_lengths: list[int] = Field(
        [128, 512],
        min_length=1,
        max_length=4,
        description="Prompt lengths timed as a prefill on an empty past; clipped to the graph's position table.",
    )
    new_tokens: int = Field(32, ge=1, le=1024, description="Tokens generated one at a time on the growing cache.")
    time_budget_s: float = Field(20.0, gt=0, le=600, description="Seconds the decoder benchmark may take.")

    @field_validator("prompt_lengths")
    @classmethod
    def _lengths(cls, lengths: list[int]) -> list[int]:
        if any(n < 1 or n > 65536 for n in lengths) or len(set(lengths)) != len(lengths):
            raise ValueError(f"prompt_lengths must be distinct integers in 1..65536, got {lengths}")
        return lengths


# Tight for exact presets: float reassociation in fused kernels stays far inside these.
EXACT_TOLERANCE = Tolerance()


class JobConfig(_Strict):
    preset: str | None = Field(None, description="A preset name (GET /v1/passes lists them).")
    passes: list[str | PassSpec] | None = Field(
        None, description="Explicit pass list; each entry a name or {name, options}. Overrides preset."
    )
    target: Target = Field("cpu", description="Device the model is optimized, verified and benchmarked for.")
    tolerance: Tolerance | None = Field(None, description="Verification tolerance. Unset: the preset's.")
    fail_on_regression: bool = Field(
        False,
        description="If the optimized model is slower or out of tolerance, fail the job (code "
        "PERFORMANCE_REGRESSION / VERIFICATION_FAILED) instead of returning the original model.",
    )
    rollback_slower: bool | None = Field(
        None, description="Roll back passes that make the model slower. Unset: the server's setting."
    )
    benchmark: bool = Field(True, description="Benchmark original and optimized models.")
    decoder_benchmark: DecoderBenchmark = Field(
        default_factory=DecoderBenchmark,
        description="Prefill and decode benchmark of decoders with a KV cache (skipped for other models).",
    )
    shapes: list[dict[str, list[int]]] | None = Field(
        None,
        description='Input shapes to verify and benchmark, e.g. [{"input_ids": [1, 128]}]. '
        "Unset: from samples, else generated from the graph's symbolic dims.",
    )
    seed: int = Field(0, description="Seed of generated verification inputs.")
    time_budget_s: float | None = Field(
        None,
        gt=0,
        description="Preset auto: seconds to spend on candidates (passes plus benchmarks); a candidate that "
        "would start after the budget is skipped. Unset: 600.",
    )
    use_cache: bool = Field(
        True,
        description="Answer from the result cache when the same model and configuration already succeeded "
        "(server setting cache.enabled). false: always run; the result still fills the cache.",
    )
    callback_url: str | None = Field(
        None,
        max_length=2048,
        description="URL the service POSTs a signed JSON notice to when the job ends (succeeded, failed or "
        "canceled). Its host must be on the operator's webhooks.allowed_hosts. Not passed to the optimizer "
        "and not part of the report.",
    )

    @field_validator("passes")
    @classmethod
    def _not_empty(cls, passes: list[str | PassSpec] | None) -> list[str | PassSpec] | None:
        if passes is not None and not passes:
            raise ValueError("passes must name at least one pass, or be omitted")
        return passes

    @model_validator(mode="after")
    def _one_of(self) -> JobConfig:
        if self.preset is not None and self.passes is not None:
            raise ValueError("give either preset or passes, not both")
        return self

    def pass_specs(self) -> list[PassSpec] | None:
        if self.passes is None:
            return None
        return [PassSpec(name=p) if isinstance(p, str) else p for p in self.passes]

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any] | None) -> JobConfig:
        """Parse and validate, raising InvalidConfigError that names the offending field."""
        try:
            if data is None or data in ("", b""):
                return cls()
            if isinstance(data, (str, bytes)):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']}" for err in exc.errors()
            )
            raise InvalidConfigError(f"invalid config: {problems}") from exc
