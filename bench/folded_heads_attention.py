"""Does fusing folded-heads attention (``F.multi_head_attention_forward``'s bmm) to ``MultiHeadAttention`` pay on
the CPU EP? (issue 17)

Run ``python -m bench.folded_heads_attention [--model wavlm|mha] [--exporter dynamo|ts_eager] [--hidden 256]
[--heads 4] [--layers 2] [--shapes 1x50 4x200] [--threads 1 2] [--seconds 15] [--save DIR]`` (needs the dev extra;
exports into ``bench/out/folded_heads/``, reused while the file is there). ``wavlm``: transformers' ``WavLMModel``
of that size (feature encoder 7 x 64 channels), raw audio, shapes ``BATCHxFRAMES`` (``FRAMES * 320 + 80`` samples).
``mha``: ``layers`` pre-norm blocks ``x + MHA(LN(x))``, ``x + FFN(LN(x))`` around ``torch.nn.MultiheadAttention``
(batch first, ``need_weights`` left at its default True) with a key padding mask (the first row's last third
padded), shapes ``BATCHxSEQ``; dynamo only (TorchScript writes its key length as a constant).

Graphs, each as the ``fast`` preset leaves it on CPU (``fuse_transformer``'s onnxscript engine, then
``unfuse_skip_layernorm``), differing only in ``fuse_transformer``'s ``attention`` option: ``none`` (attention
left to ORT's kernels, every other fusion made) and ``mha`` (``MultiHeadAttention``), plus ``mha_copy``, a
second session of the ``mha`` graph (A/A control: its ratio to ``mha`` is the host's noise). Sessions at ORT's
default level, timed interleaved in blocks whose order rotates; medians per graph and the median of the per-block
ratio. Outputs are checked against the export (1e-4) first. ``--save DIR`` also writes the ``none`` and ``mha``
graphs, which ``bench/folded_heads_time.py`` times with numpy and onnxruntime alone (a quiet host without torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402

from bench.bloom_alibi_attention import _session, interleaved  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from passes.fusion.fuse_transformer import FuseTransformer  # noqa: E402
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm  # noqa: E402

OUT = REPO / "bench" / "out" / "folded_heads"
MODES = ("none", "mha")
HOP = 320


def export_wavlm(exporter: str, hidden: int, heads: int, layers: int) -> Path:
    from bench.heldout_vision_audio import SPECS, _export, _model, _wrapper, feeds

    path = OUT / f"wavlm_h{hidden}_n{heads}_l{layers}_{exporter}.onnx"
    if path.exists():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    kwargs = {**SPECS["wavlm"].kwargs, "hidden_size": hidden, "num_attention_heads": heads}
    kwargs |= {"num_hidden_layers": layers, "intermediate_size": 4 * hidden, "conv_dim": (64,) * 7}
    spec = dataclasses.replace(SPECS["wavlm"], kwargs=kwargs)
    proto = _export(_wrapper(spec, _model(spec, "eager")), spec, exporter, feeds(spec, 2, 20), path)
    onnx.save(proto, str(path))
    return path


def export_mha(hidden: int, heads: int, layers: int) -> Path:
    import torch

    path = OUT / f"mha_h{hidden}_n{heads}_l{layers}_dynamo.onnx"
    if path.exists():
        return path
    OUT.mkdir(parents=True, exist_ok=True)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
            self.attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
            self.ffn = torch.nn.Sequential(
                torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
            )

        def forward(self, x, mask):
            h = self.norm1(x)
            x = x + self.attn(h, h, h, key_padding_mask=mask)[0]
            return x + self.ffn(self.norm2(x))

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x, key_padding_mask):
            for block in self.blocks:
                x = block(x, key_padding_mask)
            return x

    torch.manual_seed(0)
    module = Stack().eval()
    example = (torch.randn(2, 16, hidden), torch.zeros(2, 16, dtype=torch.bool))
    dims = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, example, input_names=["x", "key_padding_mask"], output_names=["y"], dynamic_shapes=dims,
            opset_version=18, dynamo=True, optimize=True, verbose=False,
        )  # fmt: skip
    onnx.save(program.model_proto, str(path))
    return path


def feeds(model: str, hidden: int, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "wavlm":
        return {"input_values": rng.standard_normal((batch, length * HOP + 80)).astype(np.float32)}
    mask = np.zeros((batch, length), bool)
    mask[0, length - length // 3 :] = True
    return {"x": rng.standard_normal((batch, length, hidden)).astype(np.float32), "key_padding_mask": mask}


def graphs(path: Path, family: str | None) -> tuple[dict[str, bytes], dict[str, dict[str, int]]]:
    blobs, counts = {"export": path.read_bytes()}, {}
    for mode in MODES:
        options = {"engines": ["onnxscript"], "attention": mode} | ({"family": family} if family else {})
        fused = FuseTransformer(options)(ir.load(path), PassContext())
        cpu = UnfuseSkipLayerNorm()(fused.model, PassContext())
        blobs[mode] = ir.serde.serialize_model(cpu.model).SerializeToString()
        counts[mode] = {k: v for k, v in fused.counts.items() if k.startswith("fused_") and v}
    blobs["mha_copy"] = blobs["mha"]
    return blobs, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.folded_heads_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("wavlm", "mha"), default="wavlm")
    parser.add_argument("--exporter", choices=("dynamo", "ts_eager"), default="dynamo")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=["1x50", "4x200"], help="BATCHxFRAMES (wavlm), BATCHxSEQ")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=15.0, help="timing budget per shape and thread count")
    parser.add_argument("--save", type=Path, help="write the none/mha graphs here (bench/folded_heads_time.py)")
    args = parser.parse_args(argv)
    print(f"command: python -m bench.folded_heads_attention {shlex.join(argv if argv is not None else sys.argv[1:])}")
    if args.model == "wavlm":
        path, family = export_wavlm(args.exporter, args.hidden, args.heads, args.layers), None
    else:
        path, family = export_mha(args.hidden, args.heads, args.layers), "vit"  # no embedding to name a family
    blobs, counts = graphs(path, family)
    print(f"<!-- fusions: {counts} -->")
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for mode in MODES:
            (args.save / f"{args.model}_{args.exporter}_{mode}.onnx").write_bytes(blobs[mode])
    print("| shape | threads | export ms | none ms | mha ms | mha / none (paired) | A/A: copy / mha | blocks | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        inputs = feeds(args.model, args.hidden, batch, length, seed=length)
        for threads in args.threads:
            sessions = {name: _session(blob, threads) for name, blob in blobs.items()}
            outs = {n: s.run(None, inputs) for n, s in sessions.items()}
            for name in (*MODES, "mha_copy"):
                for got, want in zip(outs[name], outs["export"], strict=True):
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
            ms, blocks = interleaved(sessions, inputs, args.seconds)
            print(
                f"| {shape} | {threads} | {ms['export']:.2f} | {ms['none']:.2f} | {ms['mha']:.2f} "
                f"| {ms['mha/none']:.3f} | {ms['copy/mha']:.3f} | {blocks} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
