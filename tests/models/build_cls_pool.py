"""Build ``tests/models/bert_cls_pool.onnx`` and ``bert_cls_pool_legacy.onnx``: a sentence encoder whose graph
output is the CLS pooling ``last_hidden_state[:, 0]`` (as BGE-style embedding models are exported).

Run ``python -m tests.models.build_cls_pool`` (needs the ``dev`` extra: torch, transformers). The encoder is
the tiny ``bert_encoder`` of ``build_hf`` (same config, seeds and weight noise); the wrapper returns
``last_hidden_state[:, 0]`` as the only output ``cls_embedding`` ``[batch, 32]``, so the slice that
``upstream_slice`` moves is itself the graph output. ``bert_cls_pool.onnx`` comes from the dynamo exporter
(opset 18), ``bert_cls_pool_legacy.onnx`` from the TorchScript one (``dynamo=False``, opset 17). The builder
checks both against torch in ONNX Runtime on padded batches of other shapes (atol = rtol = 1e-4) and deletes
what it wrote otherwise.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.models.build_hf import SPECS, _config, make_inputs

HERE = Path(__file__).resolve().parent
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "cls_embedding"
SHAPES = ((3, 5, 0.2), (1, 17, 0.0), (4, 24, 0.3))
ATOL = RTOL = 1e-4


def _module() -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    encoder = tf.BertModel(_config(SPECS["bert_encoder"], "tiny"), add_pooling_layer=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF's zero biases and unit LN scales would be folded away by the exporter
        for _, p in sorted(encoder.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)

    class ClsPooling(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.encoder = inner

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> torch.Tensor:
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state[:, 0]

    return ClsPooling(encoder.eval()).eval()


def _export(module: Any, path: Path, *, dynamo: bool) -> None:
    import torch

    example = make_inputs("bert_encoder", 2, 8, pad_fraction=0.125, seed=0, size="tiny")
    args = tuple(torch.from_numpy(example[k]) for k in INPUTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(
                module,
                args,
                input_names=list(INPUTS),
                output_names=[OUTPUT],
                dynamic_shapes=tuple({0: "batch", 1: "sequence"} for _ in INPUTS),
                opset_version=18,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            proto = program.model_proto
        else:
            tmp = path.with_suffix(".tmp.onnx")
            torch.onnx.export(
                module,
                args,
                str(tmp),
                input_names=list(INPUTS),
                output_names=[OUTPUT],
                dynamic_axes={**{k: {0: "batch", 1: "sequence"} for k in INPUTS}, OUTPUT: {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
            proto = onnx.load(str(tmp))
            tmp.unlink()
    for node in proto.graph.node:  # stack traces with local paths
        del node.metadata_props[:]
        node.doc_string = ""
    proto.graph.name = path.stem
    proto.metadata_props.add(key="onnxforge.builder", value="tests.models.build_cls_pool")
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


def build(out: Path = HERE) -> list[Path]:
    import onnxruntime as ort
    import torch

    module = _module()
    written = [out / "bert_cls_pool.onnx", out / "bert_cls_pool_legacy.onnx"]
    try:
        for path, dynamo in zip(written, (True, False), strict=True):
            _export(module, path, dynamo=dynamo)
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            for seed, (batch, seq, pad) in enumerate(SHAPES, start=1):
                feeds = make_inputs("bert_encoder", batch, seq, pad_fraction=pad, seed=seed, size="tiny")
                with torch.no_grad():
                    ref = module(*(torch.from_numpy(feeds[k]) for k in INPUTS)).numpy()
                got = session.run([OUTPUT], feeds)[0]
                np.testing.assert_allclose(got, ref, atol=ATOL, rtol=RTOL, err_msg=f"{path.name} {batch}x{seq}")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.build_cls_pool", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE)
    build(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
