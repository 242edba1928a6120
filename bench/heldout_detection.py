"""Held-out probe (issue 17): torchvision detectors and classifiers, graphs with control flow and vision ops.

Two steps, two Pythons (torchvision's wheels need a torch of their own build; the project's CPU torch 2.13 has
no torchvision that imports beside it, and its detectors need torchvision's compiled ops). Note that PyPI's
torch 2.14.1 for Linux is the CUDA build and pulls NVIDIA's libraries into that venv; the probes that need no
torchvision op (``bench/heldout_timm.py``, ``bench/heldout_diffusers.py``) run on the CPU torch instead:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 onnx onnxscript
    /tmp/tvenv/bin/python bench/heldout_detection.py build      # writes bench/out/heldout/detection/*.onnx
    .venv/bin/python -m bench.heldout_detection run             # a fast job on each (bench.coverage.run_job)

    /tmp/tvenv/bin/pip install ultralytics onnxslim
    YOLO_OFFLINE=1 /tmp/tvenv/bin/python bench/heldout_detection.py build_yolo   # bench/out/heldout/yolo/*.onnx
    .venv/bin/python -m bench.heldout_detection run bench/out/heldout/yolo

Models (random weights, no download: ``weights=None, weights_backbone=None``), exported the way torchvision's
docs show (TorchScript exporter, opset 17, dynamic batch where the model takes a batch):

- detectors: Faster R-CNN (MobileNetV3 FPN), RetinaNet, FCOS and Mask R-CNN on a ResNet-18 FPN, SSDlite. Their
  graphs carry ``If``/``Loop`` subgraphs, ``NonMaxSuppression``, ``RoiAlign``, ``TopK`` and data-dependent
  output counts (a list of images in, boxes/labels/scores out);
- classifiers and backbones outside the transformers corpus: torchvision's ViT (``nn.MultiheadAttention``
  inside), Swin-T (shifted windows, its own relative bias), MobileNetV3 (Hardswish, squeeze-excite),
  EfficientNet (SiLU), ShuffleNetV2 (channel shuffle), a GoogLeNet without aux heads.

- Ultralytics' exports (``build_yolo``), as ``yolo export`` writes them from a model built from its yaml (random
  init, nothing downloaded; onnxslim on, opset 18 or 17): YOLOv8n at the default 640 x 640, static; YOLO11n with
  NMS inside and dynamic axes; YOLOv10n (NMS-free head); the segment, pose and classify heads; RT-DETR-L (a
  transformer decoder with deformable attention, ``GridSample``).

Each torchvision build is checked in ONNX Runtime against torch at the export's image size and one other. ``run`` gives:
job ok (or its error), exact, passes applied, speedup and the report's notes.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "detection"


def _detectors():
    from torchvision.models import detection
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    def r18(**kw):
        return resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5, **kw)

    small = {"min_size": 128, "max_size": 160}
    p6p7 = {"returned_layers": [2, 3, 4], "extra_blocks": LastLevelP6P7(256, 256)}
    yield (
        "fasterrcnn_mnv3",
        detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=5, **small),
    )
    yield "retinanet_r18", detection.RetinaNet(r18(**p6p7), num_classes=5, **small)
    yield "fcos_r18", detection.FCOS(r18(**p6p7), num_classes=5, **small)
    yield "maskrcnn_r18", detection.MaskRCNN(r18(), num_classes=5, **small)
    yield "ssdlite", detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=5)


def _classifiers():
    from torchvision import models
    from torchvision.models.vision_transformer import VisionTransformer

    yield (
        "tv_vit",
        VisionTransformer(
            image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10
        ),
        64,
    )
    yield "tv_swin_t", models.swin_t(weights=None, num_classes=10), 96
    yield "tv_mobilenet_v3", models.mobilenet_v3_small(weights=None, num_classes=10), 64
    yield "tv_efficientnet_b0", models.efficientnet_b0(weights=None, num_classes=10), 64
    yield "tv_shufflenet", models.shufflenet_v2_x0_5(weights=None, num_classes=10), 64
    yield "tv_googlenet", models.googlenet(weights=None, num_classes=10, aux_logits=False, init_weights=True), 64


def _perturb(model) -> None:
    """Random weights away from init's symmetries; BatchNorm statistics away from (0, 1)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)


