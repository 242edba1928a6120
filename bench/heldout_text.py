"""Held-out probe, text encoders (issue 17): architectures outside the corpus, sent as a new user sends them.

Run ``python -m bench.heldout_text [--only NAME ...] [--exporters E ...] [--reuse]``.

Each model of ``SPECS`` (none of them in ``tests/models/_corpus_specs.py``) comes from a transformers config
object (nothing downloaded; 2 layers, hidden 32, 4 heads, a 384-token vocabulary), every parameter perturbed by
``0.02 * randn`` (the exporters fold equal initializers and drop zero biases), and is exported the three ways of
``tests/models/corpus.py`` (TorchScript opset 17 with eager and with SDPA attention, dynamo opset 18) with
dynamic batch and sequence axes, then checked in ONNX Runtime against torch on two shapes other than the export
example (the last row half padding). A model that cannot be exported is a row of the table with the reason.

Each export then goes through ``onnxforge optimize MODEL --preset fast`` in a child process with the operator
setting ``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1`` (``bench.coverage.run_job``), and the report gives:
job ok (or its error), exact (final verification), the passes applied, attention fused against the upload's
Softmax count, residual norms fused against its norms, GELUs fused, RotaryEmbedding nodes, and the gate's
speedup. Files and ``results.json`` go to ``bench/out/heldout/text/``; a markdown table is printed.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "text"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
ATOL, RTOL = 1e-4, 1e-3
HIDDEN, HEADS, LAYERS, FFN, VOCAB, POSITIONS = 32, 4, 2, 64, 384, 264
PAD, BOS, EOS, LOW = 1, 0, 2, 5
CHECK_SHAPES = ((1, 7), (3, 23))
BUILDER_VERSION = 2


@dataclass(frozen=True)
class Spec:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    inputs: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": POSITIONS,
    "pad_token_id": PAD,
}
_T2 = ("input_ids", "attention_mask")
_T3 = ("input_ids", "attention_mask", "token_type_ids")
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec(
            "modernbert",
            "ModernBertConfig",
            "ModernBertModel",
            _T2,
            {
                **{k: v for k, v in _BERT.items() if k != "max_position_embeddings"},
                "max_position_embeddings": 512,
                "bos_token_id": BOS,
                "eos_token_id": EOS,
                "cls_token_id": BOS,
                "sep_token_id": EOS,
                # one global layer, one local: a window of 8 tokens, shorter than the checked sequences
                "layer_types": ["full_attention", "sliding_attention"],
                "local_attention": 8,
            },
            note="rotary, GeGLU, local/global",
        ),
        Spec("roformer", "RoFormerConfig", "RoFormerModel", _T3, {**_BERT, "embedding_size": HIDDEN}, note="rotary"),
        Spec(
            "mobilebert",
            "MobileBertConfig",
            "MobileBertModel",
            _T3,
            {**_BERT, "embedding_size": 16, "intra_bottleneck_size": 16, "true_hidden_size": 16},
            {"add_pooling_layer": False},
            note="bottlenecks, NoNorm",
        ),
        Spec(
            "funnel",
            "FunnelConfig",
            "FunnelBaseModel",
            _T3,
            {
                "vocab_size": VOCAB,
                "block_sizes": [1, 1],
                "d_model": HIDDEN,
                "n_head": HEADS,
                "d_head": HIDDEN // HEADS,
                "d_inner": FFN,
                "pad_token_id": PAD,
            },
            note="pooled blocks, relative attention",
        ),
        Spec("convbert", "ConvBertConfig", "ConvBertModel", _T3, {**_BERT, "embedding_size": HIDDEN}, note="span conv"),
        Spec(
            "layoutlm",
            "LayoutLMConfig",
            "LayoutLMModel",
            ("input_ids", "bbox", "attention_mask", "token_type_ids"),
            {**_BERT, "max_2d_position_embeddings": 1024},
            note="bbox input",
        ),
        Spec(
            "esm",
            "EsmConfig",
            "EsmModel",
            _T2,
            {
                **_BERT,
                "position_embedding_type": "rotary",
                "mask_token_id": 4,
                "token_dropout": False,
                "emb_layer_norm_before": False,
            },
            {"add_pooling_layer": False},
            note="ESM-2: rotary, pre-norm",
        ),
        Spec("megatron_bert", "MegatronBertConfig", "MegatronBertModel", _T3, _BERT, {"add_pooling_layer": False}),
        Spec("ernie", "ErnieConfig", "ErnieModel", _T3, _BERT, {"add_pooling_layer": False}),
        Spec(
            "squeezebert",
            "SqueezeBertConfig",
            "SqueezeBertModel",
            _T3,
            {**_BERT, "embedding_size": HIDDEN, "q_groups": 2, "k_groups": 2, "v_groups": 2},
            note="grouped Conv1d",
        ),
        Spec(
            "nystromformer",
            "NystromformerConfig",
            "NystromformerModel",
            _T3,
            _BERT,
            note="landmarks == segment length: exact softmax attention",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- build


def feeds(spec: Spec, batch: int, seq: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(LOW, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if pad and seq > 2:
        mask[-1, seq // 2 :] = 0
    for row in range(batch):
        n = int(mask[row].sum())
        ids[row, 0], ids[row, n - 1] = BOS, EOS
        ids[row, n:] = PAD
    out = {"input_ids": ids, "attention_mask": mask}
    types = np.zeros((batch, seq), np.int64)
    types[:, seq // 2 :] = 1
    out["token_type_ids"] = types
    # word boxes on a 0-1000 page: x0 <= x1, y0 <= y1 (LayoutLM embeds the widths and heights too)
    x0 = rng.integers(0, 900, size=(batch, seq))
    y0 = rng.integers(0, 900, size=(batch, seq))
    w = rng.integers(1, 100, size=(batch, seq))
    h = rng.integers(1, 100, size=(batch, seq))
    out["bbox"] = np.stack([x0, y0, x0 + w, y0 + h], axis=-1).astype(np.int64)
    return {k: out[k] for k in spec.inputs}


def _model(spec: Spec, attention: str) -> Any:
    import torch
    import transformers as tf

    config = getattr(tf, spec.config)(**spec.kwargs, attn_implementation=attention)
    torch.manual_seed(0)
    model = getattr(tf, spec.model)(config, **spec.model_kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def _wrapper(spec: Spec, model: Any) -> Any:
    import torch

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def run(self, **kw: Any) -> tuple[Any, ...]:
            return (self.model(**kw, return_dict=True).last_hidden_state,)

    class T2(Base):
        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask)

    class T3(Base):
        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)

    class Boxes(Base):
        def forward(self, input_ids: Any, bbox: Any, attention_mask: Any, token_type_ids: Any) -> tuple[Any, ...]:
            kw = {"input_ids": input_ids, "bbox": bbox, "attention_mask": attention_mask}
            return self.run(**kw, token_type_ids=token_type_ids)

    return {_T2: T2, _T3: T3}.get(spec.inputs, Boxes)().eval()


def _export(wrapper: Any, spec: Spec, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    args = tuple(torch.from_numpy(example[k]) for k in spec.inputs)
    axes: dict[str, dict[int, str]] = {k: {0: "batch", 1: "sequence"} for k in spec.inputs}
    axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(spec.inputs),
                output_names=["last_hidden_state"],
                dynamic_shapes=tuple(axes[k] for k in spec.inputs),
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
            input_names=list(spec.inputs),
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
        )
    return onnx.load(str(path))


def _verify(wrapper: Any, spec: Spec, path: Path) -> tuple[float, float]:
    """The worst abs difference of ORT against torch on the valid tokens (asserted) and on the padded ones
    (recorded: what an implementation leaves at a padded query is its own, e.g. torch's SDPA zeroes a query
    whose every key is masked where a finite additive mask averages them)."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, padded = 0.0, 0.0
    for seed, (batch, seq) in enumerate(CHECK_SHAPES, start=1):
        x = feeds(spec, batch, seq, seed=seed, pad=True)
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(x[k]) for k in spec.inputs))[0].numpy()
        got = session.run(["last_hidden_state"], x)[0]
        if got.shape != want.shape:
            raise AssertionError(f"at {batch}x{seq}: ORT shape {got.shape} != torch {want.shape}")
        valid = x["attention_mask"].astype(bool)
        np.testing.assert_allclose(
            got[valid], want[valid], atol=ATOL, rtol=RTOL, err_msg=f"{path.name} at {batch}x{seq}, valid tokens"
        )
        worst = max(worst, float(np.max(np.abs(got[valid] - want[valid]))))
        if (~valid).any():
            padded = max(padded, float(np.max(np.abs(got[~valid] - want[~valid]))))
    return worst, padded


