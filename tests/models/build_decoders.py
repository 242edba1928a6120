"""Build tiny decoder-only language models as ONNX, with and without a KV cache, by both torch exporters.

Run ``python -m tests.models.build_decoders [--only FAMILY] [--skip-trained] [--out DIR]``; the files go to
``tests/models/decoders/`` (committed) with ``manifest.json``, which records every export that worked and,
for every one that did not, the exporter's error. ``--qwen05 DIR`` instead builds a decoder shaped like
Qwen2.5-0.5B (random weights, about 2 GB: bench only, never committed).

Families (issue 19 item 6), each from a ``transformers`` config object (nothing is downloaded), seeded, every
parameter perturbed by ``0.02 * randn`` (HF initialises norms to 1 and biases to 0, which no checkpoint has):

========  =========================================================================
llama     GQA (4 heads / 2 KV heads), RMSNorm, rotary, SwiGLU
qwen2     as llama, with q/k/v biases
phi3      fused ``qkv_proj`` and ``gate_up_proj`` (GQA 4/2)
mistral   as llama, with a sliding window (longer than any test sequence)
gpt2      MHA, learned positions, LayerNorm, GELU, Conv1D projections
========  =========================================================================

Each family is exported four ways: ``<family>_{past,nopast}_{ts,dynamo}.onnx`` (TorchScript exporter,
``dynamo=False``, and the dynamo exporter). Graph signature, Optimum's ``text-generation-with-past``:
inputs ``input_ids[batch, sequence]``, ``attention_mask[batch, total_sequence]``,
``position_ids[batch, sequence]``, ``past_key_values.N.key/.value[batch, kv_heads, past_sequence,
head_dim]``; outputs ``logits[batch, sequence, vocab]``, ``present.N.key/.value``. The ``nopast`` files have
the first three inputs and ``logits`` only. transformers 5 takes a ``Cache`` object, so a small module wraps
the model: flat past tensors in, a ``DynamicCache`` built from them, flat presents out.

Every export is checked against torch in ONNX Runtime (atol 1e-4) at shapes other than the export's
(exported at batch 2, sequence 3, past 4): a prefill (batch 2, prompt 5, past 0) and a decode step (batch 2,
1 token, past 7); without a cache at (2, 5) and (1, 11). A failed check deletes the file and raises.

``<family>_merged_{ts,dynamo}.onnx`` (``--merged``; Llama and GPT-2): Optimum's ``decoder_model_merged.onnx``
of an older ``text-generation-with-past`` export. The same seeded model is exported as Optimum's
``decoder_model.onnx`` (``prefill``: the first three inputs, ``logits`` and the presents out; TorchScript
leaves its presents' head dim symbolic) and the ``past`` file, merged by ``tests.models.merge`` (one ``If`` on
``use_cache_branch``, the weights once in the outer graph) and each branch checked against its torch module:
the no-cache branch fed a dummy past of ``NO_CACHE_PAST`` as Optimum's runtime does. Their manifest entries
are under ``merged``.

``trained_llama_past_ts.onnx`` is a small Llama (hidden 64, 2 layers, 4/2 heads, byte-level vocabulary of
256) trained for 300 steps (batch 16 x 128 bytes) on Python's own documentation (``pydoc_data.topics``, shipped with
every CPython), with ``trained_llama_heldout.npy``: byte sequences of the held-out topics (never trained on),
for next-token accuracy checks of quantized models. Training is seeded, single-process, 2 threads.

torch and transformers (the ``dev`` extra) are imported only inside the build functions: ``decoder_feeds``
needs only numpy and onnx, so tests and bench scripts import this module without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.models.merge import NO_CACHE_PAST, USE_CACHE, merge_decoders

HERE = Path(__file__).resolve().parent
OUT = HERE / "decoders"
OPSET = 18
ATOL = 1e-4
EXPORTERS = ("ts", "dynamo")
CACHES = ("past", "nopast")
EXPORT_SHAPE = (2, 3, 4)  # batch, sequence, past: every check runs at other shapes
PAST_CHECKS = ((2, 5, 0), (2, 1, 7))  # prefill on an empty cache, then one decode step on a past of 7
NOPAST_CHECKS = ((2, 5, 0), (1, 11, 0))
TRAINED = "trained_llama"
HELDOUT = OUT / f"{TRAINED}_heldout.npy"


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class
    model: str  # transformers causal-LM class
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 64
    vocab: int = 256
    max_positions: int = 128
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", "LlamaForCausalLM"),
        Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
        Family("phi3", "Phi3Config", "Phi3ForCausalLM", extra=(("pad_token_id", 0), ("eos_token_id", 1))),
        Family("mistral", "MistralConfig", "MistralForCausalLM", extra=(("sliding_window", 64),)),
        Family("gpt2", "GPT2Config", "GPT2LMHeadModel", kv_heads=4),
    )
}
TRAINED_FAMILY = Family(TRAINED, "LlamaConfig", "LlamaForCausalLM", hidden=64, intermediate=128)
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B): 494M parameters, tied embeddings.
QWEN05 = Family(
    "qwen05",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    layers=24,
    hidden=896,
    heads=14,
    kv_heads=2,
    intermediate=4864,
    vocab=151936,
    max_positions=32768,
    extra=(("tie_word_embeddings", True), ("rms_norm_eps", 1e-6)),
)


def filename(family: str, cache: str, exporter: str) -> str:
    return f"{family}_{cache}_{exporter}.onnx"


def input_names(layers: int, cache: str) -> list[str]:
    """``cache``: "past" (with past inputs), "nopast" or "prefill" (Optimum's decoder_model.onnx: no past in,
    presents out)."""
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *(past if cache == "past" else [])]


def output_names(layers: int, cache: str) -> list[str]:
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["logits", *(present if cache in ("past", "prefill") else [])]


# ----------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Signature:
    """What feeding a decoder takes, read off its graph inputs (so it works on any exported decoder)."""

    inputs: tuple[str, ...]
    layers: int  # 0: no cache inputs
    kv_heads: int
    head_dim: int
    vocab: int | None

    @classmethod
    def of(cls, model: onnx.ModelProto | str | Path) -> Signature:
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
        names = tuple(i.name for i in proto.graph.input)
        past = [i for i in proto.graph.input if i.name.startswith("past_key_values.")]
        kv_heads = head_dim = 0
        if past:
            dims = past[0].type.tensor_type.shape.dim
            kv_heads, head_dim = dims[1].dim_value, dims[3].dim_value
        logits = [o for o in proto.graph.output if o.name == "logits"]
        vocab = logits[0].type.tensor_type.shape.dim[-1].dim_value if logits else None
        return cls(names, len(past) // 2, kv_heads, head_dim, vocab or None)


def decoder_feeds(
    signature: Signature,
    batch: int,
    seq: int,
    past: int,
    *,
    seed: int = 0,
    tokens: np.ndarray | None = None,
    past_values: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Feeds for one call of a decoder: ``seq`` new tokens after a cache of ``past`` positions (all valid).

    ``tokens`` ([batch, seq]) replaces the random ids; ``past_values`` (a previous call's presents, renamed
    to the past inputs) replaces the random cache, whose values are of the scale a real cache has."""
    rng = np.random.default_rng(seed)
    vocab = signature.vocab or 256
    ids = tokens if tokens is not None else rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq)).copy(),
    }
    for i in range(signature.layers):
        for kind in ("key", "value"):
            name = f"past_key_values.{i}.{kind}"
            if past_values is not None:
                feeds[name] = past_values[name]
            else:
                shape = (batch, signature.kv_heads, past, signature.head_dim)
                feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return {k: feeds[k] for k in signature.inputs}


