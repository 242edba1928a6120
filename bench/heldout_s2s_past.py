"""Held-out probe (issue 19 item 1, issue 17): encoder-decoders outside the corpus as Optimum's split files with a
KV cache, each decoder file through the ``fast`` and ``int4`` presets as a user sends it (no samples).

Run ``python -m bench.heldout_s2s_past [--only NAME ...] [--exporters ts dynamo] [--presets fast int4]
[--reuse]``. Marian, mBART, Pegasus, M2M100, BlenderbotSmall, mT5 and Whisper come from
``bench.heldout_s2s_multi``'s configs (2 layers, hidden 32, 4 heads, vocabulary 384, every parameter perturbed;
Whisper as ``WhisperForConditionalGeneration``), and ``tests.models.build_seq2seq`` wraps and exports them as
``encoder_model.onnx``, ``decoder_model.onnx`` (no past: ``present.N.decoder/encoder.key/value`` out) and
``decoder_with_past_model.onnx`` (``past_key_values.N.decoder/encoder.key/value`` and
``encoder_attention_mask`` in, the self-attention presents out), Optimum's names and dims, and checks each in
ORT against torch on shapes other than the export's (an encoder cache longer or shorter than the self cache,
an empty self cache) and a greedy chain through the three files against torch without a cache; then merges
the two decoders into ``decoder_model_merged.onnx`` as Optimum does (``build_seq2seq.build_merged``: one If on
``use_cache_branch``, each branch checked against its file). TorchScript exports eager attention; dynamo SDPA,
falling back to eager where the exporter refuses it (mT5).

Each decoder file (the two and the merged one) then goes through ``.venv/bin/onnxforge optimize FILE --preset P
--report R.json`` (``bench.heldout_dec_past.optimize``: a child process,
``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1``), and a greedy generation of ``STEPS`` tokens (batch 2, the
encoder's second row a third padding) is replayed through the upload's encoder, the optimized decoder and the
optimized decoder-with-past fed each step's presents (the self cache growing, the cross cache the first
step's, fixed), or both steps through the optimized merged file (its no-cache branch on dummy caches first, as
Optimum's runtime feeds it), against the same chain through the uploads (ORT, optimizations off): same
tokens, worst |diff| of the logits.

Columns: job (the decision; its reason where not optimized), exact (the report's verification, the
generation's tokens and worst logit diff), self / cross attention fused out of the layers (a fused attention
is a cross attention when its keys do not read ``input_ids``), what fuse_transformer expected, and the
report's reasons (missing fusions, failed passes, quantize_int4's decision). Files, reports and
``rows.json`` go to ``bench/out/heldout/s2s_past/``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout  # noqa: E402
from bench.heldout_dec_past import optimize  # noqa: E402
from bench.heldout_s2s_multi import HEADS, HIDDEN, LAYERS, SPECS, VOCAB, _model  # noqa: E402
from tests.models import build_seq2seq as s2s  # noqa: E402
from tests.models.corpus import _cause  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "s2s_past"
PROG = "python -m bench.heldout_s2s_past"
NAMES = ("marian", "mbart", "pegasus", "m2m100", "blenderbot_small", "mt5", "whisper")
EXPORTERS = ("ts", "dynamo")
DECODERS = ("decoder", "decoder_with_past", "decoder_merged")
STEPS = 8
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


def arch(name: str) -> s2s.Arch:
    spec = SPECS[name]
    model = "WhisperForConditionalGeneration" if name == "whisper" else spec.model
    start = spec.kwargs.get("decoder_start_token_id", 0)
    return s2s.Arch(name, spec.config, model, layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, start=start)


def build(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    """The three files of one export, verified by ``build_seq2seq.build_export`` (each file against torch and
    the greedy chain); dynamo's SDPA refusal is kept and eager exported instead."""
    a = arch(name)
    where = out / s2s.folder(name, exporter)
    side = where / "build.json"
    if reuse and side.exists():
        return json.loads(side.read_text())
    where.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"model": name, "exporter": exporter, "where": str(where)}
    spec = dataclasses.replace(SPECS[name], model=a.model)
    attention = "eager" if exporter == "ts" else "sdpa"
    try:
        try:
            entries = s2s.build_export(_model(spec, attention), a, exporter, out)
            failed = [e for e in entries if "error" in e]
        except Exception as exc:
            failed = [{"error": _cause(exc)}]
        if failed and attention == "sdpa":
            info["sdpa_error"] = failed[0]["error"][:300]
            attention = "eager"
            entries = s2s.build_export(_model(spec, attention), a, exporter, out)
            failed = [e for e in entries if "error" in e]
        if failed:
            raise RuntimeError(failed[0]["error"])
        entries.append(s2s.build_merged(a, exporter, out))  # Optimum's fourth file, each branch verified
        for path in [*(where / s2s.filename(k) for k in s2s.KINDS), where / s2s.MERGED]:  # not build_seq2seq's
            proto = onnx.load(str(path))
            del proto.metadata_props[:]
            proto.metadata_props.add(key="onnxforge.builder", value=f"{PROG} --only {name} --exporters {exporter}")
            onnx.save(proto, str(path))
        info.update(ok=True, attention=attention, files={e["kind"]: e for e in entries})
    except Exception as exc:
        info.update(ok=False, error=f"{type(exc).__name__}: {_cause(exc)}"[:400])
    side.write_text(json.dumps(info, indent=1, default=str) + "\n")
    return info


