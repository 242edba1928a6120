"""A sliding-window decoder's cache crop survives `fast` (passes/fusion/_slice_dims.py).

Mistral's exports crop the present cache to the window, ``present[:, :, -(W - 1):]``. ORT's symbolic shape
inference (run inside ``fuse_transformer``) guessed the crop and GroupQueryAttention's present the same
length, and onnxscript's ``collapse_slices`` dropped the crop: the artifact handed back a present one
position longer than the upload's once the cache reached the window, while the job's own input sets stayed
below it and verified. Checked here where the job does not look: caches at and across the window.

The other crop, of the past into attention, ``fuse_gqa`` drops where GroupQueryAttention's
``local_window_size`` makes it redundant (``_gqa_rewrite.rewrite_gqa``): checked at caches below, at and
beyond W - 1, prompts crossing the window, batch 1 and 2. The uploads refuse a past longer than W - 1 (their
mask spans the whole past, their keys the cropped one), so there the reference is the upload on the last
W - 1 positions of that past: what it would itself have kept had it returned that cache.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes.fusion import _slice_dims as slice_dims
from tests.models.build_decoders import OUT
from tests.numerics import reference_session, run_named
from workers.pipeline import PipelineRequest, run_pipeline

MANIFEST = json.loads((OUT / "manifest.json").read_text())
WINDOW = dict(MANIFEST["families"]["mistral"]["extra"])["sliding_window"]


def _fast(name: str, tmp_path) -> onnx.ModelProto:
    settings = PipelineSettings(
        verify_shape_sets=3, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    config = JobConfig(preset="fast", rollback_slower=False, benchmark=False)
    return onnx.load(run_pipeline(PipelineRequest(OUT / f"{name}.onnx", tmp_path / name, config, settings)).model_path)


def _feeds(reference, past: int, new: int, rng, batch: int = 1) -> dict[str, np.ndarray]:
    feeds = {
        "input_ids": rng.integers(0, MANIFEST["families"]["mistral"]["vocab"], (batch, new)).astype(np.int64),
        "attention_mask": np.ones((batch, past + new), np.int64),
        "position_ids": np.repeat(np.arange(past, past + new, dtype=np.int64)[None], batch, axis=0),
    }
    for value in reference.get_inputs():
        if value.name.startswith("past_key_values"):
            heads, size = value.shape[1], value.shape[3]
            feeds[value.name] = rng.standard_normal((batch, heads, past, size)).astype(np.float32)
    return feeds


def _as_the_upload_keeps_it(feeds: dict[str, np.ndarray], new: int) -> dict[str, np.ndarray]:
    """``feeds`` with the past cut to the W - 1 positions the upload keeps (and the mask to match): the
    upload's own answer to a past it refuses at full length. Positions stay: the keys were rotated at theirs."""
    kept = {k: v[:, :, -(WINDOW - 1) :] if k.startswith("past_key_values") else v for k, v in feeds.items()}
    kept["attention_mask"] = np.ones((feeds["attention_mask"].shape[0], WINDOW - 1 + new), np.int64)
    return kept


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_fast_mistral_keeps_the_present_crop_drops_the_past_crop_exact_across_the_window(exporter, tmp_path):
    # setup
    name = f"mistral_past_{exporter}"
    reference = reference_session(OUT / f"{name}.onnx")
    rng = np.random.default_rng(0)
    # execute
    fused = _fast(name, tmp_path)
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])  # ORT_ENABLE_ALL
    # assert: attention fused, every present still cropped, the past crops gone (GQA reads the cache inputs:
    # one Slice per present, 2 per layer, where the upload has 4), and the same outputs at the window's edge
    producers = {out: node for node in fused.graph.node for out in node.output}
    inputs = {i.name for i in fused.graph.input}
    presents = [o.name for o in fused.graph.output if o.name.startswith("present")]
    layers = MANIFEST["families"]["mistral"]["layers"]
    gqas = [n for n in fused.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqas) == layers
    assert {producers[name].op_type for name in presents} == {"Slice"}
    assert sum(n.op_type == "Slice" for n in fused.graph.node) == 2 * layers
    assert all(gqa.input[3] in inputs and gqa.input[4] in inputs for gqa in gqas)
    cases = (
        (0, WINDOW + 6, 1), (WINDOW - 2, 1, 1), (WINDOW - 1, 1, 1), (WINDOW - 1, 1, 2), (WINDOW - 4, 4, 1),
        (WINDOW - 1, 3, 1), (WINDOW // 2, WINDOW, 1), (0, WINDOW + 6, 2), (WINDOW, 1, 1), (2 * WINDOW, 1, 2),
        (WINDOW + 3, 5, 1),
    )  # fmt: skip
    for past, new, batch in cases:
        feeds = _feeds(reference, past, new, rng, batch)
        fed = feeds if past < WINDOW else _as_the_upload_keeps_it(feeds, new)
        want, got = run_named(reference, fed), run_named(session, feeds)
        for key, expected in want.items():
            where = f"{key} past {past} new {new} batch {batch}"
            assert got[key].shape == expected.shape, where
            np.testing.assert_allclose(got[key], expected, rtol=1e-4, atol=1e-5, err_msg=where)


def _graph(starts: list[int], ends: list[int]) -> ir.Model:
    text = f"""
    <ir_version: 10, opset_import: ["" : 18, "com.microsoft" : 1]>
    g (float[B, 2, 63, 8] x) => (float[B, 2, 63, 8] y, float[B, 2, 70, 8] pk) {{
        starts = Constant <value = int64[1] {{{starts[0]}}}> ()
        ends = Constant <value = int64[1] {{{ends[0]}}}> ()
        axes = Constant <value = int64[1] {{2}}> ()
        y = Slice (x, starts, ends, axes)
        q = Constant <value = float[1, 1, 16] {{{", ".join(["0.0"] * 16)}}}> ()
        k = Constant <value = float[1, 1, 16] {{{", ".join(["0.0"] * 16)}}}> ()
        out, pk, pv = com.microsoft.GroupQueryAttention <num_heads = 2, kv_num_heads = 2> (q, k, k, x, x)
    }}
    """
    return ir.from_proto(onnx.parser.parse_model(text))


def test_forget_guesses_makes_a_cut_and_a_present_length_unknown_and_leaves_a_whole_slice():
    # setup
    cut, whole = _graph([-63], [2**63 - 1]), _graph([0], [2**63 - 1])
    # execute
    touched_cut, touched_whole = slice_dims.forget_guesses(cut), slice_dims.forget_guesses(whole)

    # assert
    def dims(model: ir.Model, name: str) -> list:
        value = next(v for v in model.graph.outputs if v.name == name)
        return [d if isinstance(d, int) else d.value for d in value.shape]

    assert dims(cut, "y") == ["B", 2, None, 8] and dims(cut, "pk") == ["B", 2, None, 8]
    assert dims(whole, "y") == ["B", 2, 63, 8] and dims(whole, "pk") == ["B", 2, None, 8]
    assert (touched_cut, touched_whole) == (2, 1)  # pv has no shape to forget


def test_crop_source_is_the_cache_under_a_crop_that_keeps_the_window_and_none_under_a_shorter_one():
    # setup: Slice(x, [start], [end], [2]) of the graph input x
    def crop(start: int, end: int = 2**63 - 1) -> ir.Value:
        model = _graph([start], [end])
        return next(v for v in model.graph.outputs if v.name == "y")

    # execute
    keeps, longer, shorter, bounded = crop(-63), crop(-100), crop(-62), crop(-63, 1000)
    # assert: only a crop to the end keeping at least the W - 1 = 63 positions the window reads
    assert slice_dims.crop_source(keeps, 63).name == "x" and slice_dims.crop_source(longer, 63).name == "x"
    assert slice_dims.crop_source(shorter, 63) is None and slice_dims.crop_source(bounded, 63) is None
