"""Build tiny encoder-decoders (Whisper, T5, BART) as the three files Optimum's seq2seq "-with-past" export makes.

Run ``python -m tests.models.build_seq2seq [--only ARCH] [--exporter ts|dynamo]``; the files go to
``tests/models/seq2seq/<arch>/`` (TorchScript) and ``<arch>/dynamo/`` (committed) with ``manifest.json``;
``--size bench`` builds whisper-base, t5-small and bart-base shapes into ``bench/out/seq2seq`` (never
committed). What users upload for generation (Optimum's ``text2text-generation-with-past`` /
``automatic-speech-recognition-with-past``, consumed by transformers.js and onnxruntime-genai), with Optimum's
input, output and dim names:

``encoder_model.onnx``
    ``input_ids`` + ``attention_mask`` [batch_size, encoder_sequence_length] (Whisper: ``input_features``
    [batch_size, mel bins, encoder_sequence_length], a fixed 2 x max_source_positions frames) ->
    ``last_hidden_state`` [batch_size, encoder_sequence_length (Whisper: / 2), hidden].
``decoder_model.onnx`` (no past: the first generation step)
    ``input_ids`` [batch_size, decoder_sequence_length], ``encoder_hidden_states`` [batch_size,
    encoder_sequence_length, hidden], ``encoder_attention_mask`` [batch_size, encoder_sequence_length]
    (not Whisper) -> ``logits``, ``present.N.decoder.key/value`` [batch_size, heads,
    decoder_sequence_length, head_dim] and ``present.N.encoder.key/value`` [batch_size, heads,
    encoder_sequence_length_out, head_dim].
``decoder_with_past_model.onnx`` (every later step)
    ``input_ids``, ``encoder_attention_mask`` (not Whisper), ``past_key_values.N.decoder.key/value``
    (self-attention cache: past_decoder_sequence_length, grows) and ``past_key_values.N.encoder.key/value``
    (cross-attention cache: encoder_sequence_length_out, the encoder's length, fixed) -> ``logits`` and
    ``present.N.decoder.key/value`` only. As in Optimum, it takes no ``encoder_hidden_states``: the
    cross-attention keys and values come from the cache.

Each model is built from a ``transformers`` config object (nothing downloaded): 2 encoder and 2 decoder layers,
d_model 32, 4 heads, vocabulary 256, seeded, every parameter perturbed by ``0.02 * randn`` (HF initialises
norms to 1 and biases to 0). transformers 5 takes ``EncoderDecoderCache`` objects, so small modules wrap the
model: flat cache tensors in, an ``EncoderDecoderCache`` of two ``DynamicCache`` built from them, flat
presents out. Exported by both torch exporters (``dynamo=False`` and ``dynamo=True``, opset 18, eager
attention), with the same input and output names and dims.

Checks (a failure deletes the file and raises): every file in ONNX Runtime against its torch module at shapes
other than the export's (atol 1e-4), including a decode step on an empty self-attention cache; and a greedy
generation chained through the three ONNX files (encoder, decoder for the start token, then
decoder_with_past on the returned presents for 5 more tokens) gives, at every step, the logits of the torch
model run on the whole generated sequence without a cache.

``decoder_model_merged.onnx`` (the fourth file Optimum writes, the one transformers.js and onnxruntime-genai
    load) is merged from the two decoder files as Optimum's ``merge_decoders`` does (optimum is not installable
    here; ``tests.models.merge`` re-implements optimum/onnx/graph_transformations.py): every input of both
    files plus ``use_cache_branch`` (bool [1]); one ``If`` on it whose then-branch is decoder_with_past and
    else-branch the decoder; the weights (rank > 1, or rank 1 and not int32/int64) deduplicated across the
    two into the outer graph as ``<name>_merged_<n>``, read by both branches from the outer scope, scalars and
    1-D ints kept in each branch; the with-past branch's missing ``present.N.encoder.*`` are empty
    constants (``[0, heads, 1, head_dim]``: the callers keep the first step's cross cache); the outputs
    declared with the decoder's shapes. The no-cache branch is fed a dummy past of length 1 (Optimum's ORT
    runtime; transformers.js feeds 0), which it never reads. Checked in the build: each branch gives the
    outputs of its separate file (``verify_merged``). ``--merge-only`` merges the committed files without
    torch.

torch and transformers are imported only inside the build functions: ``seq2seq_feeds``, ``merged_feeds``,
``merge_decoders`` and ``greedy_chain`` need only numpy, onnx and onnxruntime, so tests import this module
without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.models.merge import NO_CACHE_PAST, USE_CACHE, merge_decoders

HERE = Path(__file__).resolve().parent
OUT = HERE / "seq2seq"
OPSET = 18
ATOL = 1e-4
KINDS = ("encoder", "decoder", "decoder_with_past")
MERGED = "decoder_model_merged.onnx"
EXPORTERS = ("ts", "dynamo")
EXPORT = {"batch": 2, "dec": 3, "past": 4, "enc": 5}
GREEDY_STEPS = 6


@dataclass(frozen=True)
class Arch:
    name: str
    config: str
    model: str
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    vocab: int = 256
    mel_bins: int = 16  # Whisper only
    frames: int = 64  # Whisper only: 2 x max_source_positions
    positions: int = 64  # decoder position table (Whisper, BART); T5 is relative
    start: int = 0  # decoder_start_token_id

    @property
    def audio(self) -> bool:
        return self.name == "whisper"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("whisper", "WhisperConfig", "WhisperForConditionalGeneration", start=1),
        Arch("t5", "T5Config", "T5ForConditionalGeneration", start=0),
        Arch("bart", "BartConfig", "BartForConditionalGeneration", start=2),
    )
}


# Bench sizes (``--size bench``, never committed): whisper-base, t5-small and bart-base shapes, random weights.
BENCH: dict[str, Arch] = {
    "whisper": dataclasses.replace(
        ARCHS["whisper"], layers=6, hidden=512, heads=8, ffn=2048, vocab=51865, mel_bins=80, frames=3000,
        positions=448,
    ),
    "t5": dataclasses.replace(ARCHS["t5"], layers=6, hidden=512, heads=8, ffn=2048, vocab=32128),
    "bart": dataclasses.replace(
        ARCHS["bart"], layers=6, hidden=768, heads=12, ffn=3072, vocab=50265, positions=1024
    ),
}  # fmt: skip
BENCH_OUT = HERE.parents[1] / "bench" / "out" / "seq2seq"


def filename(kind: str) -> str:
    return f"{kind}_model.onnx"


def folder(arch: str, exporter: str = "ts") -> str:
    """Where one export's three files live, relative to ``OUT``: ``<arch>`` (TorchScript), ``<arch>/dynamo``."""
    return arch if exporter == "ts" else f"{arch}/{exporter}"


