"""Bench-size Hugging Face models and realistic inputs for the bench scripts.

``ensure_bench_model(name)`` returns the path of the bench-size ONNX model ``name`` (the sizes of the models
in the issues; see ``tests/models/README.md``), building it with ``tests/models/build_hf.py`` on first use
and caching it in ``bench/out/models`` (never committed). A cached file is reused while its ``.json``
sidecar matches the current build spec (builder version, opset, dimensions, torch/transformers/onnx
versions); building needs the ``dev`` extra (torch, transformers), reusing a cached file does not.

``make_inputs(name, batch, seq, pad_fraction, valid_label_fraction, seed)`` makes the int64 feeds: right-padded
attention masks with exactly ``round(pad_fraction * batch * seq)`` padding tokens spread unevenly over the
rows (each row keeps at least one real token), and for ``bert_mlm_loss`` labels that are -100 except on
``round(valid_label_fraction * real tokens)`` random real positions.

Bench models: roberta_cls, bert_mlm_loss, bert_encoder, xlnet, gpt2 (6 layers, hidden 768, 12 heads,
intermediate 3072), bert_base (BertModel, 12 layers) and minilm (BertModel, 6 layers, hidden 384).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench scripts may run as files rather than with python -m
    sys.path.insert(0, str(REPO))

from tests.models import build_hf  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "out" / "models"
BENCH_MODELS: tuple[str, ...] = tuple(n for n, s in build_hf.SPECS.items() if "bench" in s.dims)

__all__ = ["BENCH_MODELS", "DEFAULT_OUT", "ensure_bench_model", "make_inputs", "model_info"]


def _have_torch() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def model_info(name: str, out_dir: Path | str | None = None) -> dict | None:
    """The sidecar of a cached bench model (spec, versions, size, sha256, build time, max |ORT - torch|),
    or None when there is no complete cached build."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    path = out / build_hf.filename(name, "bench")
    sidecar = path.with_suffix(".json")
    if not (path.exists() and sidecar.exists()):
        return None
    try:
        info = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if info.get("bytes") != path.stat().st_size:  # a half-written or replaced file
        return None
    return info


def _is_current(info: dict, name: str) -> bool:
    want = build_hf.spec_key(name, "bench")
    fields = ("name", "size", "builder_version", "opset", "dims")
    if any(info.get(f) != want[f] for f in fields):
        return False
    if info.get("versions") == want["versions"]:
        return True
    if not _have_torch():  # cannot rebuild here: use the cached build, but say so
        warnings.warn(
            f"bench model {name} was built with {info.get('versions')}; torch/transformers are not installed "
            "so it cannot be rebuilt, using the cached file",
            stacklevel=3,
        )
        return True
    return False


def ensure_bench_model(name: str, out_dir: Path | str | None = None, *, rebuild: bool = False) -> Path:
    """Path of the bench-size model ``name`` in ``out_dir`` (default ``bench/out/models``), built on demand."""
    if name not in BENCH_MODELS:
        raise KeyError(f"unknown bench model {name!r}; choose from {', '.join(BENCH_MODELS)}")
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    path = out / build_hf.filename(name, "bench")
    info = None if rebuild else model_info(name, out)
    if info is not None and _is_current(info, name):
        return path
    if not _have_torch():
        raise RuntimeError(
            f"bench model {name} is not cached in {out} and building it needs torch and transformers: "
            "pip install -e '.[dev]'"
        )
    return build_hf.build(name, "bench", out)


def make_inputs(
    name: str,
    batch: int,
    seq: int,
    *,
    pad_fraction: float = 0.0,
    valid_label_fraction: float = 1.0,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Feeds for the bench-size model ``name``: {input name: int64[batch, seq]} in graph input order."""
    return build_hf.make_inputs(
        name,
        batch,
        seq,
        pad_fraction=pad_fraction,
        valid_label_fraction=valid_label_fraction,
        seed=seed,
        size="bench",
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.models", description="Build or reuse bench models.")
    parser.add_argument("names", nargs="*", default=list(BENCH_MODELS), help="default: all")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args(argv)
    for name in args.names:
        path = ensure_bench_model(name, args.out, rebuild=args.rebuild)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
