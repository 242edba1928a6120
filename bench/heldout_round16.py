"""Held-out probe (issue 17), round 16: models no round had sent, whose inputs are not text or images of the usual
kind: TimesFM and TimesFM 2.5 (time-series forecasting over ``past_values``, its padding, and for TimesFM a
frequency id), Perception Encoder's audio tower (raw audio), and three vision models: GIT's and CLIPSeg's vision
towers, SuperPoint (a keypoint detector: a CNN whose head keeps the top keypoints).

Run ``python -m bench.heldout_round16 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, 4 heads, weights perturbed),
exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other
batch sizes. Inputs: TimesFM's ``past_values [batch, 64]`` (float), ``past_values_padding [batch, 64]`` (0 or 1)
and ``freq [batch, 1]`` (0..2); TimesFM 2.5's ``past_values [batch, 64]`` and its padding; PE audio's
``input_values [batch, 1, 32000]``; ``pixel_values [batch, 3, 64, 64]`` for the vision models.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round16"
_VIT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, image_hidden

    batch_axis = ((0, "batch"),)

    images = {
        "git_vision": lambda: tf.GitVisionModel(tf.GitVisionConfig(**_VIT, image_size=64, patch_size=8)),
        "clipseg_vision": lambda: tf.CLIPSegVisionModel(tf.CLIPSegVisionConfig(**_VIT, image_size=64, patch_size=8)),
    }
    for name, make in images.items():
        yield name, (lambda make=make: image_hidden(make())), fixed_images(64), ("pixel_values",), (batch_axis,)

    def superpoint():
        config = tf.SuperPointConfig(encoder_hidden_sizes=[16, 16, 32, 32], decoder_hidden_size=64,
                                     max_keypoints=32)  # fmt: skip
        model = tf.SuperPointForKeypointDetection(config)
        return _module(lambda m, p: m(pixel_values=p).scores, 1)(model.eval())

    yield "superpoint", superpoint, fixed_images(64), ("pixel_values",), (batch_axis,)

    def timesfm():
        config = tf.TimesFmConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  head_dim=16, patch_length=16, context_length=64, horizon_length=16)  # fmt: skip
        model = tf.TimesFmModel(config)
        return _module(lambda m, v, p, f: m(past_values=v, past_values_padding=p, freq=f).last_hidden_state, 3)(
            model.eval()
        )

    def series(batch: int) -> tuple:
        padding = torch.zeros(batch, 64)
        padding[:, :8] = 1.0
        return torch.randn(batch, 64), padding, torch.randint(0, 3, (batch, 1))

    names = ("past_values", "past_values_padding", "freq")
    yield "timesfm", timesfm, series, names, (batch_axis, batch_axis, batch_axis)

    def timesfm2_5():
        config = tf.TimesFm2_5Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                     context_length=64)  # fmt: skip
        model = tf.TimesFm2_5Model(config)
        return _module(lambda m, v, p: m(past_values=v, past_values_padding=p).last_hidden_state, 2)(model.eval())

    def series2(batch: int) -> tuple:
        padding = torch.zeros(batch, 64)
        return torch.randn(batch, 64), padding

    yield "timesfm2_5", timesfm2_5, series2, names[:2], (batch_axis, batch_axis)

    def pe_audio():
        config = tf.PeAudioEncoderConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, head_dim=16)  # fmt: skip
        model = tf.PeAudioEncoder(config)
        return _module(lambda m, a: m(input_values=a).last_hidden_state, 1)(model.eval())

    def audio(batch: int) -> tuple:
        return (torch.randn(batch, 1, 32000),)

    yield "pe_audio", pe_audio, audio, ("input_values",), (batch_axis,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