def enc_dim(arch: Arch) -> str:
    """The encoder states' length dim as Optimum names it (Whisper's stride-2 stack halves the frames)."""
    return "encoder_sequence_length / 2" if arch.audio else "encoder_sequence_length"


def input_names(arch: Arch, kind: str) -> list[str]:
    if kind == "encoder":
        return ["input_features"] if arch.audio else ["input_ids", "attention_mask"]
    mask = [] if arch.audio else ["encoder_attention_mask"]
    if kind == "decoder":
        return ["input_ids", "encoder_hidden_states", *mask]
    past = [f"past_key_values.{i}.{side}.{kv}" for i in range(arch.layers) for side in ("decoder", "encoder")
            for kv in ("key", "value")]  # fmt: skip
    return ["input_ids", *mask, *past]


def output_names(arch: Arch, kind: str) -> list[str]:
    if kind == "encoder":
        return ["last_hidden_state"]
    sides = ("decoder", "encoder") if kind == "decoder" else ("decoder",)
    present = [f"present.{i}.{side}.{kv}" for i in range(arch.layers) for side in sides for kv in ("key", "value")]
    return ["logits", *present]


def dynamic_axes(arch: Arch, kind: str) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name in input_names(arch, kind) + output_names(arch, kind):
        if name == "input_features":
            axes[name] = {0: "batch_size", 2: "encoder_sequence_length"}
        elif (name in ("input_ids", "attention_mask") and kind == "encoder") or name == "encoder_attention_mask":
            axes[name] = {0: "batch_size", 1: "encoder_sequence_length"}
        elif name in ("last_hidden_state", "encoder_hidden_states"):
            axes[name] = {0: "batch_size", 1: enc_dim(arch)}
        elif name in ("input_ids", "logits"):
            axes[name] = {0: "batch_size", 1: "decoder_sequence_length"}
        elif ".encoder." in name:
            axes[name] = {0: "batch_size", 2: "encoder_sequence_length_out"}
        elif name.startswith("past_key_values."):
            axes[name] = {0: "batch_size", 2: "past_decoder_sequence_length"}
        elif kind == "decoder":
            axes[name] = {0: "batch_size", 2: "decoder_sequence_length"}
        else:
            axes[name] = {0: "batch_size", 2: "past_decoder_sequence_length + decoder_sequence_length"}
    return axes