def build(name: str, exporter: str, out: Path) -> dict[str, Any]:
    spec = SPECS[name]
    path = out / f"{name}_{exporter}.onnx"
    info: dict[str, Any] = {"model": name, "exporter": exporter, "builder_version": BUILDER_VERSION}
    with _heldout.build_record(info, path) as tmp:
        attention = "sdpa" if exporter == "ts_sdpa" else "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = _model(spec, attention)
        except (ValueError, ImportError):
            if exporter != "dynamo":
                raise
            model = _model(spec, "eager")  # the dynamo user falls back to the attention transformers allows
        info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        wrapper = _wrapper(spec, model)
        example = feeds(spec, 2, 16)
        proto = _export(wrapper, spec, exporter, example, tmp)
        _heldout.finish_build(
            info,
            proto,
            tmp,
            path,
            builder=f"bench.heldout_text --only {name} --exporters {exporter}",
            verify=lambda: _verify(wrapper, spec, path),
            keys=("max_abs_vs_torch", "padded_max_abs_vs_torch"),
        )
    return info


# ------------------------------------------------------------------------------------------------- jobs


def _structure(src: Path, dst: Path | None) -> dict[str, Any]:
    return _heldout.structure(
        src, dst, lambda _, ops: {"conv": ops["Conv"]}, lambda _, done: {"rotary_after": done["RotaryEmbedding"]}
    )


def probe(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    return _heldout.probe(name, exporter, out, reuse, version=BUILDER_VERSION, build=build, counts=_structure)


def _notes(row: dict[str, Any]) -> list[str]:
    notes = _heldout.job_notes(row["job"])
    if row["structure"].get("rotary_after"):
        notes.append(f"RotaryEmbedding {row['structure']['rotary_after']}")
    if row.get("padded_max_abs_vs_torch", 0.0) > ATOL:
        notes.append(f"export differs from torch at padded tokens only ({row['padded_max_abs_vs_torch']:.1e})")
    return notes


def _cells(row: dict[str, Any]) -> list[str]:
    return _heldout.fusion_cells(row, _notes)


HEAD = ["model", "exporter", "job", "exact (max abs)", "attention", "skip-norm", "GELU", "speedup; notes"]


def table(rows: list[dict[str, Any]]) -> str:
    return _heldout.table(HEAD, map(_cells, rows))


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_text",
        doc=__doc__,
        specs=SPECS,
        exporters=EXPORTERS,
        out=OUT,
        one=probe,
        cells=_cells,
        head=HEAD,
    )


if __name__ == "__main__":
    sys.exit(main())