def presents_as_past(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A call's ``present.N.*`` outputs as the next call's ``past_key_values.N.*`` inputs."""
    return {k.replace("present.", "past_key_values.", 1): v for k, v in outputs.items() if k.startswith("present.")}


# ----------------------------------------------------------------------------------------------- torch


def _config(family: Family) -> Any:
    import transformers as tf

    cls = getattr(tf, family.config)
    if family.config == "GPT2Config":
        return cls(
            vocab_size=family.vocab,
            n_embd=family.hidden,
            n_layer=family.layers,
            n_head=family.heads,
            n_inner=family.intermediate,
            n_positions=family.max_positions,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=True,
            attn_implementation="eager",
        )
    kw = {
        "vocab_size": family.vocab,
        "hidden_size": family.hidden,
        "num_hidden_layers": family.layers,
        "num_attention_heads": family.heads,
        "num_key_value_heads": family.kv_heads,
        "intermediate_size": family.intermediate,
        "max_position_embeddings": family.max_positions,
        "use_cache": True,
        "attn_implementation": "eager",
    }
    kw.update(dict(family.extra))
    return cls(**kw)


def causal_lm(family: Family, *, perturb: bool = True) -> Any:
    """The seeded transformers model in eval mode, every parameter perturbed (tied ones once)."""
    import torch
    import transformers as tf

    config = _config(family)
    torch.manual_seed(0)
    model = getattr(tf, family.model)(config)
    if perturb:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def wrap(model: Any, cache: str) -> Any:
    """``forward(input_ids, attention_mask, position_ids, *past) -> (logits, *presents)`` over ``model``."""
    import torch
    from transformers.cache_utils import DynamicCache

    layers = model.config.num_hidden_layers
    config = model.config

    class WithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache_obj = DynamicCache(
                ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)], config=config
            )
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache_obj,
                use_cache=True,
            )
            presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=DynamicCache(config=config),
                use_cache=True,
            )
            presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    class NoPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
            return (out.logits,)

    return {"past": WithPast, "prefill": Prefill, "nopast": NoPast}[cache]().eval()


def _torch_args(family: Family, cache: str, batch: int, seq: int, past: int, seed: int) -> tuple[Any, ...]:
    import torch

    signature = Signature(
        tuple(input_names(family.layers, cache)), family.layers if cache == "past" else 0, family.kv_heads,
        family.head_dim, family.vocab,
    )  # fmt: skip
    feeds = decoder_feeds(signature, batch, seq, past if cache == "past" else 0, seed=seed)
    return tuple(torch.from_numpy(feeds[k]) for k in signature.inputs)


def export(module: Any, family: Family, cache: str, exporter: str, path: Path) -> onnx.ModelProto:
    """Export ``module`` with symbolic batch/sequence/past axes; return the cleaned, checked proto."""
    import torch

    from tests.models.build_hf import _clean

    names_in, names_out = input_names(family.layers, cache), output_names(family.layers, cache)
    args = _torch_args(family, cache, *EXPORT_SHAPE, seed=0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"}}
            axes["attention_mask"] = {0: "batch", 1: "total_sequence" if cache == "past" else "sequence"}
            axes["logits"] = {0: "batch", 1: "sequence"}
            for name in names_in[3:]:
                axes[name] = {0: "batch", 2: "past_sequence"}
            for name in names_out[1:]:
                axes[name] = {0: "batch", 2: "total_sequence" if cache == "past" else "sequence"}
            torch.onnx.export(
                module,
                args,
                str(path),
                input_names=names_in,
                output_names=names_out,
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
            proto = onnx.load(str(path))
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            total, past = torch.export.Dim("total_sequence"), torch.export.Dim("past_sequence")
            shapes: tuple[Any, ...] = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq})
            if cache == "past":
                shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq})
                shapes = (*shapes, tuple({0: batch, 2: past} for _ in names_in[3:]))
            program = torch.onnx.export(
                module,
                args,
                input_names=names_in,
                output_names=names_out,
                dynamic_shapes=shapes,
                opset_version=OPSET,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            proto = program.model_proto
    meta = {
        "onnxforge.builder": f"tests.models.build_decoders --only {family.name}",
        "onnxforge.versions": json.dumps(versions(), sort_keys=True),
    }
    proto = _clean(proto, path.stem, meta)
    _check_graph(proto, names_in, names_out)
    return proto


def check_plain_onnx(model: onnx.ModelProto, names_in: Sequence[str], names_out: Sequence[str]) -> None:
    """An export as a user's would be: the checker passes, opset 17 or later, no contrib domain or function,
    and exactly the signature asked for (tests.models.build_seq2seq checks its files with it too)."""
    # Over protobuf's 2 GB (qwen05: its tied embedding is exported twice) the checker cannot serialize the
    # proto; verify() still runs that model in ORT against torch.
    if sum(len(t.raw_data) for t in model.graph.initializer) < 1_800_000_000:
        onnx.checker.check_model(model, full_check=True)
    opsets = {o.domain: o.version for o in model.opset_import}
    if opsets.get("", 0) < 17:
        raise AssertionError(f"opset {opsets} < 17")
    foreign = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign or len(model.functions):
        raise AssertionError(f"not plain ONNX: domains {foreign}, {len(model.functions)} functions")
    got_in, got_out = [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    if got_in != list(names_in) or got_out != list(names_out):
        raise AssertionError(f"signature {got_in} -> {got_out}, expected {list(names_in)} -> {list(names_out)}")


def compare_with_torch(names: Sequence[str], ref: Sequence[Any], got: Sequence[np.ndarray], where: str) -> float:
    """Each ORT output against torch's (same shape, within ATOL); the worst absolute difference."""
    worst = 0.0
    for name, r, o in zip(names, ref, got, strict=True):
        label = f"{name} at {where}"
        if tuple(r.shape) != o.shape:
            raise AssertionError(f"{label}: shape {o.shape} != torch {tuple(r.shape)}")
        np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=0, err_msg=label)
        worst = max(worst, float(np.max(np.abs(o - r.numpy()))) if o.size else 0.0)
    return worst


