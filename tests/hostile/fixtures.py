"""Builders of hostile models and archives (security.md T1-T11), written byte by byte where onnx's own
helpers would refuse to (external data in odd places, nesting deeper than protobuf parses).

Every builder writes plain protobuf bytes (``SerializeToString``): nothing here goes through
``onnx.save``'s external-data machinery, so the fixtures carry exactly the fields the test puts in them.
"""

from __future__ import annotations

import io
import random
import struct
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
SEED_MODEL = ROOT / "tests" / "models" / "mlp_cleanup.onnx"
OPSET = [helper.make_opsetid("", 17)]
FLOAT = TensorProto.FLOAT


def _vi(name: str, dims: Sequence[int | str | None], elem: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(dims))


def model_of(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    **kwargs: object,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=kwargs.pop("opset_imports", OPSET), **kwargs)
    model.ir_version = 8
    return model


def write(model: onnx.ModelProto | bytes, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


# ------------------------------------------------------------------------------------- external data


def external_tensor(
    name: str,
    dims: Sequence[int],
    entries: Sequence[tuple[str, str]],
    data_type: int = FLOAT,
) -> onnx.TensorProto:
    t = TensorProto(name=name, data_type=data_type, data_location=TensorProto.EXTERNAL)
    t.dims.extend(dims)
    for key, value in entries:
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def matmul_model(weight: onnx.TensorProto) -> onnx.ModelProto:
    """y = x @ W with W [16, 8] (the external-data fixtures swap W for something hostile)."""
    return model_of(
        [helper.make_node("MatMul", ["x", weight.name], ["y"], name="mm")],
        [_vi("x", ["batch", 16])],
        [_vi("y", ["batch", 8])],
        [weight],
    )


def good_weights() -> np.ndarray:
    return (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) - 64) / 100


def external_model_dir(
    directory: Path,
    *,
    location: str = "w.bin",
    entries: Sequence[tuple[str, str]] | None = None,
    dims: Sequence[int] = (16, 8),
    write_data: bool = True,
) -> Path:
    """``directory/model.onnx`` whose W lives in ``location`` (written beside it unless told not to)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = good_weights().tobytes()
    if write_data:
        (directory / "w.bin").write_bytes(data)
    if entries is None:
        entries = [("location", location), ("offset", "0"), ("length", str(len(data)))]
    return write(matmul_model(external_tensor("W", dims, entries)), directory / "model.onnx")


def _constant_with(tensor: onnx.TensorProto, out: str = "y", attr: str = "value") -> onnx.NodeProto:
    node = helper.make_node("Constant", [], [out], name="const")
    a = node.attribute.add()
    a.name = attr
    if attr == "sparse_value":
        a.type = onnx.AttributeProto.SPARSE_TENSOR
        a.sparse_tensor.CopyFrom(tensor)  # type: ignore[arg-type]
    else:
        a.type = onnx.AttributeProto.TENSOR
        a.t.CopyFrom(tensor)
    return node


def _w_entries(location: str = "w.bin") -> list[tuple[str, str]]:
    return [("location", location), ("offset", "0"), ("length", "512")]


def t3_models() -> dict[str, onnx.ModelProto]:
    """External data everywhere but the main graph's initializers (each must be refused)."""
    ext = external_tensor("W", (16, 8), _w_entries())
    out = [_vi("y", [16, 8])]
    constant = model_of([_constant_with(ext)], [], out)

    sparse = onnx.SparseTensorProto()
    sparse.values.CopyFrom(external_tensor("sv", (4,), [("location", "w.bin"), ("offset", "0"), ("length", "16")]))
    sparse.indices.CopyFrom(numpy_helper.from_array(np.array([0, 1, 2, 3], np.int64), "si"))
    sparse.dims.extend([16, 8])
    sparse_const = model_of([_constant_with(sparse, attr="sparse_value")], [], out)  # type: ignore[arg-type]
    sparse_init = model_of([helper.make_node("Identity", ["sv"], ["y"])], [], out)
    sparse_init.graph.sparse_initializer.add().CopyFrom(sparse)

    sparse_idx = onnx.SparseTensorProto()
    sparse_idx.values.CopyFrom(numpy_helper.from_array(np.ones(4, np.float32), "sv2"))
    sparse_idx.indices.CopyFrom(
        external_tensor("si2", (4,), [("location", "w.bin"), ("offset", "0"), ("length", "32")], TensorProto.INT64)
    )
    sparse_idx.dims.extend([16, 8])
    sparse_indices = model_of([helper.make_node("Identity", ["sv2"], ["y"])], [], out)
    sparse_indices.graph.sparse_initializer.add().CopyFrom(sparse_idx)

    branch = helper.make_graph([helper.make_node("Identity", ["W"], ["yb"])], "then", [], [_vi("yb", [16, 8])])
    branch.initializer.add().CopyFrom(ext)
    plain = helper.make_graph(
        [helper.make_node("Constant", [], ["ye"], value=numpy_helper.from_array(good_weights()))],
        "else",
        [],
        [_vi("ye", [16, 8])],
    )
    subgraph = model_of(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=plain)],
        [_vi("c", [], TensorProto.BOOL)],
        out,
    )

    fn = helper.make_function(
        "local", "LoadW", [], ["o"], [_constant_with(ext, out="o")], [helper.make_opsetid("", 17)]
    )
    function = model_of(
        [helper.make_node("LoadW", [], ["y"], domain="local")],
        [],
        out,
        opset_imports=[*OPSET, helper.make_opsetid("local", 1)],
        functions=[fn],
    )
    return {
        "constant_attribute": constant,
        "constant_sparse_value": sparse_const,
        "sparse_initializer_values": sparse_init,
        "sparse_initializer_indices": sparse_indices,
        "subgraph_initializer": subgraph,
        "function_constant": function,
    }


