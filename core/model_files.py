"""Writing an ONNX model whose weights may pass protobuf's 2 GB: one threshold and one writer for every floor.

A single protobuf message cannot exceed 2 GiB, so a model holding more than ``PROTOBUF_SAFE_BYTES`` of
tensors is written with its weights in ``<file>.data`` beside it; smaller ones stay one self-contained file.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

# Below 2 GiB with room for the graph, names and attributes that share the message with the weights.
PROTOBUF_SAFE_BYTES = 1_800_000_000


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of the main graph's initializers (external ones counted by their size, not read)."""
    return sum(int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(model: ir.Model, path: Path) -> bool:
    """Write ``model`` to ``path``, its weights to ``<name>.data`` beside it when it is over the protobuf limit;
    True when it wrote that file."""
    if tensor_bytes(model) > PROTOBUF_SAFE_BYTES:
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
        return True
    ir.save(model, path)
    return False
