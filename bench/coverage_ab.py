"""One coverage cell, re-measured: ``fast`` against ORT default on one corpus model at one shape (issue 17).

Run ``python -m bench.coverage_ab ARCH EXPORTER [--size tiny|bench] [--shapes 1x64 8x256] [--seconds 20]
[--job-benchmark-seconds S] [--fast PATH] [--profile DIR]``.

``bench.coverage`` times three variants for a few seconds per shape; a cell it marks "slower" may be the
host. This script takes the upload (``corpus.cached``, built by ``bench.coverage`` or ``tests.models.corpus``)
and the ``fast`` artifact (``onnxforge optimize --preset fast`` run as ``bench.coverage`` runs it, or
``--fast PATH``) and times, in one process, interleaved blocks whose order rotates:

* ``ort_default``: the upload under ORT's default level (what ``bench.coverage`` calls ORT default);
* ``fast``: the artifact with its session recipe (``workers.sessions.make_session``, as ``bench.coverage``);
* ``fast_copy``: a second session of the same artifact, an A/A control whose ratio to ``fast`` is the noise.

Per shape it prints the medians over blocks and the median of the per-block ratios (paired, same load), with
``core.verdict.slower_beyond_noise``'s verdict. ``--profile DIR`` then runs each of ``ort_default`` and
``fast`` under ORT's profiler at each shape and prints the op-type totals (ms per run, the kernels'
``dur``) side by side, which is where a fusion that loses shows. Writes nothing but the profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.coverage import interleave, run_job  # noqa: E402
from core.recipe import read_recipe  # noqa: E402
from core.verdict import slower_beyond_noise  # noqa: E402
from tests.models import corpus  # noqa: E402
from workers.sessions import make_session  # noqa: E402


def _upload(arch: str, exporter: str, size: str) -> Path:
    info = None
    if size == "tiny" and arch in corpus.COMMITTED:
        info = corpus.cached(arch, exporter, size, corpus.COMMITTED_DIR)
    info = info or corpus.cached(arch, exporter, size)
    if info is None or not info.get("ok"):
        raise SystemExit(f"{arch}/{exporter} ({size}) is not built: run python -m bench.coverage --only {arch}")
    return Path(info["path"])


def _sessions(upload: Path, fast: Path) -> dict:
    recipe = read_recipe(fast)
    return {
        "ort_default": make_session(upload, intra_op_threads=1, optimize=True),
        "fast": make_session(fast, intra_op_threads=1, optimize=True, recipe=recipe),
        "fast_copy": make_session(fast, intra_op_threads=1, optimize=True, recipe=recipe),
    }


def _interleave(sessions: dict, feeds: dict, seconds: float, min_blocks: int) -> dict[str, list[float]]:
    keys = list(sessions)
    per = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sessions.items()}
    ref = None
    for k in keys:  # warm up, and the outputs must agree before any timing means anything
        out = sessions[k].run(None, per[k])
        if ref is None:
            ref = out
        elif not all(np.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(ref, out, strict=True)):
            raise SystemExit(f"{k} disagrees with {keys[0]}")
    return interleave(sessions, feeds, seconds, min_blocks)


def profiled_session(path: Path, recipe: dict | None, prefix: str) -> Any:
    """A profiling ORT session of ``path`` at ORT_ENABLE_ALL and 1 thread, with the job's session recipe applied
    as the service applies it (``warmup`` aside); profiles written under ``prefix``."""
    import onnxruntime as ort

    from core.recipe import apply_recipe, sanitize_recipe

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    providers: list = ["CPUExecutionProvider"]
    if recipe:
        with warnings.catch_warnings():  # as workers.sessions.make_session applies it
            warnings.simplefilter("ignore")
            recipe = {k: v for k, v in sanitize_recipe(dict(recipe)).items() if k != "warmup"}
        options, providers = apply_recipe(recipe, options, target="cpu")
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


def _op_totals(path: Path, recipe: dict | None, feeds: dict, runs: int, prefix: str) -> dict[str, float]:
    """ms per run by op type from ORT's profiler (kernel events only)."""
    sess = profiled_session(path, recipe, prefix)
    feed = {i.name: feeds[i.name] for i in sess.get_inputs()}
    for _ in range(3):
        sess.run(None, feed)
    for _ in range(runs):
        sess.run(None, feed)
    events = json.loads(Path(sess.end_profiling()).read_text())
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            totals[ev["args"]["op_name"]] += ev["dur"] / 1000.0
    return {k: v / (runs + 3) for k, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coverage_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", choices=sorted(corpus.ARCHS))
    parser.add_argument("exporter", choices=corpus.EXPORTERS)
    parser.add_argument("--size", choices=corpus.SIZES, default="tiny")
    parser.add_argument("--shapes", nargs="+", default=["1x64", "8x256"], help="BATCHxSEQ (default 1x64 8x256)")
    parser.add_argument("--seconds", type=float, default=20.0, help="timing per shape (default 20)")
    parser.add_argument("--min-blocks", type=int, default=30)
    parser.add_argument("--job-benchmark-seconds", type=float, default=None)
    parser.add_argument("--fast", type=Path, help="an artifact of the upload instead of running the job")
    parser.add_argument("--keep", type=Path, help="copy the job's artifact here")
    parser.add_argument("--profile", type=Path, help="write ORT profiles here and print op-type totals")
    args = parser.parse_args(argv)
    print("command: python -m bench.coverage_ab " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    upload = _upload(args.arch, args.exporter, args.size)
    with tempfile.TemporaryDirectory(prefix="coverage-ab-") as tmp:
        fast = args.fast
        if fast is None:
            job = run_job(upload, Path(tmp), args.job_benchmark_seconds, 1800.0)
            if not job["ok"]:
                raise SystemExit(f"job failed: {job['error']}")
            print(f"job: {job['decision']} ({job['decision_reason']}); gate speedup {job['gate_speedup']}")
            print(f"job input sets: {', '.join(job['input_sets'])}; applied: {', '.join(job['applied'])}")
            fast = Path(job["path"])
            if args.keep:
                args.keep.write_bytes(fast.read_bytes())
        sessions = _sessions(upload, fast)
        for shape in args.shapes:
            batch, seq = (int(v) for v in shape.split("x"))
            feeds = corpus.feeds(args.arch, args.size, batch, seq, seed=1)
            load = os.getloadavg()[0]
            times = _interleave(sessions, feeds, args.seconds, args.min_blocks)
            med = {k: float(np.median(v)) for k, v in times.items()}
            base = np.asarray(times["ort_default"])
            verdict = slower_beyond_noise(times["ort_default"], times["fast"])
            control = float(np.median(np.asarray(times["fast_copy"]) / np.asarray(times["fast"])))
            print(
                f"{args.arch}/{args.exporter} b{batch}/s{seq}: {len(base)} blocks, load {load:.2f} -> "
                f"{os.getloadavg()[0]:.2f}; median ms "
                + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
                + f"; fast over ORT default {med['ort_default'] / med['fast']:.2f}x (paired median "
                f"{float(np.median(base / np.asarray(times['fast']))):.2f}x, slower beyond noise: {verdict.slower}); "
                f"A/A fast_copy/fast {control:.3f}"
            )
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                runs = max(20, int(2000 / max(med["ort_default"], 0.01)) // 10)
                tag = f"{args.arch}_{args.exporter}_b{batch}s{seq}"
                a = _op_totals(upload, None, feeds, runs, str(args.profile / f"{tag}_ort_default"))
                b = _op_totals(fast, read_recipe(fast), feeds, runs, str(args.profile / f"{tag}_fast"))
                print(f"  op-type ms per run ({runs + 3} runs each): op | ort_default | fast")
                for op in sorted(set(a) | set(b), key=lambda o: -max(a.get(o, 0.0), b.get(o, 0.0))):
                    print(f"    {op:32s} {a.get(op, 0.0):8.3f} {b.get(op, 0.0):8.3f}")
                print(f"    {'total':32s} {sum(a.values()):8.3f} {sum(b.values()):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