def _check(path: Path, model, feeds: list, *, listed: bool = False) -> float:
    """Largest difference of ORT against torch over ``feeds`` (each a list of tensors, the model's inputs; with
    ``listed``, given to torch as one list, as a detector takes its images)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    worst = 0.0
    for args in feeds:
        with torch.no_grad():
            want = model(list(args)) if listed else model(*args)
        flat = []
        for item in want if isinstance(want, (list, tuple)) else [want]:
            flat += list(item.values()) if isinstance(item, dict) else [item]
        got = session.run(None, dict(zip(names, [a.numpy() for a in args], strict=True)))
        for tensor, g in zip(flat, got, strict=True):
            w = tensor.numpy()
            if w.shape != g.shape:
                raise AssertionError(f"shape {g.shape} against torch's {w.shape}")
            if w.size:
                worst = max(worst, float(np.max(np.abs(w.astype(np.float64) - g))))
    return worst


def build() -> None:
    import onnx
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    for name, model in _detectors():
        _perturb(model)
        model.eval()
        path = OUT / f"{name}.onnx"
        example = [torch.rand(3, 160, 128)]
        try:
            torch.onnx.export(
                model,
                (example,),
                str(path),
                opset_version=17,
                dynamo=False,
                input_names=["images"],
                dynamic_axes={"images": {1: "height", 2: "width"}},
            )
            worst = _check(path, model, [[torch.rand(3, 160, 128)], [torch.rand(3, 144, 192)]], listed=True)
            print(name, len(onnx.load(str(path)).graph.node), "nodes; max |ort - torch|", f"{worst:.2e}", flush=True)
        except Exception as exc:  # a row of the table, not the end of the probe
            print(name, "build failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)

    for name, model, side in _classifiers():
        _perturb(model)
        model.eval()
        path = OUT / f"{name}.onnx"
        try:
            torch.onnx.export(
                model,
                (torch.rand(1, 3, side, side),),
                str(path),
                opset_version=17,
                dynamo=False,
                input_names=["pixel_values"],
                output_names=["logits"],
                dynamic_axes={"pixel_values": {0: "batch"}},
            )
            worst = _check(path, model, [[torch.rand(2, 3, side, side)], [torch.rand(3, 3, side, side)]])
            print(name, len(onnx.load(str(path)).graph.node), "nodes; max |ort - torch|", f"{worst:.2e}", flush=True)
        except Exception as exc:
            print(name, "build failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)


def build_yolo() -> None:
    import shutil

    from ultralytics import RTDETR, YOLO

    out = OUT.parent / "yolo"
    out.mkdir(parents=True, exist_ok=True)
    exports = [
        ("yolov8n_default640", YOLO, "yolov8n.yaml", {}),
        ("yolo11n_nms_dyn", YOLO, "yolo11n.yaml", {"nms": True, "dynamic": True, "imgsz": 160}),
        ("yolov10n_160", YOLO, "yolov10n.yaml", {"imgsz": 160}),
        ("yolov8n_seg_dyn", YOLO, "yolov8n-seg.yaml", {"dynamic": True, "imgsz": 160}),
        ("yolov8n_pose_dyn", YOLO, "yolov8n-pose.yaml", {"dynamic": True, "imgsz": 160}),
        ("yolo11n_cls_dyn", YOLO, "yolo11n-cls.yaml", {"dynamic": True, "imgsz": 160}),
        ("rtdetr_l_160", RTDETR, "rtdetr-l.yaml", {"imgsz": 160}),
    ]
    for name, kind, config, options in exports:
        try:
            written = kind(config).export(format="onnx", simplify=True, **options)
            shutil.move(written, out / f"{name}.onnx")
            print(name, "exported", flush=True)
        except Exception as exc:
            print(name, "build failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)


def run(folder: Path = OUT) -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench import _heldout

    _heldout.run_exports(sorted(folder.glob("*.onnx")), ("nodes", lambda counts: str(counts.get("nodes", ""))))


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else "run"
    if step == "run":
        run(Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else OUT)
    else:
        {"build": build, "build_yolo": build_yolo}[step]()
