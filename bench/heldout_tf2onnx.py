"""Held-out probe (issue 17): Keras models converted by tf2onnx, an exporter outside torch.

Two steps, two Pythons (TensorFlow is no dependency of this project, and its numpy pin differs):

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install tensorflow-cpu tf2onnx
    /tmp/tfenv/bin/python bench/heldout_tf2onnx.py build            # writes bench/out/heldout/tf2onnx/*.onnx
    .venv/bin/python -m bench.heldout_tf2onnx run                   # a fast job on each (bench.coverage.run_job)

Models (random weights, dynamic batch, and sequence for text): a CNN (Conv2D, BatchNorm, ReLU, depthwise conv,
swish, global pooling, NHWC as Keras writes it), a 2-layer transformer encoder (``keras.layers.
MultiHeadAttention``, post-norm LayerNormalization, tanh-GELU MLP; exact GELU's ``Erfc`` has no tf2onnx
converter) and a bidirectional LSTM classifier. tf2onnx 1.17, opset 17.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "tf2onnx"


def build() -> None:
    import onnx
    import tensorflow as tf
    import tf2onnx

    tf.random.set_seed(0)
    keras = tf.keras
    OUT.mkdir(parents=True, exist_ok=True)

    def save(model, name: str, spec: list) -> None:
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
        onnx.save(proto, str(OUT / f"{name}.onnx"))
        print(name, len(proto.graph.node), "nodes")

    x = keras.Input((32, 32, 3), name="image")
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(x)))
    h = keras.layers.Activation("swish")(keras.layers.DepthwiseConv2D(3, padding="same")(h))
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    save(keras.Model(x, out), "keras_cnn", [tf.TensorSpec([None, 32, 32, 3], tf.float32, name="image")])

    ids = keras.Input((None,), dtype=tf.int32, name="ids")
    e = keras.layers.Embedding(100, 32)(ids)
    for _ in range(2):
        e = keras.layers.LayerNormalization()(e + keras.layers.MultiHeadAttention(4, 8)(e, e))
        f = keras.layers.Dense(64, activation=lambda t: keras.activations.gelu(t, approximate=True))(e)
        e = keras.layers.LayerNormalization()(e + keras.layers.Dense(32)(f))
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(e))
    save(keras.Model(ids, out), "keras_encoder", [tf.TensorSpec([None, None], tf.int32, name="ids")])

    ids = keras.Input((None,), dtype=tf.int32, name="ids")
    h = keras.layers.Bidirectional(keras.layers.LSTM(16))(keras.layers.Embedding(100, 16)(ids))
    save(keras.Model(ids, keras.layers.Dense(2)(h)), "keras_lstm", [tf.TensorSpec([None, None], tf.int32, name="ids")])


def run() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench import _heldout

    _heldout.run_exports(sorted(OUT.glob("keras_*.onnx")), _heldout.ATTENTION_COLUMN)


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1] if len(sys.argv) > 1 else "run"]()
