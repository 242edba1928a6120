"""``_concat_shape``: the shape of a Concat read from its inputs' shapes (the T5 TorchScript decoder's key
length, ``Shape(Concat(past_key, key))[2]``, which made onnxscript's with-past MHA rule build a cycle).

Graphs are written in ONNX text; every rewrite is compared with the original under ORT with graph
optimizations off, at several shapes, an empty past among them."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.fusion._concat_shape import split_concat_shapes
from tests.passes._util import checked, parse, session

_CACHE = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[a0, a1, a2, a3] past, float[b0, b1, b2, b3] new) => (int64[{n}] out, float[c0, c1, c2, c3] joined) {{
    joined = Concat <axis = {axis}> (past, new)
    shape = Shape {attrs} (joined)
    out = Identity (shape)
}}
"""


def _cache(axis: int = -2, attrs: str = "", n: str = "N", opset: int = 18) -> ir.Model:
    return ir.serde.deserialize_model(parse(_CACHE.format(axis=axis, attrs=attrs, n=n, opset=opset), check=False))


def _feeds(axis: int, batch: int, past: int, new: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Two tensors [batch, 4, ., 8] of the lengths past and new on ``axis`` (and equal elsewhere, as the
    Concat's schema requires; ORT also runs an input empty on another axis, by skipping it)."""
    rng = np.random.default_rng(seed)
    shapes = []
    for length in (past, new):
        shape = [batch, 4, 6, 8]
        shape[axis] = length
        shapes.append(shape)
    return {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in zip(("past", "new"), shapes, strict=True)
    }


SHAPES = ((1, 0, 3), (2, 5, 1), (3, 7, 2), (1, 1, 0))  # (batch, past, new): an empty past, an empty new


def _assert_same(original: ir.Model, rewritten: ir.Model, axis: int) -> None:
    want, got = session(original), session(ir.serde.deserialize_model(checked(rewritten)))
    for batch, past, new in SHAPES:
        feeds = _feeds(axis, batch, past, new, seed=past)
        for a, b in zip(want.run(None, feeds), got.run(None, feeds), strict=True):
            np.testing.assert_array_equal(b, a, err_msg=f"batch {batch}, past {past}, new {new}")


def _shape_readers_of_concat(model: ir.Model) -> int:
    readers = [n for n in model.graph if n.op_type == "Shape" and n.inputs[0].producer() is not None]
    return sum(1 for n in readers if n.inputs[0].producer().op_type == "Concat")


@pytest.mark.parametrize(
    ("axis", "attrs", "n"),
    [
        (-2, "", "4"),  # the whole shape
        (2, "<start = 2, end = 3>", "1"),  # the concatenated dim alone
        (-2, "<start = -3>", "3"),  # from a negative start, across the axis
        (2, "<end = 2>", "2"),  # before the axis only: no sum at all
        (2, "<start = 3>", "1"),  # after it only
        (0, "", "4"),  # the batch axis: no leading piece
        (3, "<start = 1>", "3"),  # the last axis: no trailing piece
    ],
)
def test_shape_of_a_concat_is_read_from_its_inputs_and_exact_when_sliced_or_not(axis, attrs, n):
    # setup
    original = _cache(axis, attrs, n)
    model = _cache(axis, attrs, n)
    # execute
    count = split_concat_shapes(model)
    # assert: no Shape reads the Concat any more; the same numbers at every shape
    assert count == 1 and _shape_readers_of_concat(model) == 0
    _assert_same(original, model, axis)


def test_the_new_length_is_read_above_the_head_split_and_transpose_when_symbols_prove_it():
    """The T5 form: the new key's length comes from the projection, not from the head split's output, which
    onnxscript's with-past rule must be free to absorb."""
    text = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[B, H, P, 8] past, float[B, S, 32] k) => (int64 len, float[B, H, T, 8] joined) {
        target = Constant <value = int64[4] {0, 0, 4, 8}> ()
        split = Reshape (k, target)
        heads = Transpose <perm = [0, 2, 1, 3]> (split)
        joined = Concat <axis = 2> (past, heads)
        shape = Shape (joined)
        two = Constant <value = int64 {2}> ()
        len = Gather <axis = 0> (shape, two)
    }
    """
    original = ir.serde.deserialize_model(parse(text, check=False))
    model = ir.serde.deserialize_model(parse(text, check=False))
    split = next(n for n in model.graph if n.op_type == "Reshape")
    split.outputs[0].shape = ir.Shape(["B", "S", 4, 8])  # as the symbolic shapes fuse_transformer runs give it
    # execute
    assert split_concat_shapes(model) == 1
    # assert: the new length is Shape(k)[1]; the transposed and split key feed only the Concat
    readers = {n.inputs[0].name for n in model.graph if n.op_type == "Shape"}
    assert readers == {"past", "k"}
    heads = next(n for n in model.graph if n.op_type == "Transpose").outputs[0]
    assert [u.node.op_type for u in heads.uses()] == ["Concat"]
    want, got = session(original), session(ir.serde.deserialize_model(checked(model)))
    rng = np.random.default_rng(1)
    for batch, past, new in SHAPES:
        feeds = {
            "past": rng.standard_normal((batch, 4, past, 8)).astype(np.float32),
            "k": rng.standard_normal((batch, new, 32)).astype(np.float32),
        }
        for a, b in zip(want.run(None, feeds), got.run(None, feeds), strict=True):
            np.testing.assert_array_equal(b, a)


def test_a_reshape_is_not_looked_through_when_its_output_dim_has_no_single_source():
    # setup: the split's sequence dim is unknown (no symbol): reading it above the Reshape proves nothing
    text = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[B, H, P, 8] past, float[B, S, 32] k) => (int64[4] out, float[B, H, T, 8] joined) {
        target = Constant <value = int64[4] {0, -1, 4, 8}> ()
        split = Reshape (k, target)
        heads = Transpose <perm = [0, 2, 1, 3]> (split)
        joined = Concat <axis = 2> (past, heads)
        shape = Shape (joined)
        out = Identity (shape)
    }
    """
    model = ir.serde.deserialize_model(parse(text, check=False))
    assert split_concat_shapes(model) == 1
    readers = {n.inputs[0].name for n in model.graph if n.op_type == "Shape"}
    assert readers == {"past", "split"}  # through the Transpose (a permutation), not the Reshape


def test_shape_of_a_concat_is_left_when_opset_has_no_shape_slices_or_rank_unknown():
    # setup: opset 14 (Shape without start/end); and a Concat whose inputs have no shapes
    old = _cache(opset=14)
    unknown = _cache()
    for value in unknown.graph.inputs:
        value.shape = None
    unknown.graph.outputs[1].shape = None
    # execute / assert
    assert split_concat_shapes(old) == 0 and _shape_readers_of_concat(old) == 1
    assert split_concat_shapes(unknown) == 0 and _shape_readers_of_concat(unknown) == 1
