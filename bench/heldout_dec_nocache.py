"""Held-out probe, decoders without a KV cache (issue 17): causal LMs outside the corpus, sent as a new user
sends them (``preset fast``, no samples, default options).

Run ``python -m bench.heldout_dec_nocache [--only NAME ...] [--exporters E ...] [--reuse]``.

Each model of ``SPECS`` (none of them in ``tests/models/_corpus_specs.py``) comes from a transformers config
object (nothing downloaded; 2 layers, hidden 32, 4 heads of 8, 2 key/value heads where the family has GQA, a
384-token vocabulary, ``use_cache=False``), every parameter perturbed by ``0.02 * randn`` (the exporters fold
equal initializers and drop zero biases), wrapped as ``(input_ids, attention_mask) -> logits`` and exported the
three ways of ``tests/models/corpus.py`` (TorchScript opset 17 with eager and with SDPA attention, dynamo opset
18) with dynamic batch and sequence axes, then checked in ONNX Runtime against torch on two shapes other than
the export example (the last row half padding). A model transformers cannot export is a row with the reason.

Each export then goes through ``onnxforge optimize MODEL -o OUT --preset fast --report R.json`` in a child
process with ``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1`` (``bench.coverage.run_job``). Columns: job (ok
and the decision, or the error), exact (the report's final verification, worst max abs), attention fused /
expected (``Attention``/``MultiHeadAttention``/``GroupQueryAttention`` after against the upload's Softmax
count), rotary (``RotaryEmbedding`` after / 2 per layer for rotary families), norms (fused
``LayerNormalization``/``SimplifiedLayerNormalization`` and skip forms after, against the upload's
``LayerNormalization`` plus RMS norms; in brackets the norms of ORT's session-optimized graph, upload ->
artifact, where RMS norms become ``SimplifiedLayerNormalization``), GELU (fused / ``Erf``+``Tanh``
before), speedup (the report's gate) and notes (passes that failed, what ``fuse_transformer`` missed and
why). Files and ``results.json`` go to ``bench/out/heldout/dec_nocache/``; a markdown table is printed.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout  # noqa: E402
from bench.coverage import ATTENTION_OPS, _rms_norms  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_nocache"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
INPUTS = ("input_ids", "attention_mask")
ATOL, RTOL = 1e-4, 1e-3
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, POSITIONS = 2, 32, 4, 2, 64, 384, 264
PAD, BOS, EOS, LOW = 1, 0, 2, 5
CHECK_SHAPES = ((1, 7), (3, 23))
BUILDER_VERSION = 2
NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization")
NORM_OPS += ("SkipSimplifiedLayerNormalization",)


@dataclass(frozen=True)
class Spec:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: dict[str, Any] = field(default_factory=dict)
    rotary: bool = True
    note: str = ""


_DEC = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": POSITIONS,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "use_cache": False,
    "tie_word_embeddings": False,
}
_HD = {"head_dim": HIDDEN // HEADS}
_MHA = {k: v for k, v in _DEC.items() if k != "num_key_value_heads"}
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("gemma", "GemmaConfig", "GemmaForCausalLM", {**_DEC, **_HD}, note="GeGLU, (1+w) RMSNorm, scaled embed"),
        Spec(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {**_DEC, **_HD, "sliding_window": 8, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
            note="soft-capping, window 8 on alternate layers, pre/post norms",
        ),
        Spec(
            "gemma3_text",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {**_DEC, **_HD, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
            note="q/k RMSNorm, local/global rope, window 8",
        ),
        Spec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_DEC, **_HD}, note="per-head q/k RMSNorm"),
        Spec(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            {**_MHA, "rotary_pct": 0.25, "use_parallel_residual": True},
            note="partial rotary 0.25, parallel residual, fused qkv, LayerNorm",
        ),
        Spec(
            "opt",
            "OPTConfig",
            "OPTForCausalLM",
            {**_MHA, "ffn_dim": FFN, "word_embed_proj_dim": HIDDEN, "enable_bias": True},
            rotary=False,
            note="learned positions, ReLU",
        ),
        Spec(
            "bloom",
            "BloomConfig",
            "BloomForCausalLM",
            {**_MHA, "n_head": HEADS, "n_layer": LAYERS},
            rotary=False,
            note="ALiBi, fused qkv",
        ),
        Spec(
            "falcon",
            "FalconConfig",
            "FalconForCausalLM",
            {**_MHA, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": True},
            note="multi-query, parallel attention",
        ),
        Spec(
            "stablelm",
            "StableLmConfig",
            "StableLmForCausalLM",
            {**_DEC, "partial_rotary_factor": 0.25},
            note="partial rotary 0.25, LayerNorm",
        ),
        Spec(
            "granite",
            "GraniteConfig",
            "GraniteForCausalLM",
            {
                **_DEC,
                "embedding_multiplier": 12.0,
                "attention_multiplier": 0.05,
                "residual_multiplier": 0.22,
                "logits_scaling": 8.0,
            },
            note="embedding/attention/residual/logit multipliers",
        ),
        Spec("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _DEC, note="q/k RMSNorm over all heads, post-norms"),
        Spec(
            "starcoder2",
            "Starcoder2Config",
            "Starcoder2ForCausalLM",
            {**_DEC, "use_bias": True, "sliding_window": None},
            note="biases, LayerNorm, GELU MLP",
        ),
        Spec(
            "gptj",
            "GPTJConfig",
            "GPTJForCausalLM",
            {
                "vocab_size": VOCAB,
                "n_embd": HIDDEN,
                "n_layer": LAYERS,
                "n_head": HEADS,
                "n_inner": FFN,
                "n_positions": POSITIONS,
                "rotary_dim": 4,
                "bos_token_id": BOS,
                "eos_token_id": EOS,
                "pad_token_id": PAD,
                "use_cache": False,
                "tie_word_embeddings": False,
            },
            note="interleaved partial rotary (4 of 8), parallel residual",
        ),
        Spec(
            "cohere",
            "CohereConfig",
            "CohereForCausalLM",
            {**_DEC, "logit_scale": 0.5},
            note="bias-free LayerNorm, interleaved rotary, parallel residual",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- build


def feeds(batch: int, seq: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    """Token ids and mask; ``pad``: the last row's second half is padding (right padding, as a batch of
    prompts of unequal length is sent to a model without a cache)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(LOW, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if pad and seq > 2:
        mask[-1, seq // 2 :] = 0
    for row in range(batch):
        n = int(mask[row].sum())
        ids[row, 0], ids[row, n:] = BOS, PAD
    return {"input_ids": ids, "attention_mask": mask}


def _model(spec: Spec, attention: str) -> Any:
    import torch
    import transformers as tf

    config = getattr(tf, spec.config)(**spec.kwargs, attn_implementation=attention)
    torch.manual_seed(0)
    model = getattr(tf, spec.model)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def _wrapper(model: Any) -> Any:
    import torch

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
            return (out.logits,)

    return Causal().eval()


def _export(wrapper: Any, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    args = tuple(torch.from_numpy(example[k]) for k in INPUTS)
    axes = {k: {0: "batch", 1: "sequence"} for k in (*INPUTS, "logits")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(INPUTS),
                output_names=["logits"],
                dynamic_shapes=tuple(axes[k] for k in INPUTS),
                opset_version=18,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            return program.model_proto
        torch.onnx.export(
            wrapper,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=list(INPUTS),
            output_names=["logits"],
            dynamic_axes=axes,
        )
    return onnx.load(str(path))


def _verify(wrapper: Any, path: Path) -> float:
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed, (batch, seq) in enumerate(CHECK_SHAPES, start=1):
        x = feeds(batch, seq, seed=seed, pad=True)
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(x[k]) for k in INPUTS))[0].numpy()
        got = session.run(["logits"], x)[0]
        if got.shape != want.shape:
            raise AssertionError(f"at {batch}x{seq}: ORT shape {got.shape} != torch {want.shape}")
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=f"{path.name} at {batch}x{seq}")
        worst = max(worst, float(np.max(np.abs(got - want))))
    return worst


def build(
    name: str, exporter: str, out: Path, specs: dict[str, Spec] = SPECS, script: str = "bench.heldout_dec_nocache"
) -> dict[str, Any]:
    spec = specs[name]
    path = out / f"{name}_{exporter}.onnx"
    info: dict[str, Any] = {"model": name, "exporter": exporter, "builder_version": BUILDER_VERSION}
    import transformers as tf

    if not hasattr(tf, spec.config):
        info.update(ok=False, skipped=True, error=f"transformers {tf.__version__} has no {spec.config}")
        return info
    with _heldout.build_record(info, path) as tmp:
        attention = "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = _model(spec, attention)
        except (ValueError, ImportError) as exc:
            if exporter == "ts_sdpa":
                raise RuntimeError(f"transformers refuses sdpa: {str(exc).split('. ')[0]}") from exc
            model = _model(spec, "eager")  # the dynamo user falls back to the attention transformers allows
        info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        wrapper = _wrapper(model)
        example = feeds(2, 16)
        proto = _export(wrapper, exporter, example, tmp)
        _heldout.finish_build(
            info,
            proto,
            tmp,
            path,
            builder=f"{script} --only {name} --exporters {exporter}",
            verify=lambda: _verify(wrapper, path),
        )
    return info


# ------------------------------------------------------------------------------------------------- jobs


def _session_norms(path: Path) -> int:
    """Norms in the graph ORT's session builds at its default level: RMS norms are fused there
    (``SimplifiedLayerNormalization``), not in the artifact, as for the corpus's Llama."""
    ops = _heldout.session_ops(path)
    return sum(ops[o] for o in NORM_OPS)


def _structure(src: Path, dst: Path | None) -> dict[str, Any]:
    def before(model: onnx.ModelProto, ops: Counter[str]) -> dict[str, Any]:
        return {"norms": ops["LayerNormalization"] + _rms_norms(model), "gelu": ops["Erf"] + ops["Tanh"]}

    def after(_: onnx.ModelProto, done: Counter[str]) -> dict[str, Any]:
        return {
            "attention_after": sum(done[o] for o in ATTENTION_OPS),
            "attention_ops": {o: done[o] for o in ATTENTION_OPS if done[o]},
            "rotary_after": done["RotaryEmbedding"],
            "norms_after": sum(done[o] for o in NORM_OPS),
            "session_norms": [_session_norms(src), _session_norms(dst)],
        }

    return _heldout.structure(src, dst, before, after)


def probe(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    return _heldout.probe(name, exporter, out, reuse, version=BUILDER_VERSION, build=build, counts=_structure)


def _cells(row: dict[str, Any], specs: dict[str, Spec] = SPECS) -> list[str]:
    name, exporter = row["model"], row["exporter"]
    if not row.get("ok"):
        return [
            name,
            exporter,
            "skipped" if row.get("skipped") else "export failed",
            "",
            "",
            "",
            "",
            "",
            row["error"][:200],
        ]
    job, st = row["job"], row["structure"]
    if not job.get("ok"):
        return [name, exporter, "**failed**", "", "", "", "", "", job["error"][:240]]
    spec = specs[name]
    notes = _heldout.job_notes(job, 160)
    if st.get("attention_ops"):
        notes.append("/".join(st["attention_ops"]))
    speed = job.get("gate_speedup")
    rotary = f"{st.get('rotary_after', 0)}/{2 * LAYERS}" if spec.rotary else "-"
    return [
        name,
        exporter,
        f"ok ({job['decision']})",
        f"yes ({job['max_abs']:.0e})" if job["exact"] else f"**no** ({job['max_abs']:.1e})",
        f"{st.get('attention_after', 0)}/{st['softmax']}",
        rotary,
        "{}/{} ({}->{})".format(st.get("norms_after", 0), st["norms"], *st.get("session_norms", ("?", "?"))),
        f"{st['fusions']['gelu']['found']}/{st['gelu']}" if st["gelu"] else "-",
        (f"x{speed:.2f}" if speed else "-") + ("; " if notes else "") + "; ".join(notes),
    ]


HEAD = ["model", "exporter", "job", "exact (max abs)", "attention", "rotary", "norms", "GELU", "speedup; notes"]


def table(rows: list[dict[str, Any]]) -> str:
    return _heldout.table(HEAD, map(_cells, rows))


def gelu_ab(shape: tuple[int, int, int] = (4, 128, 4096), blocks: int = 30) -> dict[str, dict[str, float]]:
    """ms per run of each tanh-GELU form the project fuses into FastGelu, unfused (twice: an A/A) and fused,
    alone on an activation of ``shape``, 1 thread, ORT's default level (its session fuses neither form),
    interleaved blocks in rotating order; medians."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

    from passes.fusion import _tanh_gelu
    from tests.passes.test_fuse_tanh_gelu_torchscript import FORMS

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out: dict[str, dict[str, float]] = {}
    for form, nodes in FORMS.items():
        info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", shape[-1]]) for n in ("h", "gelu")]
        upload = helper.make_model(
            helper.make_graph(nodes("h", 0.044715), "g", info[:1], info[1:]),
            opset_imports=[helper.make_opsetid("", 17)],
        )
        model = ir.serde.deserialize_model(upload)
        ShapeInferencePass()(model)
        assert _tanh_gelu.rules.apply_to_model(model) == 1
        RemoveUnusedNodesPass()(model)
        sessions = {}
        for name, proto in (("unfused", upload), ("fused", ir.serde.serialize_model(model)), ("unfused_copy", upload)):
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            sessions[name] = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sessions["fused"].run(None, {"h": x})[0], sessions["unfused"].run(None, {"h": x})[0],
                                   atol=2e-5, rtol=1e-5)  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in sessions}
        keys = list(sessions)
        for block in range(blocks):
            for key in keys[block % 3 :] + keys[: block % 3]:
                started = time.perf_counter()
                sessions[key].run(None, {"h": x})
                times[key].append(time.perf_counter() - started)
        out[form] = {k: round(float(np.median(v)) * 1e3, 3) for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = _heldout.arguments("python -m bench.heldout_dec_nocache", __doc__, SPECS, EXPORTERS, nargs="*")
    ap.add_argument("--reuse", action="store_true", help="keep each row already recorded by this builder version")
    ap.add_argument("--gelu-ab", action="store_true", help="time the tanh-GELU forms unfused vs FastGelu, only")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.gelu_ab:
        for form, ms in gelu_ab().items():
            print(f"{form}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = _heldout.run_all(args.only, args.exporters, lambda n, e: probe(n, e, args.out, args.reuse), _cells)
    results = args.out / "results.json"
    merged = json.loads(results.read_text()) if results.exists() else {}
    merged.update({f"{r['model']}/{r['exporter']}": r for r in rows})
    results.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