def _check_graph(model: onnx.ModelProto, names_in: Sequence[str], names_out: Sequence[str]) -> None:
    check_plain_onnx(model, names_in, names_out)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        symbolic = [i for i, d in enumerate(dims) if d.dim_param]
        want = [0, 2] if value.name.startswith(("past_key_values.", "present.")) else [0, 1]
        if value.name.startswith("present.") and symbolic == [0, 2, 3]:
            continue  # without a past input to read it from, TorchScript leaves the prefill's head dim symbolic
        if symbolic != want:
            raise AssertionError(f"{value.name}: symbolic axes {symbolic}, expected {want}: {dims}")


def verify(module: Any, family: Family, cache: str, path: Path, checks: Sequence[tuple[int, int, int]]) -> float:
    """ONNX Runtime against torch at ``checks`` (batch, sequence, past); the worst absolute difference."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names_in, names_out = input_names(family.layers, cache), output_names(family.layers, cache)
    worst = 0.0
    for seed, (batch, seq, past) in enumerate(checks, start=1):
        args = _torch_args(family, cache, batch, seq, past, seed)
        with torch.no_grad():
            ref = module(*args)
        got = session.run(names_out, {n: a.numpy() for n, a in zip(names_in, args, strict=True)})
        where = f"batch {batch}, sequence {seq}, past {past}"
        worst = max(worst, compare_with_torch([f"{path.name}.{n}" for n in names_out], ref, got, where))
    return worst


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def save(proto: onnx.ModelProto, path: Path) -> None:
    tmp = path.with_suffix(".onnx.tmp")
    if sum(len(i.raw_data) for i in proto.graph.initializer) > 1_800_000_000:  # protobuf's 2 GB limit
        onnx.save(proto, str(tmp), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(proto, str(tmp))
    tmp.replace(path)


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's type and first line: torch.onnx wraps the real reason in generic errors."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def build_one(
    module_of: Callable[[str], Any], family: Family, cache: str, exporter: str, out: Path, *, reuse: bool = False
) -> dict[str, Any]:
    """Export, check and verify one file; returns its manifest entry (``error`` set when it failed)."""
    path = out / filename(family.name, cache, exporter)
    entry: dict[str, Any] = {"file": path.name, "family": family.name, "cache": cache, "exporter": exporter}
    t0 = time.perf_counter()
    module = module_of(cache)
    if reuse and path.exists():  # --reuse: keep the earlier export, but verify it against torch again
        proto = onnx.load(str(path))
        worst = verify(module, family, cache, path, PAST_CHECKS if cache == "past" else NOPAST_CHECKS)
        return _entry(entry, path, proto, worst, t0)
    try:
        proto = export(module, family, cache, exporter, path)
    except Exception as exc:  # an exporter that cannot take the family is a finding, recorded in the manifest
        path.unlink(missing_ok=True)
        entry["error"] = _root_cause(exc)
        print(f"EXPORT FAILED {path.name}: {entry['error']}", flush=True)
        return entry
    save(proto, path)
    try:
        worst = verify(module, family, cache, path, PAST_CHECKS if cache == "past" else NOPAST_CHECKS)
    except BaseException:
        path.unlink(missing_ok=True)  # an export that computes something else is a bug: never keep it
        raise
    return _entry(entry, path, proto, worst, t0)


def _entry(entry: dict[str, Any], path: Path, proto: onnx.ModelProto, worst: float, t0: float) -> dict[str, Any]:
    entry.update(
        bytes=path.stat().st_size,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        nodes=len(proto.graph.node),
        max_abs_diff_vs_torch=float(f"{worst:.3g}"),
    )
    print(f"wrote {path.name}: {entry['bytes'] / 1e3:.0f} KB, {entry['nodes']} nodes, "
          f"max |ort - torch| {worst:.1e} ({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip
    return entry


# --------------------------------------------------------------------------------------------- trained


def corpus() -> tuple[np.ndarray, list[np.ndarray]]:
    """Training bytes and held-out sequences from Python's documentation (``pydoc_data.topics``): every
    tenth topic in sorted order is held out."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    train = [topics.topics[n] for i, n in enumerate(names) if i % 10 != 5]
    held = [topics.topics[n] for i, n in enumerate(names) if i % 10 == 5]
    as_bytes = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in train]
    return np.concatenate(as_bytes), [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in held]


