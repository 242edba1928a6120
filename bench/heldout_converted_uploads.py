"""Held-out probe, round 4 (issue 17): uploads a team has already run through ONNX Runtime's own tools.

Run ``python -m bench.heldout_converted_uploads [--only NAME ...] [--exporters FORM ...] [--reuse]``.

A team often sends a model it has already converted: quantized to int8 by ``quantize_dynamic`` (MatMulInteger)
or ``quantize_static`` (QDQ), converted to float16 by ``onnxruntime.transformers.float16`` with float32 inputs
and outputs kept (``keep_io_types=True``: Casts around half-precision arithmetic, the input Casts appended after
their readers), or to int4 by ``MatMulNBitsQuantizer`` (block 32, symmetric), or fused by ORT's transformers
optimizer and then converted to float16 (``ortopt_fp16``, Optimum's ``-O4``). Each base model is a task-head
export of ``bench.heldout_task_heads`` (built there when missing); each form goes through ``onnxforge optimize
MODEL --preset fast`` (``bench.coverage.run_job``, ``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1``). The job
must complete, verify against the converted upload (the reference is what was sent) and not be slower. Rows
go to ``bench/out/heldout/converted/``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout, heldout_task_heads  # noqa: E402
from bench.coverage import run_job  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "converted"
BASES = ("bert_seq_cls/ts_sdpa", "llama_seq_cls/dynamo", "vit_image_cls/dynamo", "wav2vec2_ctc/ts_sdpa")
FORMS = ("int8_dynamic", "qdq_static", "fp16_keep_io", "int4_nbits", "ortopt_fp16")
ORT_MODEL_TYPE = {"bert_seq_cls": "bert", "llama_seq_cls": "gpt2", "vit_image_cls": "vit"}
CALIBRATION_SETS = 8


def _feeds(base: str, seed: int) -> dict[str, np.ndarray]:
    spec = heldout_task_heads.SPECS[base.split("/", maxsplit=1)[0]]
    return heldout_task_heads.feeds(spec, 2, 16, seed=seed)


def _int8_dynamic(src: Path, dst: Path, base: str) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)


def _qdq_static(src: Path, dst: Path, base: str) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.sets = iter([_feeds(base, seed) for seed in range(CALIBRATION_SETS)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.sets, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ)


def _fp16_keep_io(src: Path, dst: Path, base: str) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(onnx.load(str(src)), keep_io_types=True), str(dst))


def _int4_nbits(src: Path, dst: Path, base: str) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=32, is_symmetric=True)
    quantizer.process()
    onnx.save(quantizer.model.model, str(dst))


def _ortopt_fp16(src: Path, dst: Path, base: str) -> None:
    """ORT's transformers optimizer (its model type, the probe's 4 heads of hidden 32), then its float16
    conversion with float32 inputs and outputs: what ``optimum-cli onnxruntime optimize -O4`` writes."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = ORT_MODEL_TYPE.get(base.split("/", maxsplit=1)[0])
    if model_type is None:
        raise ValueError(f"ORT's transformers optimizer has no model type for {base}")
    optimized = optimize_model(str(src), model_type=model_type, num_heads=4, hidden_size=32)
    optimized.convert_float_to_float16(keep_io_types=True)
    optimized.save_model_to_file(str(dst))


CONVERT: dict[str, Callable[[Path, Path, str], None]] = {
    "int8_dynamic": _int8_dynamic,
    "qdq_static": _qdq_static,
    "fp16_keep_io": _fp16_keep_io,
    "int4_nbits": _int4_nbits,
    "ortopt_fp16": _ortopt_fp16,
}


def _base(base: str) -> Path:
    name, exporter = base.split("/")
    path = heldout_task_heads.OUT / f"{name}_{exporter}.onnx"
    if not path.exists():
        heldout_task_heads.OUT.mkdir(parents=True, exist_ok=True)
        heldout_task_heads.build(name, exporter, heldout_task_heads.OUT)
    return path


def one(base: str, form: str, out: Path, reuse: bool) -> dict[str, Any]:
    stem = base.replace("/", "_") + f"_{form}"
    record = out / f"{stem}.json"
    if reuse and record.exists():
        return json.loads(record.read_text())
    row: dict[str, Any] = {"model": base, "exporter": form}
    path = out / f"{stem}.onnx"
    try:
        CONVERT[form](_base(base), path, base)
        row.update(ok=True, path=str(path))
    except Exception as exc:  # a converter's own refusal is the row's finding
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    if row["ok"]:
        with tempfile.TemporaryDirectory(prefix=f"converted_{stem}_") as tmp:
            job = run_job(path, Path(tmp), benchmark_seconds=1, timeout=900)
            returned = Path(job["path"]) if job.get("ok") else None
            row["structure"] = _heldout.structure(path, returned)
        row["job"] = job
    record.write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    return row


def cells(row: dict[str, Any]) -> list[str]:
    return _heldout.fusion_cells(row, lambda r: _heldout.job_notes(r["job"]))


HEAD = ["base model", "form", "job", "exact (max abs)", "attention", "skip+norm", "gelu", "speedup; notes"]


def main(argv: list[str] | None = None) -> int:
    parser = _heldout.arguments("python -m bench.heldout_converted_uploads", __doc__, BASES, FORMS)
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = _heldout.run_all(args.only, args.exporters, lambda b, f: one(b, f, OUT, args.reuse), cells)
    print()
    print(_heldout.table(HEAD, map(cells, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