# ------------------------------------------------------------------------------------------------ counts


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and, depth first, the branches of its If nodes (a merged decoder's two decoders)."""
    out = [graph]
    for node in graph.node:
        out += [g for attr in node.attribute if attr.type == onnx.AttributeProto.GRAPH for g in _graphs(attr.g)]
    return out


def attention_split(model: onnx.ModelProto) -> dict[str, int]:
    """Fused attentions by kind, over every branch: a cross attention's keys (MultiHeadAttention's input 1, or
    its cached key where the key input is empty) do not read the decoder's ``input_ids`` (their data: shapes
    read off it do not count); Attention packs
    q/k/v, so it is a self attention. A branch's values are traced in the branch, then the outer graph (the
    two branches of a merged decoder reuse names)."""
    outer = {o: n for n in model.graph.node for o in n.output}
    out = {"self": 0, "cross": 0}
    for graph in _graphs(model.graph):
        producer = outer | {o: n for n in graph.node for o in n.output}

        def reads_ids(value: str, producer: dict[str, onnx.NodeProto] = producer) -> bool:
            seen, stack = set(), [value]
            while stack:
                v = stack.pop()
                if v == "input_ids":
                    return True
                if v not in seen and v in producer and producer[v].op_type not in ("Shape", "Size"):
                    seen.add(v)  # data only: a Reshape of the encoder's keys to the decoder's batch reads ids' Shape
                    stack.extend(i for i in producer[v].input if i)
            return False

        for node in graph.node:
            if node.domain != "com.microsoft" or node.op_type not in ATTENTION_OPS:
                continue
            keys = [node.input[i] for i in (1, 6) if len(node.input) > i and node.input[i]]
            cross = node.op_type == "MultiHeadAttention" and bool(keys) and not any(map(reads_ids, keys))
            out["cross" if cross else "self"] += 1
    return out


# ------------------------------------------------------------------------------------------- generation


class _Branch:
    """One branch of a merged decoder as ``greedy_chain`` calls a separate file: the flag set and the inputs
    the branch ignores fed as Optimum's runtime feeds them (dummy caches of ``NO_CACHE_PAST`` on the first
    step; on later steps, encoder states of the cross cache's length, which the cache branch does not read)."""

    def __init__(self, session: Any, a: s2s.Arch, use_cache: bool) -> None:
        self.session, self.arch, self.use_cache = session, a, use_cache
        kind = "decoder_with_past" if use_cache else "decoder"
        self.names = s2s.output_names(a, kind)

    def get_outputs(self) -> list[Any]:
        return [o for o in self.session.get_outputs() if o.name in self.names]

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        a, batch = self.arch, feeds["input_ids"].shape[0]
        full = dict(feeds, **{s2s.USE_CACHE: np.array([self.use_cache])})
        if self.use_cache:
            enc = feeds["past_key_values.0.encoder.key"].shape[2]
            full["encoder_hidden_states"] = np.zeros((batch, enc, a.hidden), np.float32)
        else:
            dummy = np.zeros((batch, a.heads, s2s.NO_CACHE_PAST, a.head_dim), np.float32)
            full |= {n: dummy for n in s2s.input_names(a, "decoder_with_past") if n.startswith("past_key_values.")}
        return self.session.run(names, full)


def _sessions(a: s2s.Arch, where: Path, files: dict[str, Path], optimized: bool) -> dict[str, Any]:
    """The encoder and the two decoders; ``files`` replaces decoders by artifacts, and a ``decoder_merged``
    among them stands for both."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    paths = {k: where / s2s.filename(k) for k in s2s.KINDS} | files
    merged = paths.pop("decoder_merged", None)
    out = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    if merged is not None:
        session = ort.InferenceSession(str(merged), so, providers=["CPUExecutionProvider"])
        out |= {"decoder": _Branch(session, a, False), "decoder_with_past": _Branch(session, a, True)}
    return out


def generation(a: s2s.Arch, where: Path, files: dict[str, Path]) -> dict[str, Any]:
    """The greedy chain through ``files`` (optimized decoders, or a merged one) against the uploads'."""
    encoder_feeds = s2s.seq2seq_feeds(a, "encoder", 2, enc=9, seed=31)
    want_tokens, want = s2s.greedy_chain(a, _sessions(a, where, {}, False), encoder_feeds, STEPS)
    got_tokens, got = s2s.greedy_chain(a, _sessions(a, where, files, True), encoder_feeds, STEPS)
    return {"tokens_same": bool((want_tokens == got_tokens).all()), "logits_max_abs": float(np.max(np.abs(want - got)))}


# ------------------------------------------------------------------------------------------------- rows


def summarize(report: dict[str, Any] | None, res: dict[str, Any], artifact: Path | None) -> dict[str, Any]:
    row: dict[str, Any] = {"rc": res["rc"], "seconds": res["seconds"]}
    if report is None:
        row.update(job="failed", error=res.get("error"))
        return row
    decision = report.get("decision") or {}
    row.update(job=decision.get("result"), reason=decision.get("reason"))
    ver = report.get("verification") or {}
    row["verified"] = ver.get("ok")
    row["max_abs"] = max((o.get("max_abs") or 0.0 for o in ver.get("outputs", [])), default=None)
    passes = report.get("passes", [])
    row["failed_passes"] = {p["name"]: (p.get("reason") or "")[:200] for p in passes if p.get("status") == "failed"}
    row["rolled_back"] = {p["name"]: (p.get("reason") or "")[:200] for p in passes if p.get("status") == "rolled_back"}
    ft = [p for p in passes if p["name"] == "fuse_transformer"]
    if ft:
        notes = ft[-1].get("notes") or {}
        parts = list((notes.get("branches") or {"": notes}).values())  # a merged decoder: one per branch
        row["fuse_transformer"] = {
            "status": ft[-1].get("status"),
            "reason": (ft[-1].get("reason") or "")[:200],
            "expected": sum((p.get("expected") or {}).get("attention", 0) for p in parts),
            "cross_expected": sum(p.get("cross_attention") or 0 for p in parts),
            "missing": [p["missing"] for p in parts if p.get("missing")],
            "family": [p.get("family") for p in parts],
            "non_matches": [m.get("reason") for m in ft[-1].get("non_matches") or []][:3],
        }
    quant = [p for p in passes if p["name"] == "quantize_int4"]
    if quant:
        row["int4"] = f"{quant[-1].get('status')}: {(quant[-1].get('reason') or '')[:160]}"
    if artifact is not None and artifact.exists():
        row["attention"] = attention_split(onnx.load(str(artifact), load_external_data=False))
    return row


def probe(name: str, exporter: str, presets: list[str], out: Path, reuse: bool) -> dict[str, Any]:
    info = build(name, exporter, out, reuse)
    row: dict[str, Any] = {"model": name, "exporter": exporter, "build": info, "presets": {}}
    if not info.get("ok"):
        return row
    a, where = arch(name), Path(info["where"])
    for preset in presets:
        files: dict[str, Path] = {}
        per: dict[str, Any] = {}
        for kind in DECODERS:
            path = where / (s2s.MERGED if kind == "decoder_merged" else s2s.filename(kind))
            res = optimize(path, preset)
            artifact = Path(res["artifact"]) if res.get("artifact") else None
            per[kind] = summarize(res.get("report"), res, artifact)
            if artifact is not None and per[kind]["job"] not in ("failed", None):
                files[kind] = artifact
            print(f"  {name} {exporter} {preset} {kind}: {per[kind].get('job')} {per[kind].get('attention')} "
                  f"({res['seconds']}s)", flush=True)  # fmt: skip
        merged = {"decoder_merged": files.pop("decoder_merged")} if "decoder_merged" in files else None
        for key, chain in (("generation", files), ("generation_merged", merged)):
            if chain is None:
                continue
            try:
                per[key] = generation(a, where, chain)
            except Exception as exc:
                per[key] = {"error": f"{type(exc).__name__}: {_cause(exc)}"[:300]}
        row["presets"][preset] = per
    return row


HEAD = [
    "model",
    "exporter",
    "preset",
    "file",
    "job",
    "exact (report / generation)",
    "self attn",
    "cross attn",
    "fuse_transformer expects attention (cross)",
    "reasons",
]


def _cells(row: dict[str, Any]) -> list[list[str]]:
    name, exporter, info = row["model"], row["exporter"], row["build"]
    if not info.get("ok"):
        return [[name, exporter, "-", "-", "export failed", "", "", "", "", info["error"][:200]]]
    lines = []
    for preset, per in row["presets"].items():
        for kind in DECODERS:
            gen = per.get("generation_merged" if kind == "decoder_merged" else "generation", {})
            if not gen:
                chain = "no chain"
            elif "error" in gen:
                chain = f"**chain failed**: {gen['error'][:120]}"
            else:
                same = "same tokens" if gen["tokens_same"] else "**tokens differ**"
                chain = f"{same}, {gen['logits_max_abs']:.1e}"
            r = per[kind]
            if r["job"] == "failed":
                lines.append([name, exporter, preset, kind, "**failed**", "", "", "", "", (r.get("error") or "")[:200]])
                continue
            att = r.get("attention", {})
            layers = 2 * LAYERS if kind == "decoder_merged" else LAYERS  # both branches of a merged file
            ft = r.get("fuse_transformer") or {}
            reasons = []
            if r["job"] != "optimized":
                reasons.append(f"{r['job']}: {(r.get('reason') or '')[:140]}")
            if ft.get("missing"):
                reasons.append(f"missing {ft['missing']}")
            if ft.get("status") not in (None, "applied"):
                reasons.append(f"fuse_transformer {ft['status']}: {ft.get('reason', '')[:120]}")
            reasons += [f"{k} failed: {v[:120]}" for k, v in r["failed_passes"].items()]
            reasons += [f"{k} rolled back: {v[:120]}" for k, v in r["rolled_back"].items() if k != "quantize_int4"]
            if r.get("int4"):
                reasons.append(f"quantize_int4 {r['int4'][:120]}")
            exact = f"{r.get('verified')} {r.get('max_abs') or 0:.0e}" + (f" / {chain}" if kind != "decoder" else "")
            lines.append(
                [
                    name,
                    exporter,
                    preset,
                    kind,
                    r["job"] or "-",
                    exact,
                    f"{att.get('self', 0)}/{layers}",
                    f"{att.get('cross', 0)}/{layers}",
                    f"{ft.get('expected', '-')} (cross {ft.get('cross_expected', '-')})",
                    "; ".join(reasons),
                ]
            )
    return lines


SUMMARY_HEAD = [
    "model",
    "exporter",
    "fast: jobs (decoder / with past / merged)",
    "fast: self + cross fused",
    "fast: generation (split / merged)",
    "int4: jobs",
    "int4: generation (split / merged)",
]
_SHORT = {"optimized": "opt", "original": "orig", "failed": "**failed**", None: "-"}


def _chain(gen: dict[str, Any] | None) -> str:
    if not gen:
        return "-"
    if "error" in gen:
        return "**failed**"
    return ("same" if gen["tokens_same"] else "**differ**") + f" {gen['logits_max_abs']:.0e}"


def summary_cells(row: dict[str, Any]) -> list[str]:
    """One line per model and exporter: each preset's three jobs, fused attentions against the layers (the
    merged file: both branches), and its two generations."""
    name, exporter = row["model"], row["exporter"]
    if not row["build"].get("ok"):
        return [name, exporter, "export failed: " + row["build"]["error"][:120], "", "", "", ""]
    out = [name, exporter]
    for preset in ("fast", "int4"):
        per = row["presets"].get(preset)
        if per is None:
            out += ["-"] * (3 if preset == "fast" else 2)
            continue
        out.append(" / ".join(_SHORT.get(per[k]["job"], per[k]["job"]) for k in DECODERS))
        if preset == "fast":
            fused = []
            for kind in DECODERS:
                att, n = per[kind].get("attention", {}), 2 * LAYERS if kind == "decoder_merged" else LAYERS
                fused.append(f"{att.get('self', 0)}+{att.get('cross', 0)} of {n}+{n}")
            out.append(" / ".join(fused))
        out.append(f"{_chain(per.get('generation'))} / {_chain(per.get('generation_merged'))}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _heldout.arguments(PROG, __doc__, NAMES, EXPORTERS)
    parser.add_argument("--presets", nargs="+", default=["fast", "int4"])
    parser.add_argument("--reuse", action="store_true", help="keep the exports already in --out")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only:
        for exporter in args.exporters:
            row = probe(name, exporter, args.presets, args.out, args.reuse)
            rows.append(row)
            for cells in _cells(row):
                print("| " + " | ".join(cells) + " |", flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print()
    print(_heldout.table(HEAD, [c for row in rows for c in _cells(row)]))
    print()
    print(_heldout.table(SUMMARY_HEAD, map(summary_cells, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