# ------------------------------------------------------------------------------------------- nesting


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def nested_if_bytes(levels: int) -> bytes:
    """A model whose main graph holds ``levels`` If nodes nested through ``then_branch``, built on the
    wire: protobuf itself cannot serialize or parse this deep (its decoder stops at depth 100)."""
    leaf = helper.make_graph(
        [helper.make_node("Constant", [], ["y"], value=helper.make_tensor("v", FLOAT, [1], [1.0]))],
        "leaf",
        [],
        [_vi("y", [1])],
    )
    leaf_bytes = leaf.SerializeToString()
    graph = leaf_bytes
    cond = _vi("c", [], TensorProto.BOOL)
    for level in range(levels):
        node = helper.make_node("If", ["c"], ["y"], name=f"if{level}", else_branch=leaf)
        then_attr = onnx.AttributeProto(name="then_branch", type=onnx.AttributeProto.GRAPH).SerializeToString()
        node_bytes = node.SerializeToString() + _field(5, then_attr + _field(6, graph))  # NodeProto.attribute
        shell = helper.make_graph([], f"g{level}", [cond] if level == levels - 1 else [], [_vi("y", [1])])
        graph = shell.SerializeToString() + _field(1, node_bytes)  # GraphProto.node
    model = helper.make_model(helper.make_graph([], "x", [], []), opset_imports=OPSET)
    model.ir_version = 8
    model.ClearField("graph")
    return model.SerializeToString() + _field(7, graph)  # ModelProto.graph


