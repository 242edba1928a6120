"""Held-out probe round 2 (issue 17/19): decoder families neither the corpus nor the first decoder probes
(``bench/heldout_dec_nocache.py``, ``bench/heldout_dec_past.py``) have seen, sent as a new user sends them.

Run ``python -m bench.heldout_dec_round2 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``.

Each model of ``MODELS`` comes from a transformers config object (nothing downloaded; 2 layers, hidden 64,
4 heads of 16, 2 key/value heads where the family has GQA, experts cut to 4 of which 2 per token, vocabulary
1024, every parameter perturbed by ``0.02 * randn``) and is built twice by the first round's builders:

* ``nocache``: ``(input_ids, attention_mask) -> logits`` exported TorchScript eager, TorchScript SDPA and
  dynamo, checked against torch on two other shapes with right padding (``heldout_dec_nocache.build``), then
  ``onnxforge optimize --preset fast`` (``_heldout.probe``);
* ``past``: Optimum's ``text-generation-with-past`` signature (``past_key_values.N.key/.value`` in,
  ``present.N.*`` out) exported the same three ways, checked at a prefill and a decode step
  (``heldout_dec_past.build``), then ``fast`` and ``int4``, each artifact replayed against the upload over a
  prefill and 4 decode steps fed its own presents (``heldout_dec_past.summarize``).

An export torch or transformers cannot make is a row with its reason. Rows go to
``bench/out/heldout/dec_round2/<name>.rows.json`` (one file per model, so two subsets can run side by side);
``--table`` prints both markdown tables from the rows recorded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _heldout  # noqa: E402
from bench import heldout_dec_nocache as nocache  # noqa: E402
from bench import heldout_dec_past as past  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round2"
SCRIPT = "bench.heldout_dec_round2"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
PAST_EXPORTERS = {"ts_eager": "ts", "ts_sdpa": "ts_sdpa", "dynamo": "dynamo"}  # heldout_dec_past's names
HIDDEN, FFN, VOCAB, KV_HEADS = 64, 128, 1024, 2
IDS = {"pad_token_id": nocache.PAD, "bos_token_id": nocache.BOS, "eos_token_id": nocache.EOS}
_MOE = {"num_experts_per_tok": 2}
# DeepSeek-style routing (GLM-4 MoE's too): 4 routed experts and a shared one after one dense layer, one group
_GROUPED_MOE = {"n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                "n_group": 1, "topk_group": 1, **_MOE}  # fmt: skip


@dataclass(frozen=True)
class Model:
    name: str
    config: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # over the standard names, both forms
    kv_heads: int = KV_HEADS
    rotary: bool = True
    positions: bool = True  # the forward takes position_ids (ALiBi models do not)
    cache_head_dim: int | None = None  # where the cache's head size is not hidden / heads (MLA)
    note: str = ""

    def spec(self) -> nocache.Spec:
        kwargs = {
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": nocache.LAYERS,
            "num_attention_heads": nocache.HEADS,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": FFN,
            "max_position_embeddings": nocache.POSITIONS,
            "use_cache": False,
            "tie_word_embeddings": False,
            **IDS,
            **self.kwargs,
        }
        return nocache.Spec(self.name, self.config, self.model, kwargs, rotary=self.rotary, note=self.note)

    def probe(self, tiny: bool = False) -> past.Probe:
        """``tiny``: heldout_dec_past's own dims (hidden 32, vocabulary 256), for a regression export of a
        few hundred KB under tests/models/heldout/."""
        extra = {"tie_word_embeddings": False, **IDS, **self.kwargs}
        return past.Probe(
            self.name,
            self.config,
            self.model,
            kv_heads=self.kv_heads,
            rotary=self.rotary,
            positions=self.positions,
            extra=tuple(extra.items()),
            note=self.note,
            hidden=past.HIDDEN if tiny else HIDDEN,
            intermediate=64 if tiny else FFN,
            vocab=past.VOCAB if tiny else VOCAB,
            cache_head_dim=self.cache_head_dim,
        )


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("phi", "PhiConfig", "PhiForCausalLM", note="phi-2: partial rotary 0.5, parallel attention+MLP, biases"),
        Model(
            "gpt_neo",
            "GPTNeoConfig",
            "GPTNeoForCausalLM",
            {"attention_types": [[["global", "local"], 1]], "window_size": 64},
            kv_heads=4,
            rotary=False,
            note="learned positions, unscaled scores, local attention (window 64) on layer 2",
        ),
        Model(
            "gpt_bigcode",
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            {"n_inner": FFN, "multi_query": True},
            kv_heads=1,
            rotary=False,
            note="multi-query (1 kv head), fused qkv, learned positions",
        ),
        Model(
            "codegen",
            "CodeGenConfig",
            "CodeGenForCausalLM",
            {"rotary_dim": 8, "n_inner": FFN, "n_ctx": nocache.POSITIONS},
            kv_heads=4,
            note="interleaved partial rotary (8 of 16), fused qkv in 4 model-parallel groups",
        ),
        Model(
            "mpt",
            "MptConfig",
            "MptForCausalLM",
            {"expansion_ratio": 2, "max_seq_len": nocache.POSITIONS},
            kv_heads=4,
            rotary=False,
            positions=False,
            note="ALiBi, no position_ids, bias-free LayerNorm",
        ),
        Model(
            "xglm",
            "XGLMConfig",
            "XGLMForCausalLM",
            {"ffn_dim": FFN},
            kv_heads=4,
            rotary=False,
            note="sinusoidal positions, scaled embeddings",
        ),
        Model(
            "persimmon", "PersimmonConfig", "PersimmonForCausalLM", kv_heads=4, note="q/k LayerNorm, rotary 0.5, relu2"
        ),
        Model("nemotron", "NemotronConfig", "NemotronForCausalLM", note="LayerNorm1P, partial rotary 0.5, relu2"),
        Model(
            "smollm3",
            "SmolLM3Config",
            "SmolLM3ForCausalLM",
            {"no_rope_layers": [1, 0]},
            note="NoPE on layer 2 (rotary expected 2 of 4)",
        ),
        Model("helium", "HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}, note="Llama-like, head_dim given"),
        Model(
            "glm", "GlmConfig", "GlmForCausalLM", {"head_dim": 16}, note="interleaved rotary on half the head, qkv bias"
        ),
        Model("glm4", "Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}, note="as glm, plus post-attention/MLP norms"),
        Model(
            "exaone4",
            "Exaone4Config",
            "Exaone4ForCausalLM",
            {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
            note="q/k RMSNorm, post-norms, window 64 then global (NoPE on global)",
        ),
        Model("internlm", "LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}, note="Llama with q/k/v/o bias"),
        Model(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM",
            {"num_local_experts": 4, **_MOE},
            note="sparse MoE, 4 experts top-2",
        ),
        Model(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            {"num_experts": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, **_MOE},
            note="MoE 4 experts top-2 + gated shared expert, qkv bias",
        ),
        Model(
            "olmoe",
            "OlmoeConfig",
            "OlmoeForCausalLM",
            {"num_experts": 4, **_MOE},
            note="MoE 4 experts top-2, q/k RMSNorm",
        ),
        Model(
            "deepseek_v3",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            {
                "num_key_value_heads": 4,  # MLA expands its latent to every head (the cache holds 1)
                "q_lora_rank": 48,
                "kv_lora_rank": 8,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 16,
                "v_head_dim": 16,
                **_GROUPED_MOE,
            },
            kv_heads=1,
            cache_head_dim=8,
            note="MLA (q/kv LoRA, interleaved rope on 8 of 24), MoE on layer 2; the cache holds the 1-head latent "
            "(kv_lora_rank) and rotated key (rope dim), both 8 so that one head size feeds them",
        ),
    )
}
# transformers' default experts kernel (grouped_mm) exports with no exporter; "eager" loops over the experts a
# batch routes to (TorchScript bakes the example's routes in, dynamo stops at the data-dependent loop);
# "batched_mm" gathers each token's experts' weights, which both export: the form a user falls back to.
for _name in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3"):
    _m = MODELS[_name]
    MODELS[f"{_name}_bmm"] = replace(
        _m,
        name=f"{_name}_bmm",
        kwargs={**_m.kwargs, "experts_implementation": "batched_mm"},
        note=f"{_m.note}; experts_implementation batched_mm",
    )
SPECS = {name: m.spec() for name, m in MODELS.items()}
PROBES = {name: m.probe() for name, m in MODELS.items()}


def register(models: Iterable[Model]) -> list[str]:
    """Adds a later round's models to this round's registry (its builders, jobs and tables serve both)."""
    names = []
    for m in models:
        MODELS[m.name], SPECS[m.name], PROBES[m.name] = m, m.spec(), m.probe()
        names.append(m.name)
    return names


def nocache_row(name: str, exporter: str, out: Path, reuse: bool, script: str = SCRIPT) -> dict[str, Any]:
    def build(n: str, e: str, o: Path) -> dict[str, Any]:
        return nocache.build(n, e, o, SPECS, script)

    return _heldout.probe(
        name, exporter, out, reuse, version=nocache.BUILDER_VERSION, build=build, counts=nocache._structure
    )


def past_rows(
    name: str,
    exporter: str,
    out: Path,
    reuse: bool,
    presets: list[str],
    *,
    tiny: bool = False,
    script: str = SCRIPT,
) -> tuple[dict, list[dict]]:
    probe = MODELS[name].probe(tiny)
    info = past.build(probe, PAST_EXPORTERS[exporter], reuse, out, script + (" --tiny" if tiny else ""))
    rows = []
    if info["ok"]:
        for preset in presets:
            rows.append(past.summarize(probe, info, preset, past.optimize(Path(info["file"]), preset)))
    return info, rows


def _exporter(row: dict[str, Any]) -> str:
    name = row["exporter"]
    return next((k for k, v in PAST_EXPORTERS.items() if v == name), name)


def _row_key(row: dict[str, Any]) -> tuple[str, str]:
    return _exporter(row), row.get("preset", "")


def tables(out: Path) -> str:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.rows.json"))]
    records.sort(key=lambda r: list(MODELS).index(r["model"]) if r["model"] in MODELS else len(MODELS))
    nc = [row for r in records for row in r["nocache"]]
    builds = [b for r in records for b in r["past_builds"]]
    rows = [row for r in records for row in r["past"]]
    return (
        "Without a cache (`fast`):\n\n"
        + _heldout.table(nocache.HEAD, (nocache._cells(r, SPECS) for r in nc))
        + "\n\nWith a cache (Optimum's signature):\n\n"
        + past.table(rows, builds, PROBES)
    )


COMPACT_HEAD = [
    "model",
    "exporter",
    "no cache: job, exact",
    "attention",
    "rotary",
    "norms (ORT)",
    "cache, fast: job, exact (report / generation)",
    "attention",
    "rotary",
    "int4",
]


def _nocache_cells(row: dict[str, Any] | None) -> list[str]:
    if row is None:
        return ["-", "", "", ""]
    if not row.get("ok"):
        return [("skipped: " if row.get("skipped") else "export failed: ") + row["error"][:90], "", "", ""]
    job, st = row["job"], row["structure"]
    if not job.get("ok"):
        return [f"**failed**: {job['error'][:90]}", "", "", ""]
    spec = SPECS[row["model"]]
    failed = "".join(f"; {f.split(':')[0]} failed" for f in job["failed_passes"])
    return [
        f"{job['decision']}, {job['max_abs']:.0e}" + ("" if job["exact"] else " **not exact**") + failed,
        f"{st.get('attention_after', 0)}/{st['softmax']}",
        f"{st.get('rotary_after', 0)}/{2 * nocache.LAYERS}" if spec.rotary else "-",
        "{}->{}".format(*st.get("session_norms", ("?", "?"))),
    ]


def _past_cells(build: dict[str, Any] | None, fast: dict[str, Any] | None, int4: dict[str, Any] | None) -> list[str]:
    if build is None:
        return ["-", "", "", ""]
    if not build.get("ok"):
        return [f"export failed: {build['error'][:90]}", "", "", ""]
    cells = ["-", "", ""]
    if fast is not None:
        exact = f"{past._fmt(fast.get('max_abs'))} / {past._fmt(fast.get('gen_max_abs'))}"
        if fast.get("gen_error"):
            exact += f" (generation: {fast['gen_error'][:60]})"
        rotary = f"{fast['rotary']}/{2 * past.LAYERS}" if PROBES[fast["family"]].rotary else "-"
        ops = "/".join(k.replace("Attention", "A").replace("GroupQuery", "GQ").replace("MultiHead", "MH")
                       for k in fast["attention_ops"])  # fmt: skip
        cells = [f"{fast['job']}, {fast['decision']}, {exact}", f"{fast['attention']}/{past.LAYERS} {ops}", rotary]
    quant = "-"
    if int4 is not None:
        status = (int4.get("int4") or "").split(":")[0]
        why = next((short for phrase, short in _INT4_WHY if phrase in (int4.get("int4") or "")), "")
        quant = f"{int4['decision']}, {past._fmt(int4.get('gen_max_abs'))}; {status}{why}"
    return [*cells, quant]


_INT4_WHY = (
    ("no MatMul could stay int4", " (no MatMul stays int4 in the budget)"),
    ("budget missed even with all", " (budget missed even all-int8)"),
    ("slower beyond noise", " (slower)"),
    ("verified within tolerance", " (within budget)"),
)


def compact(out: Path) -> str:
    """One row per model and exporter: the no-cache job beside the cached one's fast and int4 jobs."""
    lines = []
    for path in sorted(out.glob("*.rows.json"), key=lambda p: list(MODELS).index(p.name.split(".")[0])):
        record = json.loads(path.read_text())
        for exporter in EXPORTERS:
            nc = next((r for r in record["nocache"] if _exporter(r) == exporter), None)
            build = next((b for b in record["past_builds"] if _exporter(b) == exporter), None)
            rows = {r["preset"]: r for r in record["past"] if _exporter(r) == exporter}
            cells = _past_cells(build, rows.get("fast"), rows.get("int4"))
            lines.append([record["model"], exporter, *_nocache_cells(nc), *cells])
    return _heldout.table(COMPACT_HEAD, lines)