def train(family: Family, *, steps: int, seq: int = 128, batch: int = 16, verbose: bool = True) -> Any:
    """Next-byte training of ``family`` on the corpus; fixed steps and seeds, so the weights reproduce."""
    import torch

    torch.set_num_threads(2)
    model = causal_lm(family, perturb=False).train()
    # SDPA trains 3-5x faster than eager attention on CPU and computes the same function; export uses eager.
    model.config._attn_implementation = "sdpa"
    data, _ = corpus()
    tokens = torch.from_numpy(data)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
        x = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1 : s + seq + 1] for s in starts.tolist()])
        logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, family.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if verbose and (step % 200 == 0 or step == steps - 1):
            print(f"step {step}: loss {loss.item():.3f} nats/byte ({time.perf_counter() - t0:.0f}s)", flush=True)
    model.config._attn_implementation = "eager"
    return model.eval()


def heldout_tokens(sequences: int = 8, length: int = 128) -> np.ndarray:
    """``sequences`` rows of ``length`` bytes, each from the start of a held-out topic."""
    _, held = corpus()
    rows = [h[:length] for h in held if len(h) >= length][:sequences]
    return np.stack(rows).astype(np.int64)


def build_trained(out: Path, steps: int) -> dict[str, Any]:
    import torch

    model = train(TRAINED_FAMILY, steps=steps)
    entry = build_one(lambda cache: wrap(model, cache), TRAINED_FAMILY, "past", "ts", out)
    held = heldout_tokens()
    np.save(out / HELDOUT.name, held)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(held), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 256), torch.from_numpy(held[:, 1:]).reshape(-1)
        )
    entry.update(train_steps=steps, heldout_shape=list(held.shape), heldout_loss_nats_per_byte=round(float(loss), 4))
    print(f"held-out loss {float(loss):.3f} nats/byte on {held.shape}", flush=True)
    return entry


