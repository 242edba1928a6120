"""Build Hugging Face transformer models as ONNX, from config objects with random weights.

Run ``python -m tests.models.build_hf [--out DIR] [--size tiny|bench] [--only NAME]``. The ``tiny`` files are
committed under ``tests/models/`` (``hf_<name>.onnx``); the ``bench`` files (the sizes of the models in the
issues) go to ``bench/out/models/`` (``hf_<name>_bench.onnx``) and are never committed: ``bench/models.py``
builds them on demand. See ``tests/models/README.md`` for what each graph contains.

Nothing is downloaded: each model is built from a ``transformers`` config object, with
``torch.manual_seed(0)`` and every parameter perturbed (so biases are not zero and LayerNorm scales not one:
the exporter would otherwise fold equal initializers into one and drop zero biases, a graph no real
checkpoint gives), in eval mode, and exported with the dynamo exporter (``torch.onnx.export(dynamo=True)``,
opset 18, eager attention). Each export is checked with ``onnx.checker`` (full check), for plain-ONNX ops
and named ``batch``/``sequence`` axes, and against the torch model's outputs in ONNX Runtime on padded
batches of shapes other than the export example (atol and rtol 1e-4); any failure raises.

torch and transformers (the ``dev`` extra) are imported only inside the build functions: the specs and
``make_inputs`` need only numpy, so tests and bench scripts can import this module without them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BENCH_OUT = REPO / "bench" / "out" / "models"
OPSET = 18
BUILDER_VERSION = 1  # bump when a change here changes the exported graphs (invalidates bench caches)
IGNORE_INDEX = -100
ATOL = 1e-4
RTOL = 1e-4
SIZES = ("tiny", "bench")


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int


@dataclass(frozen=True)
class Spec:
    """One model: its transformers class, graph signature and the token ids its inputs use."""

    name: str
    arch: str  # key into _BUILDERS
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dims: dict[str, Dims]  # by size; a model without "tiny" is bench-only
    pad_id: int
    first_id: int | None = None  # token put at position 0 ([CLS], <s>)
    last_id: int | None = None  # token put at the last valid position ([SEP], </s>)
    low_id: int = 5  # random tokens are drawn from [low_id, vocab)
    extra: dict[str, Any] = field(default_factory=dict)

    def vocab(self, size: str) -> int:
        return self.dims[size].vocab


_TINY = Dims(layers=2, hidden=32, heads=4, intermediate=64, vocab=256, max_positions=128)
_BERT6 = Dims(layers=6, hidden=768, heads=12, intermediate=3072, vocab=30522, max_positions=512)

SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec(
            "roberta_cls",
            "roberta_cls",
            ("input_ids", "attention_mask"),
            ("logits",),
            # RoBERTa positions start at pad_id + 1, so max_positions = longest sequence + 2.
            {"tiny": Dims(2, 32, 4, 64, 256, 130), "bench": Dims(6, 768, 12, 3072, 30522, 514)},
            pad_id=1,
            first_id=0,
            last_id=2,
            extra={"num_labels": 2},
        ),
        Spec(
            "bert_mlm_loss",
            "bert_mlm",
            ("input_ids", "attention_mask", "labels"),
            ("loss", "logits"),
            {"tiny": _TINY, "bench": _BERT6},
            pad_id=0,
            first_id=101,
            last_id=102,
            low_id=999,
        ),
        Spec(
            "bert_encoder",
            "bert_encoder",
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state",),
            {"tiny": _TINY, "bench": _BERT6},
            pad_id=0,
            first_id=101,
            last_id=102,
            low_id=999,
        ),
        Spec(
            "xlnet",
            "xlnet",
            ("input_ids", "attention_mask"),
            ("last_hidden_state",),
            {"tiny": _TINY, "bench": Dims(6, 768, 12, 3072, 32000, 512)},
            pad_id=5,
            last_id=3,  # XLNet puts <cls> last
            low_id=10,
        ),
        Spec(
            "gpt2",
            "gpt2",
            ("input_ids", "attention_mask"),
            ("logits",),
            {"tiny": _TINY, "bench": Dims(6, 768, 12, 3072, 50257, 1024)},
            pad_id=50256,  # GPT-2 has no pad token; pipelines pad with <|endoftext|> (the last id)
            low_id=0,
        ),
        Spec(
            "bert_base",
            "bert_encoder",
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state",),
            {"bench": Dims(12, 768, 12, 3072, 30522, 512)},
            pad_id=0,
            first_id=101,
            last_id=102,
            low_id=999,
        ),
        Spec(
            "minilm",
            "bert_encoder",
            ("input_ids", "attention_mask", "token_type_ids"),
            ("last_hidden_state",),
            {"bench": Dims(6, 384, 12, 1536, 30522, 512)},
            pad_id=0,
            first_id=101,
            last_id=102,
            low_id=999,
        ),
    )
}


def _token_ids(spec: Spec, size: str) -> dict[str, int | None]:
    """Special ids scaled into the tiny vocabularies (a 256-token vocabulary has no id 101 or 50256)."""
    vocab = spec.vocab(size)
    ids = {"pad": spec.pad_id, "first": spec.first_id, "last": spec.last_id, "low": spec.low_id}
    if size == "tiny":
        tiny = {"pad": spec.pad_id, "first": spec.first_id, "last": spec.last_id, "low": 5}
        if spec.name == "gpt2":
            tiny.update(pad=vocab - 1, low=0)
        elif spec.first_id == 101:  # BERT family: [PAD]=0, [CLS], [SEP] remapped below low
            tiny.update(first=2, last=3)
        ids = tiny
    return ids


def filename(name: str, size: str) -> str:
    return f"hf_{name}.onnx" if size == "tiny" else f"hf_{name}_{size}.onnx"


def default_out(size: str) -> Path:
    return HERE if size == "tiny" else BENCH_OUT


# ----------------------------------------------------------------------------------------------- inputs


def _pad_counts(rng: np.random.Generator, batch: int, seq: int, pad_fraction: float) -> np.ndarray:
    """Padding tokens per row: exactly round(pad_fraction * batch * seq) in all, at least one real token
    per row, spread unevenly over the rows (as real batches are)."""
    if not 0.0 <= pad_fraction < 1.0:
        raise ValueError(f"pad_fraction must be in [0, 1), got {pad_fraction}")
    cap = seq - 1
    total = min(round(pad_fraction * batch * seq), cap * batch)
    weights = rng.uniform(0.25, 1.75, size=batch)
    pads = np.minimum(np.floor(total * weights / weights.sum()).astype(np.int64), cap)
    order = rng.permutation(batch)
    i = 0
    while pads.sum() < total:  # hand out the remainder one token at a time to rows with room
        row = order[i % batch]
        if pads[row] < cap:
            pads[row] += 1
        i += 1
    return pads


def make_inputs(
    name: str,
    batch: int,
    seq: int,
    *,
    pad_fraction: float = 0.0,
    valid_label_fraction: float = 1.0,
    seed: int = 0,
    size: str = "bench",
) -> dict[str, np.ndarray]:
    """Realistic int64 inputs for model ``name`` at ``size``: right-padded rows (``pad_fraction`` of all
    tokens are padding, at least one real token per row), [CLS]/<s> and [SEP]/</s> where the model's
    tokenizer puts them, pad ids under the padding, and for models with ``labels`` the ignore index
    (-100) except on ``round(valid_label_fraction * real tokens)`` randomly chosen real positions, which
    carry the token id (masked-LM style)."""
    spec = SPECS[name]
    if size not in spec.dims:
        raise ValueError(f"{name} has no {size} size (sizes: {sorted(spec.dims)})")
    if seq < 2 or batch < 1:
        raise ValueError("need batch >= 1 and seq >= 2")
    dims = spec.dims[size]
    limit = dims.max_positions - (2 if spec.arch == "roberta_cls" else 0)
    if seq > limit:
        raise ValueError(f"{name} ({size}) takes at most {limit} tokens, got seq={seq}")
    if not 0.0 <= valid_label_fraction <= 1.0:
        raise ValueError(f"valid_label_fraction must be in [0, 1], got {valid_label_fraction}")
    ids = _token_ids(spec, size)
    rng = np.random.default_rng(seed)
    specials = [v for k, v in ids.items() if k != "low" and v is not None]
    text_ids = np.setdiff1d(np.arange(ids["low"], dims.vocab, dtype=np.int64), specials)
    input_ids = rng.choice(text_ids, size=(batch, seq))
    valid = seq - _pad_counts(rng, batch, seq, pad_fraction)
    mask = (np.arange(seq)[None, :] < valid[:, None]).astype(np.int64)
    for row, n in enumerate(valid):
        if ids["first"] is not None and n >= 2:
            input_ids[row, 0] = ids["first"]
        if ids["last"] is not None and n >= 2:
            input_ids[row, n - 1] = ids["last"]
    input_ids[mask == 0] = ids["pad"]
    out = {"input_ids": input_ids, "attention_mask": mask}
    if "token_type_ids" in spec.inputs:
        out["token_type_ids"] = np.zeros((batch, seq), dtype=np.int64)
    if "labels" in spec.inputs:
        labels = np.full((batch, seq), IGNORE_INDEX, dtype=np.int64)
        real = np.flatnonzero(mask.reshape(-1))
        k = round(valid_label_fraction * real.size)
        chosen = rng.choice(real, size=k, replace=False)
        labels.reshape(-1)[chosen] = input_ids.reshape(-1)[chosen]
        out["labels"] = labels
    return {k: out[k] for k in spec.inputs}


# ----------------------------------------------------------------------------------------------- torch


def _config(spec: Spec, size: str) -> Any:
    import transformers as tf

    d = spec.dims[size]
    ids = _token_ids(spec, size)
    common = {"attn_implementation": "eager"}
    if spec.arch in ("roberta_cls", "bert_mlm", "bert_encoder"):
        cls = tf.RobertaConfig if spec.arch == "roberta_cls" else tf.BertConfig
        kw = {
            "vocab_size": d.vocab,
            "hidden_size": d.hidden,
            "num_hidden_layers": d.layers,
            "num_attention_heads": d.heads,
            "intermediate_size": d.intermediate,
            "max_position_embeddings": d.max_positions,
            "pad_token_id": ids["pad"],
        }
        if spec.arch == "roberta_cls":
            kw.update(bos_token_id=ids["first"], eos_token_id=ids["last"], type_vocab_size=1, **spec.extra)
        return cls(**kw, **common)
    if spec.arch == "xlnet":
        return tf.XLNetConfig(
            vocab_size=d.vocab,
            d_model=d.hidden,
            n_layer=d.layers,
            n_head=d.heads,
            d_inner=d.intermediate,
            pad_token_id=ids["pad"],
            mem_len=None,
            use_mems_eval=False,
            **common,
        )
    if spec.arch == "gpt2":
        return tf.GPT2Config(
            vocab_size=d.vocab,
            n_embd=d.hidden,
            n_layer=d.layers,
            n_head=d.heads,
            n_inner=d.intermediate,
            n_positions=d.max_positions,
            bos_token_id=ids["pad"],
            eos_token_id=ids["pad"],
            use_cache=False,
            **common,
        )
    raise KeyError(spec.arch)


def _module(spec: Spec, size: str) -> Any:
    """The transformers model in eval mode, wrapped to take the inputs positionally and return a plain
    tuple of the graph outputs."""
    import torch
    import transformers as tf

    config = _config(spec, size)
    torch.manual_seed(0)
    if spec.arch == "roberta_cls":
        model = tf.RobertaForSequenceClassification(config)
    elif spec.arch == "bert_mlm":
        model = tf.BertForMaskedLM(config)
    elif spec.arch == "bert_encoder":
        model = tf.BertModel(config, add_pooling_layer=False)
    elif spec.arch == "xlnet":
        model = tf.XLNetModel(config)
    elif spec.arch == "gpt2":
        model = tf.GPT2LMHeadModel(config)
    else:
        raise KeyError(spec.arch)
    # HF initialises biases to 0 and LayerNorm scales to 1; perturb every parameter (tied ones once) so
    # the graph has the distinct, non-trivial initializers of a trained checkpoint.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)

    arch = spec.arch

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.model = inner

        def run(self, **kw: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if arch == "bert_mlm":
                out = self.model(**kw)
                return out.loss, out.logits
            if arch == "xlnet":
                # XLNet computes 1.0 - attention_mask, which the dynamo exporter cannot decompose for
                # an int64 mask; the Cast keeps the graph input int64 like every other model.
                kw["attention_mask"] = kw["attention_mask"].to(torch.float32)
                return (self.model(**kw, use_mems=False).last_hidden_state,)
            if arch == "gpt2":
                return (self.model(**kw, use_cache=False).logits,)
            if arch == "roberta_cls":
                return (self.model(**kw).logits,)
            return (self.model(**kw).last_hidden_state,)

    # torch.export reads the graph inputs off forward's signature, so each signature is spelled out.
    class TwoInputs(Wrapper):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask)

    class WithTokenTypes(Wrapper):
        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)

    class WithLabels(Wrapper):
        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    wrappers = {
        ("input_ids", "attention_mask"): TwoInputs,
        ("input_ids", "attention_mask", "token_type_ids"): WithTokenTypes,
        ("input_ids", "attention_mask", "labels"): WithLabels,
    }
    return wrappers[spec.inputs](model.eval()).eval()


def _clean(model: onnx.ModelProto, graph_name: str, meta: dict[str, str]) -> onnx.ModelProto:
    """Drop the exporter's per-node metadata (stack traces with local paths, FX node dumps), strip the
    wrapper's ``model.`` prefix from initializer names, name the graph, and record provenance."""

    def strip(obj: Any) -> None:
        if hasattr(obj, "metadata_props"):
            del obj.metadata_props[:]
        if hasattr(obj, "doc_string"):
            obj.doc_string = ""

    g = model.graph
    for coll in (g.node, g.input, g.output, g.value_info, g.initializer):
        for item in coll:
            strip(item)
    strip(g)
    strip(model)
    rename = {i.name: i.name[len("model.") :] for i in g.initializer if i.name.startswith("model.")}
    taken = {i.name for i in g.initializer} | {v for n in g.node for v in n.output}
    clash = set(rename.values()) & (taken - set(rename))
    if clash:
        raise RuntimeError(f"renaming initializers would clash: {sorted(clash)[:5]}")
    for init in g.initializer:
        init.name = rename.get(init.name, init.name)
    for vi in g.value_info:
        vi.name = rename.get(vi.name, vi.name)
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    g.name = graph_name
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    return model


