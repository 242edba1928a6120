"""Held-out probe (issue 17): time-series forecasters from transformers, inputs no text or vision model has.

Run ``python -m bench.heldout_timeseries build`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, d_model 32, 4 heads, weights perturbed):
PatchTST and PatchTSMixer for prediction (``past_values [batch, context, channels]``, float), and the
probabilistic seq2seq forecasters TimeSeriesTransformer and Informer as their bare models
(``past_values``, ``past_time_features``, ``past_observed_mask``, ``future_time_features`` in; the decoder's
states out; a forecast is ``generate``'s loop over them, outside the graph). Each is exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), dynamic batch, and checked against torch at batch 2 and 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "timeseries"
CONTEXT, CHANNELS, HORIZON, LAGS = 32, 3, 8, (1, 2, 3)


def _models():
    import torch
    import transformers as tf

    small = {"d_model": 32, "num_attention_heads": 4, "ffn_dim": 64}
    patchtst = tf.PatchTSTForPrediction(tf.PatchTSTConfig(
        num_input_channels=CHANNELS, context_length=CONTEXT, prediction_length=HORIZON, patch_length=8,
        patch_stride=8, num_hidden_layers=2, **small,
    ))  # fmt: skip
    mixer = tf.PatchTSMixerForPrediction(tf.PatchTSMixerConfig(
        num_input_channels=CHANNELS, context_length=CONTEXT, prediction_length=HORIZON, patch_length=8,
        patch_stride=8, num_layers=2, d_model=32,
    ))  # fmt: skip

    class PastOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, past_values):
            return self.model(past_values=past_values).prediction_outputs

    def past_example(batch):
        return (torch.randn(batch, CONTEXT, CHANNELS),)

    yield "patchtst", PastOnly(patchtst), past_example, ("past_values",), ((0, "batch"),)
    yield "patchtsmixer", PastOnly(mixer), past_example, ("past_values",), ((0, "batch"),)

    seq2seq = {
        "prediction_length": HORIZON, "context_length": CONTEXT, "input_size": 1, "lags_sequence": list(LAGS),
        "num_time_features": 2, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_model": 32,
    }  # fmt: skip
    history = CONTEXT + max(LAGS)

    class Forecaster(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, past_values, past_time_features, past_observed_mask, future_time_features):
            out = self.model(
                past_values=past_values, past_time_features=past_time_features, past_observed_mask=past_observed_mask,
                future_time_features=future_time_features, use_cache=False, return_dict=True,
            )  # fmt: skip
            return out.last_hidden_state

    def forecaster_example(batch):
        return (
            torch.randn(batch, history), torch.randn(batch, history, 2), torch.ones(batch, history),
            torch.randn(batch, HORIZON, 2),
        )  # fmt: skip

    names = ("past_values", "past_time_features", "past_observed_mask", "future_time_features")
    tst = tf.TimeSeriesTransformerModel(tf.TimeSeriesTransformerConfig(**seq2seq))
    batch = tuple((0, "batch") for _ in names)
    yield "time_series_transformer", Forecaster(tst), forecaster_example, names, batch
    informer = tf.InformerModel(tf.InformerConfig(**seq2seq, attention_type="prob"))
    yield "informer", Forecaster(informer), forecaster_example, names, batch


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main

    probe_main(OUT, lambda only: build_models(_models(), OUT, only))
