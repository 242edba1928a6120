"""Pre/post-processing steps of the ``prepost`` pass, on onnxruntime-extensions' ``PrePostProcessor``.

This module imports ``onnxruntime_extensions`` at import time (its steps are subclasses of the library's
``Step``); ``passes/prepost/prepost.py`` imports it only inside the pass, so the extension library stays a
dependency of that one pass.

The library ships the image steps used as they are (``ConvertImageToBGR``, ``ReverseAxis``, ``Resize``,
``CenterCrop``, ``ChannelsLastToChannelsFirst``, ``ImageBytesToFloat``, ``Normalize``, ``Unsqueeze``,
``Softmax``, ``ArgMax``). Added here:

* ``TextTokenizer``: the graph ``gen_processing_models`` builds from a Hugging Face tokenizer, reshaped to
  ``[1, n]``, cast to the model's id dtype, optionally truncated (first ``max_length - 1`` tokens and the
  last one, i.e. the end token, as ``truncation=True`` does), with an all-ones mask and zero token types
  when the tokenizer op does not output them.
* ``MaskedMeanPool``: sentence-transformers' mean pooling, ``sum(h * m) / max(sum(m), 1e-9)`` over the
  sequence axis, the mask coming from the tokenizer step.
* ``L2Normalize``: ``x / max(||x||_2, 1e-12)`` over the last axis (``torch.nn.functional.normalize``).
* ``TopK``: values and indices of the ``k`` largest entries of the last axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime_extensions.tools.pre_post_processing import Step

_ID_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _const(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def tokenizer_graph(
    tokenizer_model: onnx.ModelProto,
    input_name: str,
    outputs: dict[str, str],
    *,
    dtypes: dict[str, int],
    max_length: int | None,
    graph_name: str = "text_tokenizer",
) -> onnx.GraphProto:
    """A graph ``string[1] input_name -> {output: int[1, n]}``.

    ``tokenizer_model`` is what ``gen_processing_models(tokenizer, pre_kwargs={})`` returns (one custom
    tokenizer node); ``outputs`` maps each wanted role (``input_ids``, ``attention_mask``,
    ``token_type_ids``) to the graph output name, ``dtypes`` the role to its ONNX element type.
    """
    src = tokenizer_model.graph
    (tok_input,) = [i.name for i in src.input if i.name not in {init.name for init in src.initializer}]
    nodes: list[onnx.NodeProto] = []
    initializers = [onnx.TensorProto() for _ in src.initializer]
    for mine, theirs in zip(initializers, src.initializer, strict=True):
        mine.CopyFrom(theirs)
        mine.name = f"tok/{theirs.name}"
    renames = {tok_input: input_name, **{init.name: f"tok/{init.name}" for init in src.initializer}}
    produced: dict[str, str] = {}
    for node in src.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.ClearField("input")
        copy.input.extend(renames.get(i, f"tok/{i}") if i else "" for i in node.input)
        copy.ClearField("output")
        copy.output.extend(f"tok/{o}" if o else "" for o in node.output)
        if copy.domain == "ai.onnx.contrib":
            # The library registers its ops in both domains; PrePostProcessor's checker knows only this one.
            copy.domain = "com.microsoft.extensions"
        nodes.append(copy)
    for out in src.output:
        for role in _ID_OUTPUTS:
            if out.name == role or out.name.endswith(role):
                produced.setdefault(role, f"tok/{out.name}")
    if "input_ids" not in produced:
        raise ValueError(f"the tokenizer graph has no input_ids output (outputs: {[o.name for o in src.output]})")
    nodes.append(_const("tok/shape_1n", np.array([1, -1], np.int64)))
    flat: dict[str, str] = {}
    for role, name in produced.items():
        nodes.append(helper.make_node("Reshape", [name, "tok/shape_1n"], [f"tok/{role}_2d"]))
        nodes.append(helper.make_node("Cast", [f"tok/{role}_2d"], [f"tok/{role}_i64"], to=TensorProto.INT64))
        flat[role] = f"tok/{role}_i64"
    ids = flat["input_ids"]
    if "attention_mask" not in flat:
        nodes.append(helper.make_node("Shape", [ids], ["tok/ids_shape"]))
        nodes.append(_const("tok/one", np.array(1, np.int64)))
        nodes.append(helper.make_node("Expand", ["tok/one", "tok/ids_shape"], ["tok/mask_ones"]))
        flat["attention_mask"] = "tok/mask_ones"
    if "token_type_ids" not in flat:
        nodes.append(helper.make_node("Sub", [ids, ids], ["tok/types_zero"]))
        flat["token_type_ids"] = "tok/types_zero"
    if max_length is not None:
        # Branch-free truncation: indices = [0 .. min(n, L) - 2] + [n - 1] keeps everything when n <= L and
        # otherwise the first L - 1 tokens and the last (end) token, which is what `truncation=True` gives.
        nodes += [
            helper.make_node("Shape", [ids], ["tok/n_1"], start=1, end=2),
            _const("tok/zero_axes", np.array([0], np.int64)),
            helper.make_node("Squeeze", ["tok/n_1", "tok/zero_axes"], ["tok/n"]),
            _const("tok/max_length", np.array(max_length, np.int64)),
            helper.make_node("Min", ["tok/n", "tok/max_length"], ["tok/kept"]),
            _const("tok/c0", np.array(0, np.int64)),
            _const("tok/c1", np.array(1, np.int64)),
            helper.make_node("Sub", ["tok/kept", "tok/c1"], ["tok/head_len"]),
            helper.make_node("Range", ["tok/c0", "tok/head_len", "tok/c1"], ["tok/head"]),
            helper.make_node("Sub", ["tok/n", "tok/c1"], ["tok/last"]),
            helper.make_node("Unsqueeze", ["tok/last", "tok/zero_axes"], ["tok/last_1"]),
            helper.make_node("Concat", ["tok/head", "tok/last_1"], ["tok/keep"], axis=0),
        ]
        for role in list(flat):
            nodes.append(helper.make_node("Gather", [flat[role], "tok/keep"], [f"tok/{role}_cut"], axis=1))
            flat[role] = f"tok/{role}_cut"
    graph_outputs = []
    for role, out_name in outputs.items():
        nodes.append(helper.make_node("Cast", [flat[role]], [out_name], to=dtypes[role]))
        graph_outputs.append(helper.make_tensor_value_info(out_name, dtypes[role], [1, f"{graph_name}_n"]))
    return helper.make_graph(
        nodes,
        graph_name,
        [helper.make_tensor_value_info(input_name, TensorProto.STRING, [1])],
        graph_outputs,
        initializer=initializers,
    )


class TextTokenizer(Step):
    """``string[1] text`` -> the model's id inputs, in the order given (the pass joins them by position)."""

    def __init__(
        self,
        tokenizer_model: onnx.ModelProto,
        roles: list[str],
        dtypes: dict[str, int],
        max_length: int | None,
        name: str = "TextTokenizer",
    ) -> None:
        super().__init__(["text"], list(roles), name)
        self._roles = list(roles)
        self._tokenizer_model = tokenizer_model
        self._dtypes = dtypes
        self._max_length = max_length

    def _create_graph_for_step(self, graph: onnx.GraphProto, onnx_opset: int) -> onnx.GraphProto:
        outputs = dict(zip(self._roles, self.output_names, strict=True))
        return tokenizer_graph(
            self._tokenizer_model,
            self.input_names[0],
            outputs,
            dtypes=self._dtypes,
            max_length=self._max_length,
            graph_name=f"text_tokenizer_{self.step_num}",
        )