# ----------------------------------------------------------------------------------------------- merged


def merged_filename(family: str, exporter: str) -> str:
    return f"{family}_merged_{exporter}.onnx"


def merged_decoder_feeds(
    model: onnx.ModelProto | str | Path, use_cache: bool, batch: int, seq: int, past: int = 0, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for one call of a merged decoder-only file, as Optimum's runtime makes them: the cache branch a
    cache of ``past`` positions (the mask ``past + seq`` long); the no-cache branch (the first step) a dummy
    cache ``NO_CACHE_PAST`` long that it never reads, and a mask as long as the prompt."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    signature = Signature.of(proto)
    names = [n for n in signature.inputs if n != USE_CACHE]
    cached = dataclasses.replace(signature, inputs=tuple(names))
    feeds = decoder_feeds(cached, batch, seq, past if use_cache else NO_CACHE_PAST, seed=seed)
    if not use_cache:
        first = decoder_feeds(dataclasses.replace(cached, inputs=tuple(names[:3]), layers=0), batch, seq, 0, seed=seed)
        feeds.update(first)  # ids, a mask and positions for the prompt alone
    feeds[USE_CACHE] = np.array([use_cache])
    return {n: feeds[n] for n in signature.inputs}


MERGED_FAMILIES = ("llama", "gpt2")
MERGED_CHECKS = ((False, 2, 5, 0), (False, 1, 11, 0), (True, 2, 1, 7), (True, 3, 2, 4))  # cache?, b, s, past


def build_merged(family: Family, exporter: str, out: Path) -> dict[str, Any]:
    """``<family>_merged_<exporter>.onnx``: Optimum's decoder_model.onnx (``prefill``: no past in, presents
    out) and decoder_with_past_model.onnx (``past``) exported from one model and merged as Optimum does
    (tests.models.merge); each branch checked against its torch module in ONNX Runtime (atol 1e-4)."""
    import tempfile

    import onnxruntime as ort
    import torch

    t0 = time.perf_counter()
    model = causal_lm(family)
    protos = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cache in ("prefill", "past"):
            path = Path(tmp) / filename(family.name, cache, exporter)
            protos[cache] = export(wrap(model, cache), family, cache, exporter, path)
    merged = merge_decoders(protos["prefill"], protos["past"])
    builder = f"tests.models.build_decoders --merged --only {family.name}"
    for prop in protos["prefill"].metadata_props:
        merged.metadata_props.add(key=prop.key, value=builder if prop.key == "onnxforge.builder" else prop.value)
    path = out / merged_filename(family.name, exporter)
    save(merged, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names_out = output_names(family.layers, "past")
    worst = 0.0
    try:
        for seed, (use_cache, batch, seq, past) in enumerate(MERGED_CHECKS, start=1):
            feeds = merged_decoder_feeds(merged, use_cache, batch, seq, past, seed=seed)
            cache = "past" if use_cache else "prefill"
            args = [torch.from_numpy(feeds[n]) for n in input_names(family.layers, cache)]
            with torch.no_grad():
                ref = wrap(model, cache)(*args)
            got = session.run(names_out, feeds)
            where = f"use_cache_branch={use_cache}, batch {batch}, sequence {seq}, past {past}"
            worst = max(worst, compare_with_torch([f"{path.name}.{n}" for n in names_out], ref, got, where))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    branches = {a.g.name: len(a.g.node) for a in merged.graph.node[0].attribute}
    entry = {"file": path.name, "family": family.name, "cache": "merged", "exporter": exporter}
    entry.update(branch_nodes=branches, outer_initializers=len(merged.graph.initializer))
    return _entry(entry, path, merged, worst, t0)


def sdpa_filename(family: str) -> str:
    return f"{family}_past_ts_sdpa.onnx"


def build_sdpa(family: Family, out: Path) -> dict[str, Any]:
    """``<family>_past_ts_sdpa.onnx``: the cache decoder as TorchScript exports it with
    ``attn_implementation="sdpa"`` (its attention decomposed, with a Reshape of ``MatMul(probs, v)`` to the
    query's shape that the eager export does not have), checked against torch like the corpus files."""
    import shutil
    import tempfile

    model = causal_lm(family)
    model.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as tmp:  # built under the eager file's name, which must stay as it is
        entry = build_one(lambda c: wrap(model, c), family, "past", "ts", Path(tmp))
        if "error" in entry:
            return {**entry, "file": sdpa_filename(family.name), "exporter": "ts_sdpa"}
        path = out / sdpa_filename(family.name)
        shutil.move(str(Path(tmp) / entry["file"]), path)
    return {**entry, "file": path.name, "exporter": "ts_sdpa"}


# ---------------------------------------------------------------------------------------------------- main


def build_corpus(families: Sequence[str], out: Path, *, reuse: bool = False) -> list[dict[str, Any]]:
    entries = []
    for name in families:
        family = FAMILIES[name]
        model = causal_lm(family)
        for cache in CACHES:
            for exporter in EXPORTERS:
                entries.append(build_one(lambda c, m=model: wrap(m, c), family, cache, exporter, out, reuse=reuse))
    return entries


def build_qwen05(out: Path) -> Path:
    """The Qwen2.5-0.5B-shaped decoder with a cache (TorchScript exporter), for bench/decoders.py only."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename(QWEN05.name, "past", "ts")
    if path.exists():
        return path
    model = causal_lm(QWEN05)
    module = wrap(model, "past")
    proto = export(module, QWEN05, "past", "ts", out / "qwen05.export.onnx")
    (out / "qwen05.export.onnx").unlink(missing_ok=True)
    save(proto, path)
    verify(module, QWEN05, "past", path, PAST_CHECKS[1:])
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.build_decoders", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", action="append", choices=sorted(FAMILIES), help="repeatable; default: all")
    parser.add_argument("--skip-trained", action="store_true", help="do not train and export the trained Llama")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--reuse", action="store_true", help="keep existing corpus files (verified again)")
    parser.add_argument("--merged", action="store_true", help="only build the merged files (--only: families)")
    parser.add_argument("--sdpa", action="store_true", help="only build the TorchScript SDPA cache files")
    parser.add_argument("--qwen05", type=Path, default=None, help="build only the Qwen2.5-0.5B-shaped decoder here")
    args = parser.parse_args(argv)
    if args.qwen05 is not None:
        print(build_qwen05(args.qwen05))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": []}
    if args.merged:
        built = [build_merged(FAMILIES[n], x, args.out) for n in args.only or MERGED_FAMILIES for x in EXPORTERS]
        done = {e["file"] for e in built}
        # Kept apart from ``files`` (the corpus exports): what the corpus tests read stays as it was.
        manifest["merged"] = sorted([*(e for e in manifest.get("merged", []) if e["file"] not in done), *built],
                                    key=lambda e: e["file"])  # fmt: skip
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        print(f"{len(built)} merged files verified -> {args.out}")
        return 0
    if args.sdpa:
        built = [build_sdpa(FAMILIES[n], args.out) for n in args.only or FAMILIES]
        done = {e["file"] for e in built}
        manifest["sdpa"] = sorted([*(e for e in manifest.get("sdpa", []) if e["file"] not in done), *built],
                                  key=lambda e: e["file"])  # fmt: skip
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        print(f"{len(built)} TorchScript SDPA files verified -> {args.out}")
        return 0
    entries = build_corpus(args.only or list(FAMILIES), args.out, reuse=args.reuse)
    if not args.skip_trained:
        entries.append(build_trained(args.out, args.train_steps))
    rebuilt = {e["file"] for e in entries}
    kept = [e for e in manifest["files"] if e["file"] not in rebuilt]
    manifest = {
        "versions": versions(),
        "families": {n: asdict(f) for n, f in [*FAMILIES.items(), (TRAINED, TRAINED_FAMILY)]},
        "files": sorted([*kept, *entries], key=lambda e: e["file"]),
        "merged": manifest.get("merged", []),
        "sdpa": manifest.get("sdpa", []),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    failed = [e for e in entries if "error" in e]
    print(f"{len(entries) - len(failed)} exports verified, {len(failed)} failed (reasons in {manifest_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
