"""Held-out probe (issue 17): decoder families outside the corpus, exported with a KV cache, through the
``fast`` and ``int4`` presets as a user sends them (no samples, default options).

Run ``python -m bench.heldout_dec_past [--only FAMILY ...] [--exporters ts dynamo] [--presets fast int4]
[--reuse]``. Each family is built from a ``transformers`` config object (nothing downloaded; 2 layers, hidden
32, 4 heads, vocabulary 256, every parameter perturbed by ``0.02 * randn`` as ``tests.models.build_decoders``
does), wrapped into Optimum's ``text-generation-with-past`` signature by that module (``input_ids``,
``attention_mask``, ``position_ids`` where the family takes them, ``past_key_values.N.key/.value`` in;
``logits``, ``present.N.key/.value`` out) and exported by TorchScript (opset 18, eager attention) and dynamo
(``--exporters ts_sdpa``: TorchScript with ``attn_implementation`` "sdpa"),
with symbolic batch, sequence and past axes. Each export is checked against torch in ORT at a prefill on an
empty cache and a decode step on a past of 7 (``build_decoders.PAST_CHECKS``).

Each file then goes through ``.venv/bin/onnxforge optimize MODEL --preset P --report R.json`` in a subprocess
(``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1``), and the artifact is run against the upload in ORT
(optimizations off for the upload) on a generation: a prefill of 5 tokens on an empty cache, then 4 decode
steps each fed the previous step's presents, batch 2. Files and reports go to ``bench/out/heldout/``.

Columns: job (ok / failed and the error), exact (the report's verification and the generation check's
worst |diff| on logits), attention fused / expected (GroupQueryAttention, MultiHeadAttention or Attention
against the layer count; Softmax left), rotary fused / expected (2 per layer for rotary families), norms
(fused norms in ORT's session-optimized graph, upload -> artifact), speedup (the report's), and for int4
the decision and its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bench import _heldout
from tests.models import build_decoders as bd
from tests.models.corpus import _cause

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout"
CLI = REPO / ".venv" / "bin" / "onnxforge"
LAYERS, HIDDEN, HEADS, VOCAB = 2, 32, 4, 256
HEAD_DIM = HIDDEN // HEADS
GEN_PROMPT, GEN_STEPS, GEN_BATCH = 5, 4, 2
EXPORTERS = (*bd.EXPORTERS, "ts_sdpa")  # ts_sdpa: TorchScript with attn_implementation "sdpa" (not by default)


@dataclass(frozen=True)
class Probe:
    name: str
    config: str
    model: str
    kv_heads: int = 2
    rotary: bool = True
    positions: bool = True  # takes position_ids (ALiBi models do not)
    extra: tuple[tuple[str, Any], ...] = ()
    note: str = ""
    hidden: int = HIDDEN  # another probe round builds at other dims (bench/heldout_dec_round2.py)
    intermediate: int = 64
    vocab: int = VOCAB
    cache_head_dim: int | None = None  # the cache's head size where it is not hidden / heads (MLA)

    def family(self) -> bd.Family:
        return bd.Family(
            self.name,
            self.config,
            self.model,
            layers=LAYERS,
            hidden=self.hidden,
            heads=HEADS,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
            vocab=self.vocab,
            extra=self.extra,
        )


_HD = (("head_dim", HEAD_DIM),)
PROBES: dict[str, Probe] = {
    p.name: p
    for p in (
        Probe("gemma", "GemmaConfig", "GemmaForCausalLM", extra=_HD, note="GeGLU, (1+w) RMSNorm, scaled embed"),
        Probe(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            extra=(*_HD, ("sliding_window", 64), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)),
            note="soft-capping, sliding window 64 on alternate layers (4: export fails), pre/post norms",
        ),
        Probe("qwen3", "Qwen3Config", "Qwen3ForCausalLM", extra=_HD, note="per-head q/k RMSNorm"),
        Probe(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            kv_heads=HEADS,
            extra=(("rotary_pct", 0.25), ("use_parallel_residual", True)),
            note="partial rotary 0.25, parallel residual, fused qkv, LayerNorm",
        ),
        Probe(
            "falcon",
            "FalconConfig",
            "FalconForCausalLM",
            kv_heads=1,
            extra=(
                ("new_decoder_architecture", False),
                ("multi_query", True),
                ("parallel_attn", True),
                ("alibi", False),
                ("bias", True),
            ),
            note="multi-query (1 kv head), parallel attention",
        ),
        Probe(
            "stablelm",
            "StableLmConfig",
            "StableLmForCausalLM",
            extra=(("partial_rotary_factor", 0.25),),
            note="partial rotary 0.25, LayerNorm",
        ),
        Probe(
            "granite",
            "GraniteConfig",
            "GraniteForCausalLM",
            extra=(
                ("embedding_multiplier", 12.0),
                ("attention_multiplier", 0.05),
                ("residual_multiplier", 0.22),
                ("logits_scaling", 8.0),
            ),
            note="embedding/attention/residual/logit multipliers",
        ),
        Probe("olmo2", "Olmo2Config", "Olmo2ForCausalLM", note="q/k RMSNorm over all heads, post-norms"),
        Probe(
            "starcoder2",
            "Starcoder2Config",
            "Starcoder2ForCausalLM",
            extra=(("use_bias", True),),
            note="biases, LayerNorm, GELU MLP",
        ),
        Probe(
            "opt",
            "OPTConfig",
            "OPTForCausalLM",
            kv_heads=HEADS,
            rotary=False,
            extra=(("ffn_dim", 64), ("word_embed_proj_dim", HIDDEN), ("enable_bias", True)),
            note="learned positions (offset 2), no rotary, ReLU",
        ),
        Probe(
            "bloom",
            "BloomConfig",
            "BloomForCausalLM",
            kv_heads=HEADS,
            rotary=False,
            positions=False,
            extra=(("n_head", HEADS), ("n_layer", LAYERS)),
            note="ALiBi, no position_ids, fused qkv",
        ),
    )
}


# ------------------------------------------------------------------------------------------------ build


def names_in(probe: Probe) -> list[str]:
    names = bd.input_names(LAYERS, "past")
    return names if probe.positions else [n for n in names if n != "position_ids"]


def signature(probe: Probe) -> bd.Signature:
    family = probe.family()
    head_dim = probe.cache_head_dim or family.head_dim
    return bd.Signature(tuple(names_in(probe)), LAYERS, probe.kv_heads, head_dim, family.vocab)


def module(probe: Probe, attention: str = "eager") -> Any:
    """The seeded model behind the Optimum signature; without ``position_ids`` for ALiBi families, whose
    forward does not take them."""
    import torch
    from transformers.cache_utils import DynamicCache

    model = bd.causal_lm(probe.family())
    if attention == "sdpa" and not getattr(type(model), "_supports_sdpa", False):
        raise ValueError(f"transformers has no SDPA attention for {type(model).__name__}")  # as it refuses
    model.config._attn_implementation = attention
    if probe.positions:
        return bd.wrap(model, "past")
    config = model.config

    class WithPastNoPositions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(LAYERS)], config=config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            return (out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)))

    return WithPastNoPositions().eval()


def _args(probe: Probe, batch: int, seq: int, past: int, seed: int) -> tuple[Any, ...]:
    import torch

    feeds = bd.decoder_feeds(signature(probe), batch, seq, past, seed=seed)
    return tuple(torch.from_numpy(feeds[k]) for k in names_in(probe))


def export(
    mod: Any, probe: Probe, exporter: str, path: Path, script: str = "bench.heldout_dec_past"
) -> onnx.ModelProto:
    """``build_decoders.export``'s axes and checks, for a signature with or without ``position_ids``."""
    import torch

    from tests.models.build_hf import _clean

    ins, outs = names_in(probe), bd.output_names(LAYERS, "past")
    args = _args(probe, *bd.EXPORT_SHAPE, seed=0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter in ("ts", "ts_sdpa"):
            axes = {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "position_ids", "logits")}
            axes["attention_mask"] = {0: "batch", 1: "total_sequence"}
            axes |= {n: {0: "batch", 2: "past_sequence"} for n in ins if n.startswith("past_")}
            axes |= {n: {0: "batch", 2: "total_sequence"} for n in outs[1:]}
            torch.onnx.export(
                mod,
                args,
                str(path),
                input_names=ins,
                output_names=outs,
                dynamic_axes={k: v for k, v in axes.items() if k in ins + outs},
                opset_version=bd.OPSET,
                dynamo=False,
            )
            proto = onnx.load(str(path))
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            total, past = torch.export.Dim("total_sequence"), torch.export.Dim("past_sequence")
            shapes: tuple[Any, ...] = ({0: batch, 1: seq}, {0: batch, 1: total})
            if probe.positions:
                shapes = (*shapes, {0: batch, 1: seq})
            shapes = (*shapes, tuple({0: batch, 2: past} for n in ins if n.startswith("past_")))
            program = torch.onnx.export(
                mod,
                args,
                input_names=ins,
                output_names=outs,
                dynamic_shapes=shapes,
                opset_version=bd.OPSET,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            proto = program.model_proto
    meta = {"onnxforge.builder": f"{script} --only {probe.name} --exporters {exporter}"}
    proto = _clean(proto, path.stem, meta)
    bd.check_plain_onnx(proto, ins, outs)
    return proto


def verify(mod: Any, probe: Probe, path: Path) -> float:
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ins, outs = names_in(probe), bd.output_names(LAYERS, "past")
    worst = 0.0
    for seed, (batch, seq, past) in enumerate(bd.PAST_CHECKS, start=1):
        args = _args(probe, batch, seq, past, seed)
        with torch.no_grad():
            ref = mod(*args)
        got = session.run(outs, {n: a.numpy() for n, a in zip(ins, args, strict=True)})
        where = f"batch {batch}, sequence {seq}, past {past}"
        worst = max(worst, bd.compare_with_torch([f"{path.name}.{n}" for n in outs], ref, got, where))
    return worst


def build(
    probe: Probe, exporter: str, reuse: bool, out: Path = OUT, script: str = "bench.heldout_dec_past"
) -> dict[str, Any]:
    path = out / f"{probe.name}_past_{exporter}.onnx"
    side = path.with_suffix(".build.json")
    if reuse and side.exists():
        info = json.loads(side.read_text())
        if not info.get("ok") or path.exists():
            return info
    info: dict[str, Any] = {"file": str(path), "family": probe.name, "exporter": exporter}
    try:
        mod = module(probe, "sdpa" if exporter == "ts_sdpa" else "eager")
        proto = export(mod, probe, exporter, path, script)
        bd.save(proto, path)
        info["max_abs_vs_torch"] = verify(mod, probe, path)
        info.update(ok=True, nodes=len(proto.graph.node))
    except Exception as exc:  # an export transformers/torch cannot make is a finding for the table
        path.unlink(missing_ok=True)
        info.update(ok=False, error=f"{type(exc).__name__}: {_cause(exc)}"[:400])
    side.write_text(json.dumps(info, indent=1) + "\n")
    return info


# --------------------------------------------------------------------------------------------- optimize


def optimize(path: Path, preset: str) -> dict[str, Any]:
    out = path.with_name(f"{path.stem}.{preset}.onnx")
    report = path.with_name(f"{path.stem}.{preset}.report.json")
    env = {**os.environ, "ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS": "1"}
    report.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(CLI), "optimize", str(path), "-o", str(out), "--preset", preset, "--report", str(report)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    res: dict[str, Any] = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    if not report.exists():
        res["error"] = (proc.stderr.strip().splitlines() or ["no report"])[-1][:300]
        return res
    r = json.loads(report.read_text())
    res["report"] = r
    res["artifact"] = str(out) if out.exists() else None
    return res


def _ort_fused_norms(path: Path | str) -> int:
    """Norms in the graph ORT's session builds at its default level (what a user runs)."""
    return sum(v for k, v in _heldout.session_ops(path).items() if "LayerNormalization" in k)


def generation_diff(original: Path, artifact: Path, probe: Probe) -> float:
    """Worst |diff| of the artifact's logits and presents against the upload (optimizations off) over a
    prefill on an empty cache and GEN_STEPS decode steps, each fed the previous step's presents."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(original), so, providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
    outs = bd.output_names(LAYERS, "past")
    sig = signature(probe)
    feeds = bd.decoder_feeds(sig, GEN_BATCH, GEN_PROMPT, 0, seed=3)
    worst, past = 0.0, 0
    for step in range(GEN_STEPS + 1):
        a = dict(zip(outs, ref.run(outs, feeds), strict=True))
        b = dict(zip(outs, got.run(outs, feeds), strict=True))
        for name in outs:
            if a[name].shape != b[name].shape:
                raise AssertionError(f"step {step} {name}: shape {b[name].shape} != {a[name].shape}")
            worst = max(worst, float(np.max(np.abs(a[name] - b[name]))) if a[name].size else 0.0)
        past += feeds["input_ids"].shape[1]
        tokens = a["logits"][:, -1:].argmax(-1).astype(np.int64)
        feeds = bd.decoder_feeds(sig, GEN_BATCH, 1, past, tokens=tokens, past_values=bd.presents_as_past(a))
    return worst


def summarize(probe: Probe, build_info: dict[str, Any], preset: str, res: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"family": probe.name, "exporter": build_info["exporter"], "preset": preset}
    r = res.get("report")
    if r is None:
        row.update(job="failed", error=res.get("error"))
        return row
    decision = r.get("decision") or {}
    row["job"] = "ok" if res["rc"] == 0 else f"failed (rc {res['rc']})"
    row["decision"] = decision.get("result")
    row["reason"] = decision.get("reason")
    ver = r.get("verification") or {}
    row["verified"] = ver.get("ok")
    row["max_abs"] = max((o.get("max_abs") or 0.0 for o in ver.get("outputs", [])), default=None)
    row["applied"] = [p["name"] for p in r.get("passes", []) if p.get("status") == "applied"]
    row["failed_passes"] = {p["name"]: p.get("reason") for p in r.get("passes", []) if p.get("status") == "failed"}
    quant = [p for p in r.get("passes", []) if p["name"] == "quantize_int4"]
    if quant:  # the int4 preset's accuracy decision: which MatMuls stay int4 within the budget, and why
        row["int4"] = f"{quant[-1].get('status')}: {(quant[-1].get('reason') or '')[:150]}"
    row["rolled_back"] = {p["name"]: p.get("reason") for p in r.get("passes", []) if p.get("status") == "rolled_back"}
    after = (r.get("op_histogram") or {}).get("after") or {}
    fused = ("GroupQueryAttention", "MultiHeadAttention", "Attention")
    row["attention"] = sum(after.get(f"com.microsoft::{k}", 0) for k in fused)
    row["attention_ops"] = {k.split("::")[-1]: v for k, v in after.items() if k.endswith("Attention")}
    row["softmax"] = after.get("Softmax", 0)
    row["rotary"] = after.get("com.microsoft::RotaryEmbedding", 0)
    row["trig"] = after.get("Sin", 0) + after.get("Cos", 0)
    row["speedup"] = (r.get("summary") or {}).get("speedup")
    why = {}
    for p in r.get("passes", []):
        if p["name"] in ("fuse_gqa", "fuse_rotary", "fuse_transformer") and p.get("non_matches"):
            why[p["name"]] = [m.get("reason") for m in p["non_matches"]][:3]
    row["why_not"] = why
    art = res.get("artifact")
    if art and row["decision"] != "failed":
        try:
            row["norms"] = (_ort_fused_norms(build_info["file"]), _ort_fused_norms(art))
            row["gen_max_abs"] = generation_diff(Path(build_info["file"]), Path(art), probe)
        except Exception as exc:  # a generation the artifact cannot run is the finding
            row["gen_error"] = f"{type(exc).__name__}: {_cause(exc)}"[:300]
    return row


# ------------------------------------------------------------------------------------------------- table


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.1e}" if isinstance(x, float) else str(x)


HEAD = [
    "model",
    "exporter",
    "preset",
    "job",
    "exact (report / generation)",
    "attention fused/expected",
    "rotary fused/expected",
    "norms (ORT, upload -> artifact)",
    "speedup",
    "notes",
]


def _cells(row: dict[str, Any], probes: dict[str, Probe] = PROBES) -> list[str]:
    probe = probes[row["family"]]
    if row.get("job") == "failed" and "report" not in row and row.get("decision") is None:
        return [row["family"], row["exporter"], row["preset"], "failed", *["-"] * 5, (row.get("error") or "")[:160]]
    exact = f"{_fmt(row.get('verified'))} {_fmt(row.get('max_abs'))} / {_fmt(row.get('gen_max_abs'))}"
    if row.get("gen_error"):
        exact += f" (generation: {row['gen_error'][:80]})"
    att = f"{row['attention']}/{LAYERS} {row['attention_ops'] or ''} softmax {row['softmax']}"
    rot = f"{row['rotary']}/{2 * LAYERS if probe.rotary else 0}" + (f" trig {row['trig']}" if row["trig"] else "")
    norms = "{} -> {}".format(*row["norms"]) if row.get("norms") else "-"
    notes = []
    if row["decision"] != "optimized":
        notes.append(f"{row['decision']}: {(row.get('reason') or '')[:140]}")
    if row.get("int4"):
        notes.append(f"quantize_int4 {row['int4']}")
    for name, why in {**row.get("failed_passes", {}), **row.get("rolled_back", {})}.items():
        if name != "quantize_int4":
            notes.append(f"{name}: {(why or '')[:120]}")
    for name, why in row.get("why_not", {}).items():
        notes.append(f"{name}: {'; '.join(w or '' for w in why)[:160]}")
    cells = [row["family"], row["exporter"], row["preset"], row["job"], exact, att, rot, norms]
    return [*cells, f"{row['speedup']:.2f}x" if row.get("speedup") else "-", " / ".join(notes)]


def table(rows: list[dict[str, Any]], builds: list[dict[str, Any]], probes: dict[str, Probe] = PROBES) -> str:
    failed = [
        [b["family"], b["exporter"], "-", "export failed", *["-"] * 5, b["error"][:160]]
        for b in builds
        if not b.get("ok")
    ]
    return _heldout.table(HEAD, [*failed, *(_cells(r, probes) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = _heldout.arguments("python -m bench.heldout_dec_past", __doc__, PROBES, EXPORTERS)
    parser.set_defaults(exporters=list(bd.EXPORTERS))  # ts_sdpa only on request
    parser.add_argument("--presets", nargs="*", default=["fast", "int4"])
    parser.add_argument("--reuse", action="store_true", help="keep earlier exports (their build sidecars)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    builds, rows = [], []
    for name in args.only:
        probe = PROBES[name]
        for exporter in args.exporters:
            info = build(probe, exporter, args.reuse, args.out)
            builds.append(info)
            print(f"{name} {exporter}: export {'ok' if info['ok'] else info['error'][:200]}", flush=True)
            if not info["ok"]:
                continue
            for preset in args.presets:
                res = optimize(Path(info["file"]), preset)
                row = summarize(probe, info, preset, res)
                rows.append(row)
                print(
                    f"  {preset}: {row.get('decision') or row.get('error')} attention {row.get('attention')} "
                    f"rotary {row.get('rotary')} gen {row.get('gen_max_abs') or row.get('gen_error')} "
                    f"({res['seconds']}s)",
                    flush=True,
                )
    (args.out / "rows.json").write_text(json.dumps({"builds": builds, "rows": rows}, indent=1, default=str) + "\n")
    print(table(rows, builds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
