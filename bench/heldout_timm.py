"""Held-out probe (issue 17): vision models from timm, the library most vision teams train and export from.

Two steps, two Pythons (timm is no dependency of this project). timm imports torchvision; PyPI's torchvision
wheels are CUDA builds whose operators do not load beside the CPU torch this machine has, and no model here uses
them, so ``build`` stubs torchvision's operator registrations before importing timm:

    python3 -m venv /tmp/timmenv && /tmp/timmenv/bin/pip install "torch==2.13.0+cpu" onnx onnxscript onnxruntime
    /tmp/timmenv/bin/pip install --no-deps torchvision==0.28.0 timm && /tmp/timmenv/bin/pip install huggingface_hub \
        pyyaml safetensors pillow
    /tmp/timmenv/bin/python bench/heldout_timm.py build     # writes bench/out/heldout/timm/*.onnx
    .venv/bin/python -m bench.heldout_timm run              # a fast job on each (bench.coverage.run_job)

Models (``timm.create_model(name, pretrained=False, ...)``: nothing downloaded; transformers cut to 2 blocks, images
64 x 64 or what the model's windows need; weights perturbed, BatchNorm statistics moved), each exported with the
TorchScript exporter (opset 17) and the dynamo exporter (opset 18), dynamic batch: ViT and DeiT (fused qkv,
``F.scaled_dot_product_attention``), BEiT (relative position bias), EVA-02 (rotary, SwiGLU), Swin (windows),
LeViT (attention biases, BatchNorm'ed linears), MobileViT, ConvNeXt,
EfficientNet, ResNet, RegNet, RepViT, FastViT, EdgeNeXt. Each build is checked in ONNX Runtime against torch at
batch 2 and 3.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "timm"

MODELS: list[tuple[str, dict, int]] = [
    ("vit_tiny_patch16_224", {"depth": 2, "img_size": 64}, 64),
    ("deit_tiny_distilled_patch16_224", {"depth": 2, "img_size": 64}, 64),
    ("beit_base_patch16_224", {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 64}, 64),
    ("eva02_tiny_patch14_224", {"depth": 2, "img_size": 56}, 56),
    ("swin_tiny_patch4_window7_224", {"depths": (2, 2), "num_heads": (2, 4), "embed_dim": 32, "img_size": 56}, 56),
    ("levit_128s", {"img_size": 64}, 64),
    ("mobilevit_xxs", {}, 64),
    ("convnext_atto", {}, 64),
    ("efficientnet_b0", {}, 64),
    ("resnet18", {}, 64),
    ("regnetx_002", {}, 64),
    ("repvit_m1", {}, 64),
    ("fastvit_t8", {}, 64),
    ("edgenext_xx_small", {}, 64),
]


def build(only: list[str] | None = None) -> None:
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import timm
    import torch

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import export_both
    from bench.heldout_detection import _perturb

    OUT.mkdir(parents=True, exist_ok=True)
    for name, kwargs, side in MODELS:
        if only and name not in only:
            continue
        try:
            model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        except Exception as exc:
            print(name, "create failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
            continue
        _perturb(model)
        model.eval()
        if hasattr(model, "distilled_training"):
            model.set_distilled_training(False)
        short = name.split("_patch")[0].split("_224")[0]

        def example(batch: int, side: int = side) -> tuple:
            return (torch.rand(batch, 3, side, side),)

        export_both(model, example, ("pixel_values",), ((0, "batch"),), out=OUT, stem=short, output="logits")


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import probe_main

    probe_main(OUT, build)