# ----------------------------------------------------------------------------------------------- inputs


def seq2seq_feeds(
    arch: Arch,
    kind: str,
    batch: int,
    *,
    dec: int = 1,
    past: int = 0,
    enc: int = 7,
    seed: int = 0,
    tokens: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Feeds for one call of ``kind``: ``dec`` new decoder tokens after a self-attention cache of ``past``,
    encoder states and cross-attention cache of ``enc`` positions (Whisper's encoder: its fixed frames);
    the encoder mask pads row 1 by a third. Cache values are N(0, 1)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    if kind == "encoder" and arch.audio:
        feeds["input_features"] = rng.standard_normal((batch, arch.mel_bins, arch.frames)).astype(np.float32)
        return feeds
    mask = np.ones((batch, enc), dtype=np.int64)
    if batch > 1:
        mask[1, enc - enc // 3 :] = 0
    if kind == "encoder":
        return {"input_ids": rng.integers(3, arch.vocab, size=(batch, enc), dtype=np.int64), "attention_mask": mask}
    ids = tokens if tokens is not None else rng.integers(3, arch.vocab, size=(batch, dec), dtype=np.int64)
    feeds["input_ids"] = np.asarray(ids, dtype=np.int64)
    if kind == "decoder":
        feeds["encoder_hidden_states"] = rng.standard_normal((batch, enc, arch.hidden)).astype(np.float32)
    if not arch.audio:
        feeds["encoder_attention_mask"] = mask
    for name in input_names(arch, kind):
        if name.startswith("past_key_values."):
            length = enc if ".encoder." in name else past
            feeds[name] = rng.standard_normal((batch, arch.heads, length, arch.head_dim)).astype(np.float32)
    return {k: feeds[k] for k in input_names(arch, kind)}


def greedy_chain(
    arch: Arch, sessions: dict[str, Any], encoder_feeds: dict[str, np.ndarray], steps: int = GREEDY_STEPS
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy generation through the three ONNX sessions: the tokens (start token first) and each step's
    last-position logits [batch, steps, vocab]. The decoder_with_past calls feed the previous call's
    ``present.N.decoder.*`` and the first call's ``present.N.encoder.*`` back as the cache."""

    def run(kind: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = sessions[kind]
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, feeds), strict=True))

    states = run("encoder", encoder_feeds)["last_hidden_state"]
    batch = states.shape[0]
    tokens = np.full((batch, 1), arch.start, dtype=np.int64)
    feeds = {"input_ids": tokens, "encoder_hidden_states": states}
    if not arch.audio:
        feeds["encoder_attention_mask"] = encoder_feeds["attention_mask"]
    out = run("decoder", feeds)
    cross = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if ".encoder." in k}
    logits = [out["logits"][:, -1]]
    for _ in range(steps - 1):
        nxt = logits[-1].argmax(-1)[:, None].astype(np.int64)
        tokens = np.concatenate([tokens, nxt], axis=1)
        feeds = {"input_ids": nxt, **cross}
        feeds.update({k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if ".decoder." in k})
        if not arch.audio:
            feeds["encoder_attention_mask"] = encoder_feeds["attention_mask"]
        out = run("decoder_with_past", feeds)
        logits.append(out["logits"][:, -1])
    return tokens, np.stack(logits, axis=1)


def merged_input_names(arch: Arch) -> list[str]:
    """The merged file's inputs: the decoder's, then the ones only decoder_with_past has, then the flag."""
    first = input_names(arch, "decoder")
    return [*first, *(n for n in input_names(arch, "decoder_with_past") if n not in first), USE_CACHE]


def merged_feeds(
    arch: Arch, use_cache: bool, batch: int, *, dec: int = 1, past: int = 0, enc: int = 7, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for one call of the merged file, as Optimum's runtime makes them: the cache branch gets the real
    caches (``past`` long, the cross cache ``enc`` long) beside the encoder states it ignores; the no-cache
    branch gets dummy caches ``NO_CACHE_PAST`` long that it ignores."""
    feeds = seq2seq_feeds(arch, "decoder", batch, dec=dec, enc=enc, seed=seed)
    dummy = NO_CACHE_PAST
    with_past = seq2seq_feeds(arch, "decoder_with_past", batch, dec=dec, past=past if use_cache else dummy,
                              enc=enc if use_cache else dummy, seed=seed + 1)  # fmt: skip
    for name, value in with_past.items():
        feeds.setdefault(name, value)
    if use_cache:
        feeds["input_ids"] = with_past["input_ids"]
    feeds[USE_CACHE] = np.array([use_cache])
    return {k: feeds[k] for k in merged_input_names(arch)}


# (batch, decoder tokens, self past, encoder length) for the cache branch; the no-cache branch runs the
# decoder's CHECKS.
MERGED_CHECKS = ((3, 1, 6, 7), (1, 2, 9, 11), (2, 1, 0, 6))


def verify_merged(arch: Arch, where: Path) -> float:
    """Each branch of the merged file against its separate file in ONNX Runtime (exact up to ATOL): the
    no-cache branch against decoder_model.onnx, the cache branch against decoder_with_past_model.onnx, whose
    missing cross presents must come out empty."""
    import onnxruntime as ort

    def session(path: Path) -> Any:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    merged = session(where / MERGED)
    names = [o.name for o in merged.get_outputs()]
    worst = 0.0
    cases = [(False, c) for c in CHECKS["decoder"]] + [(True, c) for c in MERGED_CHECKS]
    for seed, (use_cache, (batch, dec, past, enc)) in enumerate(cases, start=1):
        kind = "decoder_with_past" if use_cache else "decoder"
        feeds = merged_feeds(arch, use_cache, batch, dec=dec, past=past, enc=enc, seed=seed)
        got = dict(zip(names, merged.run(names, feeds), strict=True))
        alone = session(where / filename(kind))
        want_names = [o.name for o in alone.get_outputs()]
        want = alone.run(want_names, {k: feeds[k] for k in input_names(arch, kind)})
        for name, value in zip(want_names, want, strict=True):
            np.testing.assert_allclose(got[name], value, atol=ATOL, rtol=0, err_msg=f"{arch.name} merged {name}")
            worst = max(worst, float(np.max(np.abs(got[name] - value))) if value.size else 0.0)
        for name in set(names) - set(want_names):
            if got[name].size:
                raise AssertionError(f"{arch.name} merged: {name} should be empty on the cache branch")
    return worst


def build_merged(arch: Arch, exporter: str, out: Path) -> dict[str, Any]:
    """decoder_model_merged.onnx beside one export's decoder files, verified (``verify_merged``)."""
    where = out / folder(arch.name, exporter)
    decoder = onnx.load(str(where / filename("decoder")))
    with_past = onnx.load(str(where / filename("decoder_with_past")))
    merged = merge_decoders(decoder, with_past)
    for prop in decoder.metadata_props:
        merged.metadata_props.add(key=prop.key, value=prop.value)
    path = where / MERGED
    onnx.save(merged, str(path))
    try:
        worst = verify_merged(arch, where)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    rel = f"{folder(arch.name, exporter)}/{MERGED}"
    branches = {g.name: len(g.node) for a in merged.graph.node[0].attribute for g in [a.g]}
    print(f"wrote {rel}: {path.stat().st_size / 1e3:.0f} KB, branches {branches}, "
          f"max |merged - separate| {worst:.1e}", flush=True)  # fmt: skip
    return {
        "file": rel,
        "arch": arch.name,
        "exporter": exporter,
        "kind": "decoder_merged",
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "branch_nodes": branches,
        "outer_initializers": len(merged.graph.initializer),
        "max_abs_diff_vs_separate": float(f"{worst:.3g}"),
    }


# ----------------------------------------------------------------------------------------------- torch


def _config(arch: Arch) -> Any:
    import transformers as tf

    common = {"vocab_size": arch.vocab, "d_model": arch.hidden, "attn_implementation": "eager", "use_cache": True}
    if arch.name == "t5":
        return tf.T5Config(
            **common, d_kv=arch.head_dim, d_ff=arch.ffn, num_layers=arch.layers, num_decoder_layers=arch.layers,
            num_heads=arch.heads, pad_token_id=0, eos_token_id=1, decoder_start_token_id=arch.start,
        )  # fmt: skip
    layers = {
        "encoder_layers": arch.layers, "decoder_layers": arch.layers, "encoder_attention_heads": arch.heads,
        "decoder_attention_heads": arch.heads, "encoder_ffn_dim": arch.ffn, "decoder_ffn_dim": arch.ffn,
    }  # fmt: skip
    if arch.audio:
        return tf.WhisperConfig(
            **common, **layers, num_mel_bins=arch.mel_bins, max_source_positions=arch.frames // 2,
            max_target_positions=arch.positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=arch.start,
        )  # fmt: skip
    return tf.BartConfig(
        **common, **layers, max_position_embeddings=arch.positions, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=arch.start,
    )  # fmt: skip


def seq2seq_model(arch: Arch) -> Any:
    """The seeded transformers model in eval mode, every parameter perturbed (tied ones once)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = getattr(tf, arch.model)(_config(arch))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def wrap(model: Any, arch: Arch, kind: str) -> Any:
    """``forward(*inputs in input_names order) -> outputs in output_names order`` over ``model``."""
    import torch
    from transformers.cache_utils import EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    layers = arch.layers

    def presents(cache: Any, cross: bool) -> list[Any]:
        out = []
        for i in range(layers):
            out += [cache.self_attention_cache.layers[i].keys, cache.self_attention_cache.layers[i].values]
            if cross:
                out += [cache.cross_attention_cache.layers[i].keys, cache.cross_attention_cache.layers[i].values]
        return out

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            encoder = self.model.get_encoder()
            if arch.audio:
                return (encoder(input_features=args[0]).last_hidden_state,)
            return (encoder(input_ids=args[0], attention_mask=args[1]).last_hidden_state,)

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, encoder_hidden_states, *mask):
            out = self.model(
                decoder_input_ids=input_ids,
                encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
                attention_mask=mask[0] if mask else None,
                use_cache=True,
            )
            return (out.logits, *presents(out.past_key_values, cross=True))

    class DecoderWithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, *rest):
            mask, past = (None, rest) if arch.audio else (rest[0], rest[1:])
            cache = EncoderDecoderCache([tuple(past[4 * i : 4 * i + 4]) for i in range(layers)])
            # DynamicCache concatenates its data onto an empty tensor: hold the inputs themselves instead, so
            # the graph reads the cache as Optimum's exports do (no Concat with an empty constant).
            for i in range(layers):
                own, cross = cache.self_attention_cache.layers[i], cache.cross_attention_cache.layers[i]
                own.keys, own.values, cross.keys, cross.values = past[4 * i : 4 * i + 4]
            # The cross-attention layers read their keys and values from the cache; the states only need to
            # exist (the model skips cross-attention without them), so a zero tensor of the cache's length
            # stands in and the exporter drops it as dead code.
            cross_key = past[2]
            states = cross_key.new_zeros((cross_key.shape[0], cross_key.shape[2], arch.hidden))
            out = self.model(
                decoder_input_ids=input_ids,
                encoder_outputs=BaseModelOutput(last_hidden_state=states),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            )
            return (out.logits, *presents(out.past_key_values, cross=False))

    return {"encoder": Encoder, "decoder": Decoder, "decoder_with_past": DecoderWithPast}[kind]().eval()


def _torch_args(arch: Arch, kind: str, batch: int, dec: int, past: int, enc: int, seed: int) -> tuple[Any, ...]:
    import torch

    feeds = seq2seq_feeds(arch, kind, batch, dec=dec, past=past, enc=enc, seed=seed)
    return tuple(torch.from_numpy(feeds[k]) for k in input_names(arch, kind))


def _dynamo_shapes(arch: Arch, kind: str) -> tuple[Any, ...]:
    """``dynamic_shapes`` for the wrapper's signature (its trailing ``*args`` as one tuple). Whisper's frames
    stay static: the model refuses any other count."""
    import torch

    dim = torch.export.Dim
    batch, dec, past = dim("batch_size"), dim("decoder_sequence_length"), dim("past_decoder_sequence_length")
    enc = dim("encoder_sequence_length")
    shapes: list[dict[int, Any]] = []
    for name in input_names(arch, kind):
        if name == "input_features":
            shapes.append({0: batch})
        elif kind == "encoder" or name in ("encoder_hidden_states", "encoder_attention_mask"):
            shapes.append({0: batch, 1: enc})
        elif name == "input_ids":
            shapes.append({0: batch, 1: dec})
        else:
            shapes.append({0: batch, 2: enc if ".encoder." in name else past})
    fixed = {"encoder": 0, "decoder": 2, "decoder_with_past": 1}[kind]
    rest = tuple(shapes[fixed:])
    return (*shapes[:fixed], rest) if rest else tuple(shapes)


def export(module: Any, arch: Arch, kind: str, path: Path, exporter: str = "ts") -> onnx.ModelProto:
    import torch

    from tests.models.build_decoders import check_plain_onnx, versions
    from tests.models.build_hf import _clean

    args = _torch_args(arch, kind, EXPORT["batch"], EXPORT["dec"], EXPORT["past"], EXPORT["enc"], seed=0)
    names = {"input_names": input_names(arch, kind), "output_names": output_names(arch, kind)}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            torch.onnx.export(
                module, args, str(path), **names, dynamic_axes=dynamic_axes(arch, kind), opset_version=OPSET,
                dynamo=False,
            )  # fmt: skip
            proto = onnx.load(str(path))
        else:
            program = torch.onnx.export(
                module, args, **names, dynamic_shapes=_dynamo_shapes(arch, kind), opset_version=OPSET, dynamo=True,
                optimize=True, verbose=False,
            )  # fmt: skip
            proto = program.model_proto
            # One signature for both exporters: Optimum's dim names on the inputs and outputs (dynamo names
            # them after its Dims and cannot spell "encoder_sequence_length / 2").
            axes = dynamic_axes(arch, kind)
            for value in [*proto.graph.input, *proto.graph.output]:
                for axis, name in axes.get(value.name, {}).items():
                    value.type.tensor_type.shape.dim[axis].dim_param = name
            del proto.graph.value_info[:]
    meta = {
        "onnxforge.builder": f"tests.models.build_seq2seq --only {arch.name}",
        "onnxforge.versions": json.dumps(versions(), sort_keys=True),
    }
    proto = _clean(proto, f"{arch.name}_{kind}_{exporter}", meta)
    check_plain_onnx(proto, input_names(arch, kind), output_names(arch, kind))
    return proto


# (batch, decoder tokens, self past, encoder length) per kind: all differ from the export's (2, 3, 4, 5)
CHECKS = {
    "encoder": ((1, 0, 0, 9), (3, 0, 0, 4)),
    "decoder": ((3, 1, 0, 7), (1, 6, 0, 11)),
    "decoder_with_past": ((3, 1, 6, 7), (1, 2, 9, 11), (2, 1, 0, 6)),  # the last: an empty self-attention cache
}


def verify(module: Any, arch: Arch, kind: str, path: Path) -> float:
    """ONNX Runtime against the torch module at ``CHECKS[kind]``; the worst absolute difference."""
    import onnxruntime as ort
    import torch

    from tests.models.build_decoders import compare_with_torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names_in, names_out = input_names(arch, kind), output_names(arch, kind)
    worst = 0.0
    for seed, (batch, dec, past, enc) in enumerate(CHECKS[kind], start=1):
        args = _torch_args(arch, kind, batch, dec, past, enc, seed)
        with torch.no_grad():
            ref = module(*args)
        got = session.run(names_out, {n: a.numpy() for n, a in zip(names_in, args, strict=True)})
        names = [f"{arch.name}/{path.name}.{n}" for n in names_out]
        worst = max(worst, compare_with_torch(names, ref, got, f"batch {batch}, dec {dec}, past {past}, enc {enc}"))
    return worst


def verify_greedy(model: Any, arch: Arch, out: Path) -> float:
    """The ONNX greedy chain's logits against the torch model on the generated sequence, no cache."""
    import onnxruntime as ort
    import torch

    sessions = {k: ort.InferenceSession(str(out / filename(k)), providers=["CPUExecutionProvider"]) for k in KINDS}
    encoder_feeds = seq2seq_feeds(arch, "encoder", 2, enc=9, seed=21)
    tokens, logits = greedy_chain(arch, sessions, encoder_feeds)
    kwargs = {k: torch.from_numpy(v) for k, v in encoder_feeds.items()}
    with torch.no_grad():
        ref = model(**kwargs, decoder_input_ids=torch.from_numpy(tokens), use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, ref, atol=ATOL, rtol=0, err_msg=f"{arch.name} greedy chain")
    if not (logits.argmax(-1)[:, :-1] == tokens[:, 1:]).all():
        raise AssertionError(f"{arch.name}: greedy tokens do not follow the logits")
    return float(np.max(np.abs(logits - ref)))


def build_arch(arch: Arch, out: Path, exporters: Sequence[str] = EXPORTERS) -> list[dict[str, Any]]:
    model = seq2seq_model(arch)
    return [e for exporter in exporters for e in build_export(model, arch, exporter, out)]


def build_export(model: Any, arch: Arch, exporter: str, out: Path) -> list[dict[str, Any]]:
    """The three files of one exporter, each verified, then the greedy chain through them; an exporter that
    cannot take a file is recorded (``error``) and its chain skipped."""
    from tests.models.build_decoders import _root_cause

    where = out / folder(arch.name, exporter)
    where.mkdir(parents=True, exist_ok=True)
    entries = []
    for kind in KINDS:
        t0 = time.perf_counter()
        path = where / filename(kind)
        module = wrap(model, arch, kind)
        entry: dict[str, Any] = {"file": f"{folder(arch.name, exporter)}/{path.name}", "arch": arch.name}
        entry.update(kind=kind, exporter=exporter)
        try:
            proto = export(module, arch, kind, path, exporter)
        except Exception as exc:  # an exporter that cannot take the model is a finding, kept in the manifest
            path.unlink(missing_ok=True)
            entries.append({**entry, "error": _root_cause(exc)})
            print(f"EXPORT FAILED {entry['file']}: {entries[-1]['error']}", flush=True)
            continue
        onnx.save(proto, str(path))
        try:
            worst = verify(module, arch, kind, path)
        except BaseException:
            path.unlink(missing_ok=True)  # an export that computes something else is never kept
            raise
        entries.append(
            {
                **entry,
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "nodes": len(proto.graph.node),
                "max_abs_diff_vs_torch": float(f"{worst:.3g}"),
            }
        )
        print(f"wrote {entry['file']}: {path.stat().st_size / 1e3:.0f} KB, {len(proto.graph.node)} nodes, "
              f"max |ort - torch| {worst:.1e} ({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip
    if any("error" in e for e in entries):
        return entries
    try:
        greedy = verify_greedy(model, arch, where)
    except BaseException:
        for kind in KINDS:
            (where / filename(kind)).unlink(missing_ok=True)
        raise
    for entry in entries:
        entry["greedy_max_abs_diff_vs_torch"] = float(f"{greedy:.3g}")
    print(f"{arch.name} ({exporter}): greedy chain of {GREEDY_STEPS} steps matches torch (max {greedy:.1e})")
    return entries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.build_seq2seq", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", action="append", choices=sorted(ARCHS), help="repeatable; default: all")
    parser.add_argument("--size", choices=("tiny", "bench"), default="tiny", help=f"bench: into {BENCH_OUT}")
    parser.add_argument("--exporter", action="append", choices=EXPORTERS, help="repeatable; default: both")
    parser.add_argument("--merge-only", action="store_true", help=f"only (re)build {MERGED} from the files there")
    args = parser.parse_args(argv)
    archs = ARCHS if args.size == "tiny" else BENCH
    if args.size == "bench" and args.out == OUT:
        args.out = BENCH_OUT
    from tests.models.build_decoders import versions

    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": []}
    entries: list[dict[str, Any]] = []
    merged: list[dict[str, Any]] = []
    for name in args.only or list(ARCHS):
        for exporter in args.exporter or EXPORTERS:
            if not args.merge_only:
                built = build_arch(archs[name], args.out, [exporter])
                entries += built
                if any("error" in e for e in built):
                    continue
            merged.append(build_merged(archs[name], exporter, args.out))
    rebuilt = {e["file"] for e in entries + merged}
    manifest = {
        "versions": manifest.get("versions", versions()) if args.merge_only else versions(),
        "archs": {n: asdict(a) for n, a in archs.items()},
        "files": sorted(
            [*(e for e in manifest["files"] if e["file"] not in rebuilt), *entries], key=lambda e: e["file"]
        ),
        # Kept apart from ``files`` (the three files of Optimum's export): merged from two of them.
        "merged": sorted(
            [*(e for e in manifest.get("merged", []) if e["file"] not in rebuilt), *merged], key=lambda e: e["file"]
        ),
        "exporters": {"ts": "torch.onnx.export(dynamo=False)", "dynamo": "torch.onnx.export(dynamo=True)"},
    }
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    failed = [e for e in entries if "error" in e]
    print(
        f"{len(entries) - len(failed)} files verified, {len(failed)} exports failed, {len(merged)} merged -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
