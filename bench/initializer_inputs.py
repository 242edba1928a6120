"""What ``initializer_inputs`` buys: a CNN exported with ``keep_initializers_as_inputs=True`` (issue 17).

Run ``python -m bench.initializer_inputs [--seconds S]`` (the dev extra's torch builds the model).

A ResNet-style stack (a stem and six Conv-BatchNorm-ReLU blocks with residual Adds, 32-64 channels, global
pooling, a linear head; random weights, BatchNorm statistics moved) is exported twice with the TorchScript
exporter (opset 17, dynamic batch): as users export it, and with ``keep_initializers_as_inputs=True`` (every
weight also a graph input, so ONNX Runtime may fold none of them). ``onnxforge optimize --preset fast`` runs on
the second as a new user sends it. Then, at ORT's default level on 1 intra-op thread, interleaved in rotating
blocks: the listed upload, the job's artifact, and the plain export (what the artifact should match). Medians in
milliseconds at batch 1 and 8 (64 x 64 images), and the ratios to the listed upload.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from bench.coverage import run_job  # noqa: E402
from bench.fusions import interleaved, session  # noqa: E402


def _export(path: Path, keep: bool) -> None:
    import torch

    from bench.heldout_detection import _perturb

    def block(cin: int, cout: int, stride: int = 1) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()
        )

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = block(3, 32, 2)
            self.stages = torch.nn.ModuleList([block(32, 32), block(32, 32), block(32, 64, 2)])
            self.tail = torch.nn.ModuleList([block(64, 64), block(64, 64), block(64, 64)])
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x):
            x = self.stem(x)
            x = x + self.stages[1](self.stages[0](x))
            x = self.stages[2](x)
            x = x + self.tail[1](self.tail[0](x))
            x = self.tail[2](x)
            return self.head(x.mean((2, 3)))

    torch.manual_seed(0)
    model = Net()
    _perturb(model)
    model.eval()
    torch.onnx.export(model, (torch.rand(1, 3, 64, 64),), str(path), dynamo=False, opset_version=17,
                      input_names=["pixel_values"], output_names=["logits"],
                      dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
                      keep_initializers_as_inputs=keep)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.initializer_inputs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timing per batch size (default 20)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        listed, plain = work / "listed.onnx", work / "plain.onnx"
        _export(listed, keep=True)
        _export(plain, keep=False)
        (work / "job").mkdir()
        job = run_job(listed, work / "job", benchmark_seconds=1, timeout=900)
        if not job.get("ok"):
            print("job failed:", job.get("error"))
            return 1
        print(f"job: {job['decision']}, passes {', '.join(job['applied'])}, gate x{job.get('gate_speedup') or 0:.2f}")
        print(f"inputs: upload {len(onnx.load(str(listed)).graph.input)}, artifact "
              f"{len(onnx.load(job['path']).graph.input)}")  # fmt: skip
        models = {"listed upload": listed, "artifact": Path(job["path"]), "plain export": plain}
        sessions = {name: session(path.read_bytes()) for name, path in models.items()}
        print("| batch | listed upload (ms) | artifact (ms) | plain export (ms) | artifact / upload | blocks |")
        print("|---|---|---|---|---|---|")
        for batch in (1, 8):
            feeds = {"pixel_values": np.random.default_rng(batch).random((batch, 3, 64, 64), dtype=np.float32)}
            medians, blocks = interleaved(sessions, feeds, args.seconds, inner=5)
            ms = {k: v / 1000 for k, v in medians.items()}
            print(f"| {batch} | {ms['listed upload']:.3f} | {ms['artifact']:.3f} | {ms['plain export']:.3f} | "
                  f"x{ms['listed upload'] / ms['artifact']:.2f} | {blocks} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