def _check_graph(model: onnx.ModelProto, spec: Spec) -> None:
    onnx.checker.check_model(model, full_check=True)
    opsets = {o.domain: o.version for o in model.opset_import}
    if opsets.get("", 0) < 17:
        raise AssertionError(f"opset {opsets} < 17")
    foreign = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign or len(model.functions):
        raise AssertionError(f"not plain ONNX: domains {foreign}, {len(model.functions)} functions")
    names_in = tuple(i.name for i in model.graph.input)
    names_out = tuple(o.name for o in model.graph.output)
    if names_in != spec.inputs or names_out != spec.outputs:
        raise AssertionError(f"signature {names_in} -> {names_out}, expected {spec.inputs} -> {spec.outputs}")
    for value in model.graph.input:
        dims = [d.dim_param for d in value.type.tensor_type.shape.dim]
        if dims != ["batch", "sequence"] or value.type.tensor_type.elem_type != onnx.TensorProto.INT64:
            raise AssertionError(f"input {value.name} is not int64[batch, sequence]: {value.type}")
    for value in model.graph.output:
        dims = [d.dim_param for d in value.type.tensor_type.shape.dim]
        if value.name != "loss" and dims[:1] != ["batch"]:
            raise AssertionError(f"output {value.name} has no batch axis: {value.type}")