def main(
    argv: list[str] | None = None,
    *,
    names: Iterable[str] | None = None,
    script: str = SCRIPT,
    doc: str | None = __doc__,
    out: Path = OUT,
) -> int:
    """``names``, ``script``, ``doc`` and ``out``: a later round's (its models ``register``-ed first)."""
    parser = _heldout.arguments(f"python -m {script}", doc, list(names) if names else MODELS, EXPORTERS)
    parser.add_argument("--forms", nargs="+", choices=("nocache", "past"), default=["nocache", "past"])
    parser.add_argument(
        "--presets", nargs="*", default=["fast", "int4"], help="for the cached form (none: export only)"
    )
    parser.add_argument("--int4-exporters", nargs="*", default=["ts_eager", "dynamo"], help="int4's exports")
    parser.add_argument("--reuse", action="store_true", help="keep exports and rows already recorded")
    parser.add_argument("--table", action="store_true", help="only print the tables of the rows recorded")
    parser.add_argument("--compact", action="store_true", help="with --table: one row per model and exporter")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--tiny", action="store_true", help="the cached form at hidden 32, vocabulary 256")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table:
        for name in args.only:
            record = args.out / f"{name}.rows.json"
            kept = json.loads(record.read_text()) if record.exists() else {}
            result: dict[str, Any] = {"model": name, "nocache": [], "past_builds": [], "past": []}
            for exporter in args.exporters:
                if "nocache" in args.forms:
                    row = nocache_row(name, exporter, args.out, args.reuse, script)
                    print("| " + " | ".join(nocache._cells(row, SPECS)) + " |", flush=True)
                    result["nocache"].append(row)
                if "past" in args.forms:
                    presets = [p for p in args.presets if p != "int4" or exporter in args.int4_exporters]
                    info, rows = past_rows(name, exporter, args.out, args.reuse, presets, tiny=args.tiny, script=script)
                    result["past_builds"].append(info)
                    result["past"] += rows
                    for row in rows:
                        print("| " + " | ".join(past._cells(row, PROBES)) + " |", flush=True)
                    if not info["ok"]:
                        print(f"| {name} | {exporter} | past export failed: {info['error'][:200]} |", flush=True)
            for key in ("nocache", "past_builds", "past"):  # a partial run keeps the other rows recorded
                fresh = {_row_key(r) for r in result[key]}
                result[key] = [r for r in kept.get(key, []) if _row_key(r) not in fresh] + result[key]
                result[key].sort(key=lambda r: EXPORTERS.index(_exporter(r)))
            record.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    print(compact(args.out) if args.compact else tables(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
