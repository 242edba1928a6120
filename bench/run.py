"""Run the benchmarks one after another: ``python -m bench.run [--only NAME ...] [--list] [-- ARGS]``.

``make bench`` calls this. Each benchmark is its own module with its own options (see bench/README.md);
this runner only sequences them, in separate processes so that one benchmark's memory (a process's peak
RSS never goes down) and thread pools cannot colour the next one's figures. Arguments after ``--`` go to
every selected benchmark (``--no-write`` and ``--quick`` are understood by all of them that take them).

The reliability runs (``bench.reliability``) are not in the default set: they start their own Redis and
workers and take tens of minutes; run them by name.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (module, what it measures). Order: the cheapest first, so a broken setup fails early.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "skip_layernorm": ("bench.skip_layernorm", "issue 5: SkipLayerNormalization vs Sum + LayerNorm on the CPU EP"),
    "seed_passes": ("bench.seed_passes", "issue 4: ORT default vs the seed passes on bench-size models"),
    "presets": ("bench.presets", "issue 5: presets vs ORT default, ORT's transformers optimizer, onnxsim, int8"),
    "adapters_prepost": ("bench.adapters_prepost", "issue 10: adapter extraction and in-graph pre/post-processing"),
    "shape_profile": ("bench.shape_profile", "issue 10: session recipe for dynamic shapes (peak memory, trace time)"),
    "gpu": ("bench.gpu", "issue 7: CUDA EP figures (needs an NVIDIA GPU)"),
    "fusions": ("bench.fusions", "issue 17: fused vs unfused attention, norms and GELU per architecture"),
    "job_time": ("bench.job_time", "issue 17: a fast job's wall time vs ORT's transformers optimizer"),
    "decoders": ("bench.decoders", "issue 19: decoder prefill and decode, fp32 vs int4 vs fast"),
    "gqa": ("bench.gqa", "issue 19: decode and prefill, unfused attention vs fuse_gqa's GQA and MHA"),
    "rotary": ("bench.rotary", "issue 19: decode and prefill, decomposed rotary vs fuse_rotary's RotaryEmbedding"),
    "upload_rate": ("bench.upload_rate", "issue 20: the API's upload rate into the local and S3 stores"),
}
ON_DEMAND: dict[str, tuple[str, str]] = {
    "reliability": ("bench.reliability", "issue 6: chaos, Redis restart, uploads, load (needs a subcommand)"),
    "coverage": ("bench.coverage", "issue 17: fast on the 25-model corpus x 3 exporters (docs/coverage.md)"),
}
DEFAULT = ("skip_layernorm", "seed_passes", "presets", "adapters_prepost", "shape_profile")


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1 :]
    known = {**BENCHMARKS, **ON_DEMAND}
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=sorted(known), help=f"benchmarks to run (default: {', '.join(DEFAULT)})"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (module, what) in known.items():
            state = "" if _available(module) else " (module missing)"
            print(f"{name:18} {module:26} {what}{state}")
        return 0
    selected = args.only or list(DEFAULT)
    failed: list[str] = []
    for name in selected:
        module = known[name][0]
        if not _available(module):
            print(f"== {name}: {module} is not in this checkout", file=sys.stderr)
            failed.append(name)
            continue
        print(f"== {name}: python -m {module} {' '.join(passthrough)}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, "-m", module, *passthrough], cwd=REPO)
        print(f"== {name}: exit {code} after {time.monotonic() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
