"""GPT-1's attention fuses: a causal mask applied by multiplying, and sizes TorchScript reads off attention.

GPT-1 (``OpenAIGPTModel``) masks with ``w * b + -1e4 * (1 - b)``, ``b`` the 0/1 lower triangle sliced to the
scores' size; onnxscript's SDPA rule reads an additive mask only, so neither export fused (0/2). ``_where_mask``'s
``MultipliedMask`` makes it ``w + -1e4 * (1 - b)``. The TorchScript export also slices ``b`` by ``w.size(-1)`` and
merges the heads by ``x.size(-2) * x.size(-1)`` of the transposed context: ``Shape`` readers of tensors the fused
patterns replace, so onnxscript refused those matches too; ``_attention_shapes`` reads each size where it was
made. Exports: ``python -m tests.models.build_heldout_probe heldout_round12 openai_gpt`` (2 layers, hidden 32,
4 heads, 64 positions), compared with the export under ORT (optimizations off) at other batches and lengths.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion import _where_mask
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

HELDOUT = MODELS / "heldout"


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_gpt1_causal_mask_applied_by_multiplying_fuses_exactly(exporter):
    path = HELDOUT / f"openai_gpt_{exporter}.onnx"
    result = FuseTransformer({})(ir.load(path), PassContext())
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == 2 and "Softmax" not in ops
    assert "attention" not in (result.notes.get("missing") or {})
    onnxscript = result.notes["candidates"]["onnxscript"]
    assert onnxscript["where_masks"] == 2
    if exporter == "ts":  # the mask's slice and the heads' merge read their sizes elsewhere now
        assert onnxscript["attention_shapes"] >= 4
    reference, fused = session(path), session(result.model)
    rng = np.random.default_rng(5)
    for batch, seq in ((1, 5), (3, 41)):
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq - 2 :] = 0
        feeds = {"input_ids": rng.integers(0, 256, (batch, seq)).astype(np.int64), "attention_mask": mask}
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}")


def _multiplied(keep: str, fill: str) -> onnx.ModelProto:
    """``Softmax(s * b + (1 - b) * fill)`` with scores ``s = q @ k^T / 2`` and the constant ``b`` given."""
    return parse(
        f"""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[1, 2, 4, 8] q, float[1, 2, 8, 4] kt) => (float[1, 2, 4, 4] p) {{
          b = Constant <value = float[1, 1, 4, 4] {{{keep}}}> ()
          one = Constant <value = float {{1.0}}> ()
          two = Constant <value = float {{2.0}}> ()
          fill = Constant <value = float {{{fill}}}> ()
          raw = MatMul (q, kt)
          s = Div (raw, two)
          kept = Mul (s, b)
          dropped = Sub (one, b)
          masked = Mul (dropped, fill)
          w = Add (kept, masked)
          p = Softmax <axis = -1> (w)
        }}
        """
    )


CAUSAL = ", ".join(str(float(j <= i)) for i in range(4) for j in range(4))
HALVES = ", ".join(str(0.5 * float(j <= i)) for i in range(4) for j in range(4))


def _rewritten(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)
    return model, _where_mask.apply(model)


def test_a_multiplied_causal_mask_is_the_additive_one_and_exact():
    proto = _multiplied(CAUSAL, "-10000.0")
    model, applied = _rewritten(proto)
    assert applied == 1
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    add = softmax.inputs[0].producer()
    assert add.op_type == "Add" and any(i.producer() is not None and i.producer().op_type == "Div" for i in add.inputs)
    reference, rewritten = session(ir.serde.deserialize_model(proto)), session(model)
    rng = np.random.default_rng(6)
    for _ in range(3):
        feeds = {
            "q": rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
            "kt": rng.standard_normal((1, 2, 8, 4)).astype(np.float32),
        }
        np.testing.assert_array_equal(rewritten.run(None, feeds)[0], reference.run(None, feeds)[0])


@pytest.mark.parametrize(
    ("keep", "fill"), [(HALVES, "-10000.0"), (CAUSAL, "-1.0")], ids=["mask-not-0-or-1", "fill-not-masking"]
)
def test_a_product_that_is_not_a_mask_stays(keep, fill):
    model, applied = _rewritten(_multiplied(keep, fill))
    assert applied == 0
    assert [n.op_type for n in model.graph].count("Mul") == 2
