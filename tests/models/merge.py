"""Optimum's ``merge_decoders`` (optimum/onnx/graph_transformations.py; optimum is not installable here),
shared by the builders of merged files: tests.models.build_seq2seq (encoder-decoders) and
tests.models.build_decoders (decoder-only ``text-generation-with-past``).

``merge_decoders(decoder, with_past)``: every input of both files plus ``use_cache_branch`` (bool [1]); one
``If`` on it whose then-branch is decoder_with_past and else-branch the decoder; the weights (rank > 1, or
rank 1 and not int32/int64) deduplicated across the two into the outer graph as ``<name>_merged_<n>``, read
by both branches from the outer scope, scalars and 1-D ints kept in each branch; an output the with-past
file lacks becomes an empty constant; the outputs declared with the decoder's shapes. Needs only onnx and
numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import onnx

USE_CACHE = "use_cache_branch"
NO_CACHE_PAST = 1  # the dummy past Optimum's ORT runtime feeds the no-cache branch (it is never read)


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param if d.dim_param else int(d.dim_value) for d in value.type.tensor_type.shape.dim]


def _unify_outputs(decoder: onnx.ModelProto, with_past: onnx.ModelProto) -> None:
    """decoder_with_past's outputs become the decoder's, in its order and with its declared shapes; an output
    it lacks (a cross-attention present) becomes an empty constant: the first dynamic axis 0, the later
    ones 1 (Optimum's ``_unify_onnx_outputs`` with ``strict=False``)."""
    have = {o.name: o for o in with_past.graph.output}
    outputs = []
    for out in decoder.graph.output:
        if out.name not in have:
            dims, first = [], True
            for d in _dims(out):
                dims.append(d if isinstance(d, int) else (0 if first else 1))
                first = first and isinstance(d, int)
            empty = onnx.helper.make_tensor("const_tensor", out.type.tensor_type.elem_type, dims, vals=[])
            with_past.graph.node.append(
                onnx.helper.make_node("Constant", [], [out.name], name=f"Constant_{len(with_past.graph.node) + 1}",
                                      value=empty)
            )  # fmt: skip
        elif have[out.name].type.tensor_type.elem_type != out.type.tensor_type.elem_type:
            raise ValueError(f"{out.name}: the two decoders disagree on its type")
        outputs.append(onnx.helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, _dims(out)))
    if set(have) - {o.name for o in decoder.graph.output}:
        raise ValueError("decoder_with_past has outputs the decoder lacks")
    del with_past.graph.output[:]
    with_past.graph.output.extend(outputs)


def _shared(init: onnx.TensorProto) -> bool:
    """Whether Optimum moves an initializer to the outer graph: weights yes, scalars and 1-D ints (shapes,
    axes) stay in their branch."""
    return len(init.dims) > 1 or (len(init.dims) == 1 and init.data_type not in (onnx.TensorProto.INT32,
                                                                                  onnx.TensorProto.INT64))  # fmt: skip


def _dedupe_initializers(models: Sequence[onnx.ModelProto], suffix: str) -> list[onnx.TensorProto]:
    """The weights of ``models`` as one list for the outer graph, equal ones (same type, dims and bytes) once,
    named ``<one of their names>_<suffix>_<n>``; the nodes reading them are renamed and the moved
    initializers leave their graphs (Optimum's ``_deduplicated_cross_model_initializers``)."""
    groups: dict[tuple[int, tuple[int, ...], str], list[tuple[int, str]]] = {}
    for i, model in enumerate(models):
        for init in model.graph.initializer:
            if _shared(init):
                digest = hashlib.sha512(onnx.numpy_helper.to_array(init).tobytes()).hexdigest()
                groups.setdefault((init.data_type, tuple(init.dims), digest), []).append((i, init.name))
    rename: dict[tuple[int, str], str] = {}
    used: dict[str, int] = {}
    for members in groups.values():
        common = members[0][1]
        used[common] = used.get(common, -1) + 1
        for member in members:
            rename[member] = f"{common}_{suffix}_{used[common]}"
    outer: dict[str, onnx.TensorProto] = {}
    for i, model in enumerate(models):
        for node in model.graph.node:
            for j, name in enumerate(node.input):
                node.input[j] = rename.get((i, name), name)
        keep = []
        for init in model.graph.initializer:
            new = rename.get((i, init.name))
            if new is None:
                keep.append(init)
            elif new not in outer:
                init.name = new
                outer[new] = init
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
    return list(outer.values())


def merge_decoders(decoder: onnx.ModelProto, with_past: onnx.ModelProto, graph_name: str = "merged") -> onnx.ModelProto:
    """decoder_model.onnx + decoder_with_past_model.onnx -> decoder_model_merged.onnx (module docstring);
    the arguments are copied, not changed."""
    decoder, with_past = (
        onnx.ModelProto.FromString(decoder.SerializeToString()),
        onnx.ModelProto.FromString(with_past.SerializeToString()),
    )
    _unify_outputs(decoder, with_past)
    inputs, seen = [], set()
    for model in (decoder, with_past):
        for value in model.graph.input:
            if value.name not in seen:
                seen.add(value.name)
                inputs.append(value)
    outer = _dedupe_initializers([decoder, with_past], graph_name)
    no_past = onnx.helper.make_graph(
        list(decoder.graph.node), "no_past", [], list(decoder.graph.output), list(decoder.graph.initializer)
    )
    past = onnx.helper.make_graph(
        list(with_past.graph.node), "with_past", [], list(with_past.graph.output), list(with_past.graph.initializer)
    )
    flag = onnx.helper.make_tensor_value_info(USE_CACHE, onnx.TensorProto.BOOL, [1])
    node = onnx.helper.make_node(
        "If", [USE_CACHE], [o.name for o in no_past.output], name="optimum::if", then_branch=past, else_branch=no_past
    )
    graph = onnx.helper.make_graph([node], graph_name, [*inputs, flag], list(no_past.output), outer)
    opsets: dict[str, int] = {}
    for model in (decoder, with_past):
        for opset in model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
    merged = onnx.helper.make_model(
        graph, producer_name="optimum-onnx", opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    merged.ir_version = max(decoder.ir_version, with_past.ir_version)
    onnx.checker.check_model(merged)
    return merged
