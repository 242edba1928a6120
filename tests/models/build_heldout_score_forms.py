"""Build the held-out exports of rounds 4 to 6 whose attention scores or Softmax are written in forms the SDPA
rule did not read, under ``tests/models/heldout/`` (``tests/passes/test_fuse_softmax_forms.py``).

Run ``python -m tests.models.build_heldout_score_forms`` (needs torch and transformers); the .onnx files are
committed so the tests need neither. Both are exported by the TorchScript exporter (opset 17) and dynamo
(opset 18), every axis dynamic, weights perturbed, and checked against torch at other shapes:

* ``sewd_mask_ts.onnx``: transformers' ``SEWDModel`` (1 layer, hidden 32, 2 heads), raw audio
  ``input_values [batch, samples]`` and its ``attention_mask`` -> ``last_hidden_state``. Its ``XSoftmax`` fills
  the masked scores with ``finfo.min``, and the probabilities of the same positions with 0 after the Softmax
  (a padded frame's query row in full); TorchScript writes that Softmax's axis as 3. ``sewd_dynamo.onnx``: the
  same model without the mask (dynamo fixes the audio length of the masked one: its frame lengths are computed
  from the mask's sum), whose all-ones mask the graph builds.
* ``layoutlmv3_text_{ts,dynamo}.onnx``: ``LayoutLMv3Model`` without the visual branch (1 layer, hidden 32),
  ``input_ids``, ``bbox [batch, sequence, 4]`` and ``attention_mask``: CogView's PB-Relax Softmax
  (``(s / 32 - max(s / 32)) * 32``) over scores carrying 1-D and 2-D relative position biases.
* ``bros_{ts,dynamo}.onnx``: ``BrosModel`` (1 layer, hidden 64), ``input_ids``, ``bbox [batch, sequence, 8]``
  (float corners in 0-1) and ``attention_mask``: the scale applied to the sum of ``q @ k^T`` and the query's
  product with the boxes' relative embeddings, then the mask.
* ``speecht5_encoder_ts.onnx``: ``SpeechT5ForSpeechToText``'s encoder with its speech pre-net (1 layer, hidden
  32, 2 heads), raw audio ``input_values [batch, samples]``: heads folded into the batch (``bmm``), the relative
  position term computed from the query added to the folded scores, the Softmax on them (round 6).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.models.corpus import _strip  # noqa: E402

DIR = Path(__file__).resolve().parent / "heldout"
SAMPLES_PER_FRAME = 10  # the SEW-D feature encoder's total stride below (5 * 2)


def _meta() -> dict[str, str]:
    return {"source": "tests/models/build_heldout_score_forms.py"}


def sewd_feeds(batch: int, samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Audio whose last row is padded to 60% of its length (a padded utterance of a batch)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, samples), np.int64)
    if batch > 1:
        mask[-1, int(samples * 0.6) :] = 0
    return {"input_values": rng.standard_normal((batch, samples)).astype(np.float32), "attention_mask": mask}


def layoutlmv3_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 500, (batch, seq, 2))
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[-1, seq // 2 :] = 0
    return {
        "input_ids": rng.integers(3, 100, (batch, seq)).astype(np.int64),
        "bbox": np.concatenate([corners, corners + rng.integers(0, 500, (batch, seq, 2))], -1).astype(np.int64),
        "attention_mask": mask,
    }


def bros_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corners = rng.random((batch, seq, 2)) * 0.5
    far = corners + rng.random((batch, seq, 2)) * 0.5
    (x0, y0), (x1, y1) = np.moveaxis(corners, -1, 0), np.moveaxis(far, -1, 0)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[-1, seq // 2 :] = 0
    return {
        "input_ids": rng.integers(3, 100, (batch, seq)).astype(np.int64),
        "bbox": np.stack([x0, y0, x1, y0, x1, y1, x0, y1], -1).astype(np.float32),
        "attention_mask": mask,
    }


def speecht5_feeds(batch: int, samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"input_values": np.random.default_rng(seed).standard_normal((batch, samples)).astype(np.float32)}


def _modules():
    import torch
    import transformers as tf

    class Audio(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.SEWDModel(tf.SEWDConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, squeeze_factor=2,
                max_position_embeddings=64, position_buckets=16, feat_extract_norm="layer",
            ))  # fmt: skip

        def forward(self, input_values, attention_mask):
            return self.inner(input_values=input_values, attention_mask=attention_mask).last_hidden_state

    class Document(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.LayoutLMv3Model(tf.LayoutLMv3Config(
                vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, coordinate_size=6, shape_size=4, max_2d_position_embeddings=1024,
                visual_embed=False, rel_pos_bins=16, max_rel_pos=32, rel_2d_pos_bins=16, max_rel_2d_pos=64,
            ))  # fmt: skip

        def forward(self, input_ids, bbox, attention_mask):
            return self.inner(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask).last_hidden_state

    class Unmasked(torch.nn.Module):
        def __init__(self, audio: Audio) -> None:
            super().__init__()
            self.inner = audio.inner

        def forward(self, input_values):
            return self.inner(input_values=input_values).last_hidden_state

    def audio_feeds(batch: int) -> dict[str, np.ndarray]:
        return sewd_feeds(batch, 200 + 80 * batch, seed=batch)

    def unmasked_feeds(batch: int) -> dict[str, np.ndarray]:
        return {"input_values": audio_feeds(batch)["input_values"]}

    def text_feeds(batch: int) -> dict[str, np.ndarray]:
        return layoutlmv3_feeds(batch, 5 + 3 * batch, seed=batch)

    audio = Audio()
    audio_axes = {"input_values": ("batch", "samples"), "attention_mask": ("batch", "samples")}
    yield "sewd_mask", audio, audio_feeds, audio_axes, ("ts",)
    yield "sewd", Unmasked(audio), unmasked_feeds, {"input_values": ("batch", "samples")}, ("dynamo",)
    document_axes = {"input_ids": ("batch", "sequence"), "bbox": ("batch", "sequence"),
                     "attention_mask": ("batch", "sequence")}  # fmt: skip
    yield "layoutlmv3_text", Document(), text_feeds, document_axes, ("ts", "dynamo")

    class Boxes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.BrosModel(tf.BrosConfig(
                vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, dim_bbox=8,  # hidden 64: its 1-D box sinusoid is hidden / 32 wide
            ))  # fmt: skip

        def forward(self, input_ids, bbox, attention_mask):
            return self.inner(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask).last_hidden_state

    def box_feeds(batch: int) -> dict[str, np.ndarray]:
        return bros_feeds(batch, 5 + 3 * batch, seed=batch)

    yield "bros", Boxes(), box_feeds, document_axes, ("ts", "dynamo")

    class Speech(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.SpeechT5ForSpeechToText(tf.SpeechT5Config(
                vocab_size=64, hidden_size=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64, conv_dim=(16, 16),
                conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                encoder_max_relative_position=16, mask_time_prob=0.0, max_speech_positions=256,
            )).get_encoder()  # fmt: skip

        def forward(self, input_values):
            return self.inner(input_values=input_values).last_hidden_state

    def speech_feeds(batch: int) -> dict[str, np.ndarray]:
        return speecht5_feeds(batch, 200 + 80 * batch, seed=batch)

    yield "speecht5_encoder", Speech(), speech_feeds, {"input_values": ("batch", "samples")}, ("ts",)


def build(only: list[str] | None = None) -> list[Path]:
    import torch

    from bench.heldout_detection import _perturb

    torch.manual_seed(0)
    paths = []
    for stem, module, feeds, axes, tags in _modules():
        if only and stem not in only:
            continue
        _perturb(module)  # Unmasked shares Audio's weights: perturbed twice, still one model for both exports
        module.eval()
        example = tuple(torch.from_numpy(v) for v in feeds(2).values())
        names = list(axes)
        for tag in tags:
            path = DIR / f"{stem}_{tag}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if tag == "ts":
                    dynamic = {n: dict(enumerate(dims)) for n, dims in axes.items()}
                    torch.onnx.export(module, example, str(path), opset_version=17, dynamo=False, input_names=names,
                                      output_names=["last_hidden_state"], dynamic_axes=dynamic)  # fmt: skip
                    proto = onnx.load(str(path))
                else:
                    dims = {d: torch.export.Dim(d, min=1, max=4096) for dims in axes.values() for d in dims}
                    shapes = tuple({i: dims[d] for i, d in enumerate(ds)} for ds in axes.values())
                    program = torch.onnx.export(module, example, dynamo=True, opset_version=18, input_names=names,
                                                output_names=["last_hidden_state"], dynamic_shapes=shapes)  # fmt: skip
                    proto = program.model_proto
            onnx.save(_strip(proto, _meta()), str(path))
            _check(module, path, feeds)
            paths.append(path)
    return paths


def _check(module, path: Path, feeds) -> None:
    """ORT against torch at batch sizes other than the export's, a padded row included."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        feed = feeds(batch)
        with torch.no_grad():
            want = module(*(torch.from_numpy(v) for v in feed.values())).numpy()
        got = session.run(None, feed)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(path))


if __name__ == "__main__":
    for built in build(sys.argv[1:] or None):
        print(built, built.stat().st_size, "bytes")