class _SimpleStep(Step):
    """A step whose graph is a list of nodes from named inputs to named outputs."""

    out_rank_delta = 0  # output rank minus the first input's rank

    def _nodes(self, elem_type: int) -> list[onnx.NodeProto]:
        raise NotImplementedError

    def _out_types(self, elem_type: int) -> list[int]:
        return [elem_type] * len(self.output_names)

    def _create_graph_for_step(self, graph: onnx.GraphProto, onnx_opset: int) -> onnx.GraphProto:
        types = _value_types(graph)
        inputs = []
        for n in self.input_names:
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(types[n])
            inputs.append(vi)
        first = types[self.input_names[0]].type.tensor_type
        elem_type, rank = first.elem_type, len(first.shape.dim)
        out_rank = rank + self.out_rank_delta
        outputs = [
            helper.make_tensor_value_info(n, t, [f"{self.name}_{self.step_num}_{n}_{i}" for i in range(out_rank)])
            for n, t in zip(self.output_names, self._out_types(elem_type), strict=True)
        ]
        return helper.make_graph(self._nodes(elem_type), f"{self.name}_{self.step_num}", inputs, outputs)


def _value_types(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    return {vi.name: vi for vi in [*graph.input, *graph.output, *graph.value_info] if vi.type.HasField("tensor_type")}


class MaskedMeanPool(_SimpleStep):
    """``hidden[b, s, h]``, ``mask[b, s]`` -> ``sum(hidden * mask) / max(sum(mask), 1e-9)`` over ``s``."""

    def __init__(self, name: str = "MaskedMeanPool") -> None:
        super().__init__(["hidden", "mask"], ["embedding"], name)

    out_rank_delta = -1

    def _nodes(self, elem_type: int) -> list[onnx.NodeProto]:
        h, m = self.input_names
        p = f"pool{self.step_num}"
        return [
            helper.make_node("CastLike", [m, h], [f"{p}_m"]),
            _const(f"{p}_axis_last", np.array([-1], np.int64)),
            _const(f"{p}_axis_seq", np.array([1], np.int64)),
            helper.make_node("Unsqueeze", [f"{p}_m", f"{p}_axis_last"], [f"{p}_m3"]),
            helper.make_node("Mul", [h, f"{p}_m3"], [f"{p}_masked"]),
            helper.make_node("ReduceSum", [f"{p}_masked", f"{p}_axis_seq"], [f"{p}_sum"], keepdims=0),
            helper.make_node("ReduceSum", [f"{p}_m3", f"{p}_axis_seq"], [f"{p}_count"], keepdims=0),
            _const(f"{p}_eps_f", np.array(1e-9, np.float32)),
            helper.make_node("CastLike", [f"{p}_eps_f", h], [f"{p}_eps"]),
            helper.make_node("Max", [f"{p}_count", f"{p}_eps"], [f"{p}_den"]),
            helper.make_node("Div", [f"{p}_sum", f"{p}_den"], [self.output_names[0]]),
        ]


class L2Normalize(_SimpleStep):
    """``x / max(||x||_2, 1e-12)`` over the last axis."""

    def __init__(self, name: str = "L2Normalize") -> None:
        super().__init__(["data"], ["embedding"], name)

    def _nodes(self, elem_type: int) -> list[onnx.NodeProto]:
        (x,) = self.input_names
        p = f"l2n{self.step_num}"
        return [
            _const(f"{p}_axis", np.array([-1], np.int64)),
            helper.make_node("ReduceL2", [x, f"{p}_axis"], [f"{p}_norm"], keepdims=1),
            _const(f"{p}_eps_f", np.array(1e-12, np.float32)),
            helper.make_node("CastLike", [f"{p}_eps_f", x], [f"{p}_eps"]),
            helper.make_node("Max", [f"{p}_norm", f"{p}_eps"], [f"{p}_den"]),
            helper.make_node("Div", [x, f"{p}_den"], [self.output_names[0]]),
        ]


class TopK(_SimpleStep):
    """The ``k`` largest entries of the last axis: ``topk_values``, ``topk_indices`` (int64)."""

    def __init__(self, k: int, name: str = "TopK") -> None:
        super().__init__(["data"], ["topk_values", "topk_indices"], name)
        self._k = k

    def _out_types(self, elem_type: int) -> list[int]:
        return [elem_type, TensorProto.INT64]

    def _nodes(self, elem_type: int) -> list[onnx.NodeProto]:
        (x,) = self.input_names
        p = f"topk{self.step_num}"
        return [
            _const(f"{p}_k", np.array([self._k], np.int64)),
            helper.make_node("TopK", [x, f"{p}_k"], list(self.output_names), axis=-1, largest=1, sorted=1),
        ]


def ort_steps() -> Any:
    """The library's step classes (a module), for the pass to build the pipeline from."""
    from onnxruntime_extensions.tools.pre_post_processing import steps

    return steps