def recursive_function_model(cycle: Sequence[str]) -> onnx.ModelProto:
    """Model-local functions calling each other in a cycle (``["f"]``: f calls f)."""
    functions = []
    for i, name in enumerate(cycle):
        callee = cycle[(i + 1) % len(cycle)]
        functions.append(
            helper.make_function(
                "local",
                name,
                ["a"],
                ["b"],
                [helper.make_node(callee, ["a"], ["b"], domain="local")],
                [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
            )
        )
    return model_of(
        [helper.make_node(cycle[0], ["x"], ["y"], domain="local")],
        [_vi("x", [4])],
        [_vi("y", [4])],
        opset_imports=[*OPSET, helper.make_opsetid("local", 1)],
        functions=functions,
    )


# --------------------------------------------------------------------------------------- memory bombs


def _i64(name: str, values: Sequence[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def t7_models() -> dict[str, onnx.ModelProto]:
    """Tiny models whose constant folding or first run would allocate terabytes."""
    x = [_vi("x", [1])]
    y = [_vi("y", [1])]
    cos = model_of(
        [
            helper.make_node("ConstantOfShape", ["shape"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        x,
        y,
        [_i64("shape", [1 << 44])],
    )
    expand = model_of(
        [
            helper.make_node("Expand", ["one", "shape"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        x,
        y,
        [numpy_helper.from_array(np.ones((1, 1), np.float32), "one"), _i64("shape", [1 << 22, 1 << 22])],
    )
    tile = model_of(
        [
            helper.make_node("Tile", ["one", "reps"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        x,
        y,
        [numpy_helper.from_array(np.ones((1, 1), np.float32), "one"), _i64("reps", [1 << 22, 1 << 22])],
    )
    declared = model_of([helper.make_node("Identity", ["W"], ["y"])], [], [_vi("y", [1 << 40])])
    w = declared.graph.initializer.add()
    w.name, w.data_type = "W", FLOAT
    w.dims.append(1 << 40)  # 4 TiB declared, no data
    hidden = model_of(  # the shape passes through Identity: no static check sees it, the runtime must cope
        [
            helper.make_node("Identity", ["shape"], ["shape2"], name="hide"),
            helper.make_node("ConstantOfShape", ["shape2"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        x,
        y,
        [_i64("shape", [1 << 44])],
    )
    return {
        "constant_of_shape": cos,
        "expand": expand,
        "tile": tile,
        "declared_initializer": declared,
        "constant_of_shape_runtime": hidden,
    }


# ------------------------------------------------------------------------------------------ op domains


def t9_models(canary: Path) -> dict[str, onnx.ModelProto]:
    x, y = [_vi("x", [4])], [_vi("y", [4])]
    ms = [*OPSET, helper.make_opsetid("com.microsoft", 1)]
    custom = model_of(
        [helper.make_node("Backdoor", ["x"], ["y"], domain="evil.ops", library="/tmp/libevil.so")],
        x,
        y,
        opset_imports=[*OPSET, helper.make_opsetid("evil.ops", 1)],
    )
    pyop = model_of(
        [helper.make_node("PyOp", ["x"], ["y"], domain="com.microsoft", module="os", class_name="system")],
        x,
        y,
        opset_imports=ms,
    )
    epcontext = model_of(
        [
            helper.make_node(
                "EPContext",
                ["x"],
                ["y"],
                domain="com.microsoft",
                embed_mode=0,
                ep_cache_context=f"../../{canary.name}",
                source="CUDAExecutionProvider",
            )
        ],
        x,
        y,
        opset_imports=ms,
    )
    nested = model_of(
        [
            helper.make_node(
                "Loop",
                ["", "cond"],
                [],
                body=helper.make_graph(
                    [helper.make_node("PyOp", ["ci"], ["co"], domain="com.microsoft")],
                    "body",
                    [_vi("i", [], TensorProto.INT64), _vi("ci", [], TensorProto.BOOL)],
                    [_vi("co", [], TensorProto.BOOL)],
                ),
            ),
            helper.make_node("Identity", ["x"], ["y"]),
        ],
        [*x, _vi("cond", [], TensorProto.BOOL)],
        y,
        opset_imports=ms,
    )
    return {"custom_domain": custom, "pyop": pyop, "epcontext_embed0": epcontext, "pyop_in_loop_body": nested}


# -------------------------------------------------------------------------------------------- .ort file


def ort_format_bytes(tmp: Path) -> bytes:
    """A real ONNX Runtime flatbuffer (.ort) model, converted from the seed model by ORT itself."""
    import onnxruntime as ort

    target = tmp / "seed.ort"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.save_model_format", "ORT")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort.InferenceSession(str(SEED_MODEL), sess_options=options, providers=["CPUExecutionProvider"])
    return target.read_bytes()


# ---------------------------------------------------------------------------------------------- mutants


def mutants(count: int = 30, seed: int = 20240601) -> list[tuple[str, bytes]]:
    """Seeded mutants of mlp_cleanup.onnx: bit flips, truncations and field mutations."""
    rng = random.Random(seed)
    data = SEED_MODEL.read_bytes()
    out: list[tuple[str, bytes]] = []
    for i in range(count):
        kind = ("flip", "truncate", "field")[i % 3]
        if kind == "flip":
            buf = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(buf))
                buf[pos] ^= 1 << rng.randrange(8)
            out.append((f"flip-{i}", bytes(buf)))
        elif kind == "truncate":
            out.append((f"truncate-{i}", data[: rng.randrange(1, len(data))]))
        else:
            model = onnx.load_from_string(data)
            choice = rng.randrange(5)
            if choice == 0:
                init = model.graph.initializer[rng.randrange(len(model.graph.initializer))]
                init.dims.append(rng.choice([0, 3, 1 << 31, 1 << 62]))
            elif choice == 1:
                init = model.graph.initializer[rng.randrange(len(model.graph.initializer))]
                init.data_type = rng.choice([0, 8, 16, 22, 99])
            elif choice == 2:
                node = model.graph.node[rng.randrange(len(model.graph.node))]
                node.input.append("no_such_value")
            elif choice == 3:
                node = model.graph.node[rng.randrange(len(model.graph.node))]
                node.op_type = rng.choice(["Conv", "Loop", "NoSuchOp", ""])
            else:
                model.opset_import[0].version = rng.choice([1, 99, -1])
            out.append((f"field{choice}-{i}", model.SerializeToString()))
    return out


# ---------------------------------------------------------------------------------------------- archives


def zip_with(path: Path, members: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o120777 << 16
            zf.writestr(info, target)
    return path


def tar_with(path: Path, members: dict[str, bytes], *, special: Sequence[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info in special:
            tf.addfile(info)
    return path


def tar_special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def zip_many(path: Path, members: int) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("model.onnx", b"x")
        for i in range(members - 1):
            zf.writestr(f"f{i}.bin", b"")
    return path


def zip_bomb(path: Path, size: int = 1 << 30) -> Path:
    """``size`` zero bytes deflated (about 1 MB for 1 GiB) next to a tiny model.onnx."""
    zero = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("model.onnx", SEED_MODEL.read_bytes())
        info = zipfile.ZipInfo("weights.bin")
        info.compress_type = zipfile.ZIP_DEFLATED
        info._compresslevel = 9  # type: ignore[attr-defined]  # (an alias of compress_level on Python >= 3.13)
        with zf.open(info, "w", force_zip64=True) as out:
            for _ in range(size // len(zero)):
                out.write(zero)
    return path


def zip_overlapping(path: Path) -> Path:
    """Two central-directory entries that share one local file (CVE-2024-0450's overlap bomb)."""
    data = SEED_MODEL.read_bytes()
    zip_with(path, {"model.onnx": data, "w.bin": data})
    raw = bytearray(path.read_bytes())
    second = raw.find(b"PK\x01\x02", raw.find(b"PK\x01\x02") + 4)
    struct.pack_into("<I", raw, second + 42, 0)  # w.bin's local header offset -> model.onnx's header
    path.write_bytes(bytes(raw))
    return path