def _verify(module: Any, path: Path, spec: Spec, size: str, shapes: list[tuple[int, int, float]]) -> float:
    """Run the saved model in ONNX Runtime against the torch module; return the worst abs difference."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed, (batch, seq, pad) in enumerate(shapes, start=1):
        feeds = make_inputs(spec.name, batch, seq, pad_fraction=pad, valid_label_fraction=0.15, seed=seed, size=size)
        with torch.no_grad():
            ref = module(*(torch.from_numpy(feeds[k]) for k in spec.inputs))
        got = session.run(list(spec.outputs), feeds)
        for out_name, r_t, o in zip(spec.outputs, ref, got, strict=True):
            r = r_t.numpy()
            if r.shape != o.shape:
                raise AssertionError(f"{spec.name}.{out_name} at {batch}x{seq}: shape {o.shape} != torch {r.shape}")
            np.testing.assert_allclose(o, r, atol=ATOL, rtol=RTOL, err_msg=f"{spec.name}.{out_name} {batch}x{seq}")
            worst = max(worst, float(np.max(np.abs(o - r))))
    return worst


def spec_key(name: str, size: str) -> dict[str, Any]:
    """What a built file depends on; bench/models.py compares it with the sidecar to reuse a cached build."""
    import importlib.metadata as md

    spec = SPECS[name]
    versions = {}
    for dist in ("torch", "transformers", "onnx", "onnxscript"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "name": name,
        "size": size,
        "builder_version": BUILDER_VERSION,
        "opset": OPSET,
        "dims": asdict(spec.dims[size]),
        "versions": versions,
    }


def build(name: str, size: str = "tiny", out_dir: Path | None = None, verbose: bool = True) -> Path:
    """Build, check and save one model; writes ``<file>.onnx`` and a ``<file>.json`` sidecar for bench
    sizes. Returns the .onnx path."""
    import torch

    spec = SPECS[name]
    if size not in spec.dims:
        raise ValueError(f"{name} has no {size} size (it is built at: {', '.join(sorted(spec.dims))})")
    out_dir = Path(out_dir) if out_dir is not None else default_out(size)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename(name, size)
    key = spec_key(name, size)
    t0 = time.perf_counter()
    module = _module(spec, size)
    example = make_inputs(name, 2, 8, pad_fraction=0.125, valid_label_fraction=0.5, seed=0, size=size)
    args = tuple(torch.from_numpy(example[k]) for k in spec.inputs)
    dyn = tuple({0: "batch", 1: "sequence"} for _ in spec.inputs)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_shapes=dyn,
            opset_version=OPSET,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    t_export = time.perf_counter() - t0
    meta = {
        "onnxforge.builder": f"tests.models.build_hf --size {size} --only {name}",
        "onnxforge.versions": json.dumps(key["versions"], sort_keys=True),
    }
    model = _clean(program.model_proto, f"hf_{name}", meta)
    _check_graph(model, spec)
    tmp = path.with_suffix(".onnx.tmp")
    data_bytes = sum(len(i.raw_data) for i in model.graph.initializer)
    if data_bytes > 1_800_000_000:  # the 2 GB protobuf limit: weights go to a side file
        onnx.save(model, tmp, save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(model, tmp)
    tmp.replace(path)
    path.with_suffix(".json").unlink(missing_ok=True)
    shapes = [(3, 5, 0.2), (1, 17, 0.0), (4, 24, 0.3)] if size == "tiny" else [(2, 64, 0.25)]
    try:
        worst = _verify(module, path, spec, size, shapes)
    except BaseException:
        path.unlink(missing_ok=True)  # never leave an unverified model behind
        raise
    elapsed = time.perf_counter() - t0
    info = {
        **key,
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "nodes": len(model.graph.node),
        "export_s": round(t_export, 1),
        "total_s": round(elapsed, 1),
        "max_abs_diff_vs_torch": worst,
    }
    if size != "tiny":
        path.with_suffix(".json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if verbose:
        print(
            f"wrote {path} ({info['bytes'] / 1e6:.2f} MB, {info['nodes']} nodes, export {t_export:.1f}s, "
            f"total {elapsed:.1f}s, max |ort - torch| {worst:.2e})",
            flush=True,
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.build_hf", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", type=Path, default=None, help="default: tests/models (tiny), bench/out/models")
    parser.add_argument("--only", action="append", choices=sorted(SPECS), help="repeatable; default: all")
    args = parser.parse_args(argv)
    names = args.only or [n for n, s in SPECS.items() if args.size in s.dims]
    for name in names:
        build(name, args.size, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
