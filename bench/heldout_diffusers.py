"""Held-out probe (issue 17): the parts of a diffusion pipeline teams export, built by diffusers.

Two steps, two Pythons (diffusers is no dependency of this project):

    python3 -m venv /tmp/diffenv
    /tmp/diffenv/bin/pip install "torch==2.13.0+cpu" diffusers onnx onnxscript onnxruntime
    /tmp/diffenv/bin/python bench/heldout_diffusers.py build     # writes bench/out/heldout/diffusers/*.onnx
    .venv/bin/python -m bench.heldout_diffusers run              # a fast job on each (bench.coverage.run_job)

Models from diffusers config objects (nothing downloaded; two down/up blocks, 32-64 channels, GroupNorm of 8-16
groups, weights perturbed): the denoising UNet of Stable Diffusion (``UNet2DConditionModel``: ResNet blocks,
timestep embedding, self- and cross-attention over text states, GEGLU feed-forward), the VAE's decoder and encoder
(``AutoencoderKL``: a mid-block attention over pixels) and a DiT-style transformer (``DiTTransformer2DModel``:
patches, adaLN-zero). Each is exported with the TorchScript exporter (opset 17) and dynamo (opset 18) with dynamic
batch (and latent size for the VAE), the way Optimum's and diffusers' own ONNX scripts export them, and checked
in ONNX Runtime against torch at batch 2 and 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "diffusers"


class _Unet:
    """(sample, timestep, encoder_hidden_states) -> noise prediction, as Optimum exports the UNet."""

    inputs = ("sample", "timestep", "encoder_hidden_states")

    @staticmethod
    def build():
        import torch
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
        )  # fmt: skip

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.unet = unet

            def forward(self, sample, timestep, encoder_hidden_states):
                return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

        def example(batch):
            return (torch.randn(batch, 4, 16, 16), torch.full((batch,), 500.0), torch.randn(batch, 7, 32))

        return Wrapper(), example


def _vae(part: str):
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=16,
    )  # fmt: skip

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, x):
            if part == "decoder":
                return self.vae.decode(x, return_dict=False)[0]
            return self.vae.encode(x).latent_dist.mean

    def example(batch):
        return (torch.randn(batch, 4, 8, 8),) if part == "decoder" else (torch.randn(batch, 3, 16, 16),)

    return Wrapper(), example


def _dit():
    import torch
    from diffusers import DiTTransformer2DModel

    dit = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10, norm_num_groups=8,
    )  # fmt: skip

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dit = dit

        def forward(self, hidden_states, timestep, class_labels):
            return self.dit(hidden_states, timestep=timestep, class_labels=class_labels, return_dict=False)[0]

    def example(batch):
        return (
            torch.randn(batch, 4, 8, 8),
            torch.full((batch,), 10, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long),
        )

    return Wrapper(), example


def _models():
    yield "sd_unet", _Unet.inputs, _Unet.build
    yield "vae_decoder", ("latent_sample",), lambda: _vae("decoder")
    yield "vae_encoder", ("sample",), lambda: _vae("encoder")
    yield "dit", ("hidden_states", "timestep", "class_labels"), _dit


def build(only: list[str] | None = None) -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import export_both
    from bench.heldout_detection import _perturb

    OUT.mkdir(parents=True, exist_ok=True)
    for name, names, make in _models():
        if only and name not in only:
            continue
        try:
            model, example = make()
        except Exception as exc:
            print(name, "create failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
            continue
        _perturb(model)
        model.eval()
        export_both(model, example, names, tuple((0, "batch") for _ in names), out=OUT, stem=name)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import probe_main

    probe_main(OUT, build)
