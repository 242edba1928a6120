"""Small BERT-like encoders built with ``onnx.helper`` for the padding_elimination tests.

The graph follows what HF BERT exports look like, at toy sizes (hidden 16, 2 heads)::

    input_ids[B,S] --Gather(word)--+
    token_type_ids --Gather(type)--Add--Add(pos[1,S,H])--LN--> h
    attention_mask[B,S] --Unsqueeze(1,2)--Cast--(1-m)*-1e4 (or finfo.min)--> ext[B,1,1,S]

    per layer:
      h --MatMul+Add(Q,K,V)--Reshape[0,0,heads,dh]--Transpose--> q[B,h,S,dh], kT[B,h,dh,S], v
      q@kT --Div(sqrt dh)--Add(ext)--Softmax(-1)--@v--Transpose--Reshape[0,0,H]--MatMul(Wo)+Add(bo)
      --Add(h)--LN--MatMul+Add--Gelu--MatMul+Add--Add--LN--> h

    last_hidden_state = h[B,S,H]; optional pooled[B,H] (masked mean, unmasked mean or CLS h[:,0]).

Position embeddings are ``Slice(pos_table[1,P,H], 0, S, axis 1)``, so their sequence dim is unknown to
shape inference, as in real exports. Every option changes one exporter habit (LN fused or decomposed,
Gelu op or erf form, extended-mask constant, mask dtype) so that each matcher branch gets exercised.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, HEADS, INTER, VOCAB, MAX_POS, TYPES = 16, 2, 32, 50, 64, 2
PAD_ID = 0


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def init(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, stem: str, *shape: int, scale: float = 0.3) -> str:
        return self.init(stem, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], stem: str | None = None, **attrs) -> str:
        out = self.name(stem or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out}_node", **attrs))
        return out

    def const(self, array, dtype=np.int64) -> str:
        return self.init("c", np.asarray(array, dtype=dtype))

    def layer_norm(self, x: str, decomposed: bool, opset: int) -> str:
        gamma = self.init("ln_g", (1 + 0.1 * self.rng.standard_normal(HIDDEN)).astype(np.float32))
        beta = self.init("ln_b", (0.1 * self.rng.standard_normal(HIDDEN)).astype(np.float32))
        if not decomposed:
            return self.op("LayerNormalization", [x, gamma, beta], "ln", axis=-1, epsilon=1e-12)
        if opset >= 18:
            mean = self.op("ReduceMean", [x, self.const([-1])], "ln_mean")
        else:
            mean = self.op("ReduceMean", [x], "ln_mean", axes=[-1])
        centered = self.op("Sub", [x, mean])
        sq = self.op("Pow", [centered, self.const(2.0, np.float32)])
        if opset >= 18:
            var = self.op("ReduceMean", [sq, self.const([2])], "ln_var")
        else:
            var = self.op("ReduceMean", [sq], "ln_var", axes=[2])
        std = self.op("Sqrt", [self.op("Add", [var, self.const(1e-12, np.float32)])])
        normed = self.op("Div", [centered, std])
        return self.op("Add", [self.op("Mul", [normed, gamma]), beta])

    def dense(self, x: str, n_in: int, n_out: int) -> str:
        y = self.op("MatMul", [x, self.weight("w", n_in, n_out)])
        return self.op("Add", [y, self.weight("b", n_out, scale=0.1)])

    def gelu(self, x: str, form: str) -> str:
        if form == "onnx":
            return self.op("Gelu", [x])
        if form == "ms":
            out = self.name("gelu_ms")
            self.nodes.append(helper.make_node("Gelu", [x], [out], name=f"{out}_node", domain="com.microsoft"))
            return out
        erf = self.op("Erf", [self.op("Div", [x, self.const(np.sqrt(2.0), np.float32)])])
        one_plus = self.op("Add", [erf, self.const(1.0, np.float32)])
        return self.op("Mul", [self.op("Mul", [x, one_plus]), self.const(0.5, np.float32)])


def build_bert(
    *,
    layers: int = 2,
    pooling: str | None = None,
    mask_form: str = "1e4",
    gelu: str = "erf",
    decomposed_ln: bool = False,
    mask_dtype: int = TensorProto.INT64,
    opset: int = 17,
    mask_name: str = "attention_mask",
    seed: int = 0,
) -> onnx.ModelProto:
    """A shape-inferred BERT-like encoder; ``pooling`` adds a ``pooled[B,H]`` output.

    pooling: None, "masked_mean" (sum(h*mask)/sum(mask)), "mean" (ReduceMean over the sequence, unmasked),
    "cls" (Dense+Tanh of Gather(h, 0, axis=1)), "token1" (the same at position 1, which may be padding).
    mask_form: "1e4" ((1-m)*-10000), "finfo" ((1-m)*finfo(float32).min), "where4d" (a [B,1,S,S] Where
    mask over queries and keys, HF's current form) or "none" (attention unmasked).
    gelu: "erf", "onnx" (needs opset 20) or "ms" (com.microsoft Gelu).
    """
    b = _Builder(seed)
    dh = HIDDEN // HEADS
    word = b.op("Gather", [b.weight("word_emb", VOCAB, HIDDEN, scale=1.0), "input_ids"], "word")
    types = b.op("Gather", [b.weight("type_emb", TYPES, HIDDEN, scale=0.5), "token_type_ids"], "types")
    seq = b.op("Slice", [b.op("Shape", ["input_ids"]), b.const([1]), b.const([2])], "seq_len")
    pos = b.op("Slice", [b.weight("pos_emb", 1, MAX_POS, HIDDEN, scale=0.5), b.const([0]), seq, b.const([1])])
    h = b.layer_norm(b.op("Add", [b.op("Add", [word, types]), pos]), decomposed_ln, opset)

    mask_f = b.op("Cast", [b.op("Unsqueeze", [mask_name, b.const([1, 2])])], to=TensorProto.FLOAT)
    neg = -10000.0 if mask_form == "1e4" else float(np.finfo(np.float32).min)
    ext = b.op("Mul", [b.op("Sub", [b.const(1.0, np.float32), mask_f]), b.const(neg, np.float32)], "ext_mask")
    if mask_form == "where4d":  # HF's 4-D form: keys and queries masked, Where(q & k, 0, finfo.min)
        valid = b.op("Cast", [mask_name], to=TensorProto.BOOL)
        both = b.op("And", [b.op("Unsqueeze", [valid, b.const([1, 3])]), b.op("Unsqueeze", [valid, b.const([1, 2])])])
        ext = b.op("Where", [both, b.const(0.0, np.float32), b.const(neg, np.float32)], "ext_mask")

    for _ in range(layers):
        heads = []
        for perm in ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3]):  # q, k transposed, v
            split = b.op("Reshape", [b.dense(h, HIDDEN, HIDDEN), b.const([0, 0, HEADS, dh])], "split")
            heads.append(b.op("Transpose", [split], perm=perm))
        scores = b.op("Div", [b.op("MatMul", heads[:2]), b.const(np.sqrt(dh), np.float32)], "scores")
        masked = scores if mask_form == "none" else b.op("Add", [scores, ext])
        probs = b.op("Softmax", [masked], "probs", axis=-1)
        ctx = b.op("Transpose", [b.op("MatMul", [probs, heads[2]])], perm=[0, 2, 1, 3])
        merged = b.op("Reshape", [ctx, b.const([0, 0, HIDDEN])], "merge")
        h = b.layer_norm(b.op("Add", [b.dense(merged, HIDDEN, HIDDEN), h], "residual"), decomposed_ln, opset)
        ffn = b.dense(b.gelu(b.dense(h, HIDDEN, INTER), gelu), INTER, HIDDEN)
        h = b.layer_norm(b.op("Add", [ffn, h], "residual"), decomposed_ln, opset)

    b.nodes.append(helper.make_node("Identity", [h], ["last_hidden_state"], name="output_identity"))
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]
    if pooling is not None:
        b.nodes.append(helper.make_node("Identity", [_pool(b, pooling, mask_name, opset)], ["pooled"]))
        outputs.append(helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", HIDDEN]))

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info(mask_name, mask_dtype, ["batch", "seq"]),
        helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    graph = helper.make_graph(b.nodes, "bert_like", inputs, outputs, initializer=b.inits)
    opsets = [helper.make_opsetid("", opset)]
    if gelu == "ms":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8 if opset < 19 else 9
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for _ in range(layers if gelu == "ms" else 0):  # ONNX cannot infer contrib ops: give their outputs
        known = {vi.name: vi for vi in model.graph.value_info}  # the input's type, as ORT's tools do
        for node in model.graph.node:
            if node.domain == "com.microsoft" and node.input[0] in known and node.output[0] not in known:
                info = onnx.ValueInfoProto()
                info.CopyFrom(known[node.input[0]])
                info.name = node.output[0]
                model.graph.value_info.append(info)
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    return model


def _pool(b: _Builder, pooling: str, mask_name: str, opset: int) -> str:
    h = "last_hidden_state"
    if pooling == "masked_mean":
        m3 = b.op("Cast", [b.op("Unsqueeze", [mask_name, b.const([2])])], to=TensorProto.FLOAT)
        summed = b.op("ReduceSum", [b.op("Mul", [h, m3]), b.const([1])], keepdims=0)
        count = b.op("Max", [b.op("ReduceSum", [m3, b.const([1])], keepdims=0), b.const(1e-9, np.float32)])
        return b.op("Div", [summed, count])
    if pooling == "mean":
        if opset < 18:
            return b.op("ReduceMean", [h], axes=[1], keepdims=0)
        return b.op("ReduceMean", [h, b.const([1])], keepdims=0)
    if pooling in ("cls", "token1"):
        token = b.op("Gather", [h, b.const(0 if pooling == "cls" else 1)], axis=1)
        return b.op("Tanh", [b.dense(token, HIDDEN, HIDDEN)])
    raise ValueError(pooling)


def make_inputs(
    rng: np.random.Generator,
    lengths: list[int],
    seq: int,
    mask_dtype: type = np.int64,
    *,
    left: bool = False,
    mask_name: str = "attention_mask",
) -> dict[str, np.ndarray]:
    """Right-padded (``left``: left-padded) feeds: row i has ``lengths[i]`` valid tokens; pad ids are PAD_ID."""
    mask = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(mask_dtype)
    if left:
        mask = np.ascontiguousarray(mask[:, ::-1])
    ids = rng.integers(1, VOCAB, size=mask.shape).astype(np.int64)
    ids[mask == 0] = PAD_ID
    types = rng.integers(0, TYPES, size=mask.shape).astype(np.int64)
    return {"input_ids": ids, mask_name: mask, "token_type_ids": types}
