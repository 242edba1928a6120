"""Measurement-only variants of a fused decoder artifact, to price what it still runs that onnxruntime-genai's
builder does not (issue 19's parity A/Bs: ``bench.step_ab`` times and profiles them beside the original).

Run ``python -m bench.decoder_variants MODEL.onnx OUT_DIR [--check]``. Writes, each as ``OUT_DIR/<name>/model.onnx``:

* ``gate_up_split``: every packed projection that feeds one two-way Split of equal halves (the gate/up pair
  ``pack_matmuls`` / ``fuse_transformer``'s ``pack_qkv`` make) as two MatMuls (or two MatMulNBits, rows split with
  their scales and zero points) again, the builder's form. Exact: each output column is the same dot product.
* ``unpacked``: the same for every packed projection, the q/k/v too (Split sizes as they are).
* ``no_present_crop``: the sliding-window crops of the presents (``Slice`` of a GroupQueryAttention present into a
  graph output, Mistral's ``present[:, :, -(W - 1):]``) dropped, GQA's presents renamed to the outputs. **Not
  exact**: at a cache of W - 1 or more positions the presents come out longer than the upload's; below the window
  the crop keeps everything, so it prices the crop's copy there. Never an artifact to serve.

* ``present_crop_if``: the same crops, exact: one ``If`` on the longest present (``Shape`` of each, ``Concat``,
  ``ReduceMax``, ``LessOrEqual`` against what the crop keeps) hands the presents on whole (``Identity``) while no
  present is longer than the crop keeps, else crops them (the ``Slice``s). The candidate for dropping the crop's
  copy below the window, if ORT's ``If`` handed its branch's outputs on without a copy.

``--check`` runs each variant against the original (ORT default level) at a prompt and two cache lengths below any
window and prints the max abs difference of every output (0.0 expected for both below the window).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def split_gate_up(src: Path, dst: Path, every: bool = False) -> int:
    """``gate_up_split`` (module docstring), with ``every`` ``unpacked``; returns how many packed projections
    it split."""
    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type not in ("MatMul", "MatMulNBits") or node.input[1] not in inits:
            continue
        users = readers.get(node.output[0], [])
        if len(users) != 1 or users[0].op_type != "Split" or len(users[0].input) < 2:
            continue
        split = users[0]
        sizes = numpy_helper.to_array(inits[split.input[1]]) if split.input[1] in inits else None
        axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
        if sizes is None or len(sizes) != len(split.output) or axis != -1:
            continue
        if not every and (len(sizes) != 2 or sizes[0] != sizes[1]):
            continue
        if node.op_type == "MatMulNBits" and len(node.input) > 4 and node.input[4]:
            continue  # g_idx is indexed by K, not N
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        made = []
        for j, out in enumerate(split.output):
            lo, hi = bounds[j], bounds[j + 1]
            inputs = [node.input[0]]
            for name in node.input[1:]:
                if not name:
                    inputs.append("")
                    continue
                array = numpy_helper.to_array(inits[name])
                if node.op_type == "MatMul":  # [K, N]: columns
                    part = array[:, lo:hi]
                else:  # MatMulNBits' weight, scales, zero points and bias lead with N (scales may be flat)
                    rows = array.reshape(int(bounds[-1]), -1)[lo:hi]
                    part = rows.reshape(-1) if array.ndim == 1 else rows.reshape((hi - lo, *array.shape[1:]))
                graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(part), f"{name}/part_{j}"))
                inputs.append(f"{name}/part_{j}")
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "MatMulNBits":
                attributes["N"] = int(hi - lo)
            made.append(
                helper.make_node(node.op_type, inputs, [out], f"{node.name}/part_{j}", domain=node.domain, **attributes)
            )
        replaced[id(node)] = made
        dropped.add(id(split))
    order = []
    for node in graph.node:
        if id(node) in replaced:
            order += replaced[id(node)]
        elif id(node) not in dropped:
            order.append(node)
    _write(model, order, dst)
    return len(replaced)


def drop_present_crops(src: Path, dst: Path) -> int:
    """``no_present_crop`` (module docstring, not exact at the window); returns how many crops it dropped."""
    model = onnx.load(str(src))
    graph = model.graph
    outputs = {o.name for o in graph.output}
    producers = {o: n for n in graph.node for o in n.output}
    rename: dict[str, str] = {}
    kept = []
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        crop = node.op_type == "Slice" and node.output[0] in outputs and source is not None
        if crop and source.op_type == "GroupQueryAttention" and node.input[0] in source.output[1:]:
            rename[node.input[0]] = node.output[0]
            continue
        kept.append(node)
    for node in kept:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    _write(model, kept, dst)
    return len(rename)


def conditional_crops(src: Path, dst: Path) -> int:
    """``present_crop_if`` (module docstring): the present crops as one ``If`` that crops only when some present
    is longer than the window keeps, else hands the presents on whole. Exact; returns how many crops it moved."""
    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:  # a crop's bounds may be Constant nodes instead
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            inits[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    outputs = {o.name for o in graph.output}
    producers = {o: n for n in graph.node for o in n.output}
    crops, keeps = [], set()
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        if node.op_type != "Slice" or node.output[0] not in outputs or source is None:
            continue
        if source.op_type != "GroupQueryAttention" or node.input[0] not in source.output[1:]:
            continue
        consts = [inits.get(name) for name in node.input[1:]]
        if any(c is None or c.size != 1 for c in consts) or len(consts) < 3:
            continue
        start, end, axis = (int(c.reshape(-1)[0]) for c in consts[:3])
        step = int(consts[3].reshape(-1)[0]) if len(consts) > 3 else 1
        if start >= 0 or end < 2**31 - 1 or axis != 2 or step != 1:
            continue
        crops.append(node)
        keeps.add(-start)  # a present of at most -start positions passes the crop whole
    if not crops or len(keeps) != 1:
        _save(model, dst)
        return 0
    keep = keeps.pop()
    nodes = [n for n in graph.node if n not in crops]
    lengths = []
    for index, crop in enumerate(crops):
        lengths.append(f"crop_if/length_{index}")
        nodes.append(
            helper.make_node("Shape", [crop.input[0]], [lengths[-1]], f"crop_if/shape_{index}", start=2, end=3)
        )
    graph.initializer.append(numpy_helper.from_array(np.array(keep, np.int64), "crop_if/keep"))
    nodes += [
        helper.make_node("Concat", lengths, ["crop_if/lengths"], "crop_if/concat", axis=0),
        helper.make_node("ReduceMax", ["crop_if/lengths"], ["crop_if/longest"], "crop_if/max", keepdims=0),
        helper.make_node("LessOrEqual", ["crop_if/longest", "crop_if/keep"], ["crop_if/whole"], "crop_if/whole"),
    ]
    infos = {o.name: o for o in graph.output}

    def branch(name: str, make) -> onnx.GraphProto:
        made = [make(c, f"{name}/{c.output[0]}") for c in crops]
        outs = [helper.make_tensor_value_info(m.output[0], infos[c.output[0]].type.tensor_type.elem_type, None)
                for m, c in zip(made, crops, strict=True)]  # fmt: skip
        return helper.make_graph(made, name, [], outs)

    whole = branch("whole", lambda c, out: helper.make_node("Identity", [c.input[0]], [out]))
    cut = branch("cut", lambda c, out: helper.make_node("Slice", list(c.input), [out]))
    nodes.append(
        helper.make_node(
            "If", ["crop_if/whole"], [c.output[0] for c in crops], "crop_if/if", then_branch=whole, else_branch=cut
        )
    )
    _write(model, nodes, dst)
    return len(crops)


def _write(model: onnx.ModelProto, nodes: list[onnx.NodeProto], dst: Path) -> None:
    """``model`` with ``nodes`` as its graph's nodes, the initializers they no longer read dropped, saved at ``dst``."""
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _prune(model.graph)
    _save(model, dst)


