"""Build torchvision's Swin, tiny, under ``tests/models/heldout/`` (``tests/passes/test_fuse_rank4_norms.py``).

torchvision's wheels need a torch of their own build (the project's CPU torch has no torchvision that imports
beside it), so this runs in the venv of ``bench/heldout_detection.py``::

    /tmp/tvenv/bin/python tests/models/build_heldout_torchvision.py

and the .onnx is committed. ``tv_swin_ts.onnx``: ``torchvision.models.SwinTransformer`` (patch 4, embed 16, depths
[1, 1], heads [2, 2], window 4, 10 classes), every parameter perturbed, exported by the TorchScript exporter
(opset 17, dynamic batch) as torchvision's docs show, ``pixel_values [batch, 3, 32, 32] -> logits``. Its blocks
keep the tokens as batch x height x width x channels: the residual norms are rank 4.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIR = Path(__file__).resolve().parent / "heldout"


def main() -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch
    from torchvision.models import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4], num_classes=10
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = DIR / "tv_swin_ts.onnx"
    torch.onnx.export(
        model,
        (torch.rand(1, 3, 32, 32),),
        str(path),
        opset_version=17,
        dynamo=False,
        input_names=["pixel_values"],
        output_names=["logits"],
        dynamic_axes={"pixel_values": {0: "batch"}},
    )
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del proto.metadata_props[:]
    proto.metadata_props.add(key="onnxforge.builder", value="tests/models/build_heldout_torchvision.py")
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x).numpy()
    got = session.run(None, {"pixel_values": x.numpy()})[0]
    print(
        path.name,
        len(proto.graph.node),
        "nodes",
        path.stat().st_size,
        "bytes; max |ort - torch|",
        float(np.max(np.abs(want - got))),
    )


if __name__ == "__main__":
    sys.exit(main())