def _prune(graph: onnx.GraphProto) -> None:
    used = {i for n in graph.node for i in n.input}
    used |= {i for n in graph.node for a in n.attribute if a.g is not None for m in a.g.node for i in m.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def check(original: Path, variant: Path) -> list[tuple[str, float]]:
    from bench.step_ab import feeds_for, session, vocabulary

    a, b = session(str(original), 1), session(str(variant), 1)
    vocab = vocabulary([str(original), str(variant)])
    worst = []
    for past, tokens in ((0, 7), (128, 1), (300, 3)):
        feeds = feeds_for(a, past, tokens, vocab)
        diff = max(float(np.abs(x - y).max()) for x, y in zip(a.run(None, feeds), b.run(None, feeds), strict=True))
        worst.append((f"{tokens} token(s) after {past}", diff))
    return worst


VARIANTS = {
    "gate_up_split": split_gate_up,
    "unpacked": lambda src, dst: split_gate_up(src, dst, every=True),
    "no_present_crop": drop_present_crops,
    "present_crop_if": conditional_crops,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decoder_variants", description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    for name, make in VARIANTS.items():
        path = args.out / name / "model.onnx"
        count = make(args.model, path)
        print(f"{name}: {count} rewritten -> {path}")
        if args.check and count:
            print("  max abs diff vs the original: " + ", ".join(f"{w} {d:.1e}" for w, d in check(args.model, path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
