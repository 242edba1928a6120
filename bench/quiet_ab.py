"""Coverage cells timed on a quiet host: the upload against everything ``fast`` does, with an A/A control (issue 17).

The development hosts are 2 shared CPUs whose two sessions of identical bytes run 5-6.5% apart at 8x256
(``bench.mha_padding_mask``), so a cell of ``docs/coverage.md`` within 0.92-0.96x cannot be read there. This
script moves the timing, not the job, to a quiet machine (the device machine's CPUs, which have no torch of
this project's version and get at most 64 MiB of files):

* ``python -m bench.quiet_ab pack --out DIR [--size bench] ARCH/EXPORTER ...`` (here): builds nothing but
  what ``python -m tests.models.corpus --size SIZE --only ARCH --exporters EXPORTER`` built; runs ``onnxforge
  optimize --preset fast`` on it with ``ONNXFORGE_PIPELINE__ROLLBACK_SLOWER=false`` and ``benchmark: false``
  (every pass of the preset kept, verified as a job verifies: the question is whether what ``fast`` does is
  slower, which the job's gate cannot answer on a loaded host), and writes both graphs with each float32
  initializer of 4 KiB or more left as a shape without data, the feeds of each shape (``corpus.feeds``) and the
  artifact's session recipe.
* ``python bench/quiet_ab.py run DIR [--seconds S] [--threads 1 2]`` (there; numpy, onnx, onnxruntime and
  ``core.recipe``): fills each stripped weight with seeded normal values (speed does not depend on the values;
  zeros or denormals would), then per cell, shape and thread count times ``ort_default`` (the upload at ORT's
  default level), ``fast`` (the artifact with its recipe) and ``fast_copy`` (a second session of it, the A/A)
  interleaved in blocks whose order rotates, and prints medians, the paired per-block ratio and the A/A ratio.

The outputs of the two graphs are not compared there (their weights are drawn independently); the job that
wrote the artifact verified it against the upload here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STRIP_BYTES = 4096
SHAPES = ("1x64", "8x256")
_DROPPED = "dropped.bin"  # never written: the run side refills these tensors


def strip(model: onnx.ModelProto) -> int:
    """Turns each large float32 initializer into external data pointing at a file that does not exist."""
    stripped = 0
    for tensor in model.graph.initializer:
        data = onnx.numpy_helper.to_array(tensor) if tensor.data_type == onnx.TensorProto.FLOAT else None
        if data is None or data.nbytes < STRIP_BYTES:
            continue
        tensor.raw_data = b"\0"  # set_external_data requires the field it is about to replace
        tensor.ClearField("float_data")
        onnx.external_data_helper.set_external_data(tensor, location=_DROPPED, offset=0, length=data.nbytes)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        stripped += data.nbytes
    return stripped


def refill(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        values = (rng.standard_normal(tuple(tensor.dims)) * 0.02).astype(np.float32)
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = values.tobytes()
    return model


# ------------------------------------------------------------------------------------------------ pack (here)


def _fast_config(fuse_options: dict) -> dict:
    """``fast`` itself, or its pass list with fuse_transformer's options overridden (a variant to compare)."""
    if not fuse_options:
        return {"preset": "fast", "benchmark": False}
    from passes.registry import PRESETS

    passes = []
    for spec in PRESETS["fast"].passes:
        name, options = (spec, {}) if isinstance(spec, str) else (spec.name, dict(spec.options))
        if name == "fuse_transformer":
            options.update(fuse_options)
        passes.append({"name": name, "options": options} if options else name)
    return {"passes": passes, "benchmark": False}


def _fast_all_passes(upload: Path, work: Path, fuse_options: dict) -> tuple[Path, dict]:
    config = work / "config.json"
    config.write_text(json.dumps(_fast_config(fuse_options)))
    out, report = work / "fast.onnx", work / "report.json"
    env = {**os.environ, "ONNXFORGE_PIPELINE__ROLLBACK_SLOWER": "false"}
    cmd = [sys.executable, "-m", "onnxforge.cli", "optimize", str(upload), "-o", str(out)]
    cmd += ["--config", str(config), "--report", str(report)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{upload.name}: the fast job failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    rep = json.loads(report.read_text())
    applied = sorted({p["name"] for p in rep["passes"] if p["status"] == "applied"})
    worst = max((o.get("max_abs") or 0.0 for o in rep["verification"]["outputs"]), default=0.0)
    return out, {"applied": applied, "verified": rep["verification"]["ok"], "max_abs": worst}


def pack(cells: list[str], size: str, out: Path, variants: dict[str, dict]) -> None:
    from core.recipe import read_recipe
    from tests.models import corpus

    out.mkdir(parents=True, exist_ok=True)
    manifest = {"size": size, "shapes": list(SHAPES), "cells": []}
    for cell in cells:
        arch, exporter = cell.split("/")
        info = corpus.cached(arch, exporter, size)
        if info is None or not info.get("ok"):
            raise SystemExit(f"{cell} ({size}) is not built: python -m tests.models.corpus --size {size} --only {arch}")
        upload = Path(info["path"])
        tag, entry = f"{arch}_{exporter}", {"cell": cell, "tag": f"{arch}_{exporter}", "variants": {}}
        model = onnx.load(str(upload))
        strip(model)
        onnx.save(model, str(out / f"{tag}_upload.onnx"))
        for label, fuse_options in variants.items():
            with tempfile.TemporaryDirectory(prefix="quiet-ab-") as tmp:
                fast, job = _fast_all_passes(upload, Path(tmp), fuse_options)
                model = onnx.load(str(fast))
                strip(model)
                onnx.save(model, str(out / f"{tag}_{label}.onnx"))
                entry["variants"][label] = {"fuse_transformer": fuse_options, "recipe": read_recipe(fast), **job}
            print(
                f"{cell} {label}: applied {', '.join(job['applied'])}; "
                f"verified {job['verified']} ({job['max_abs']:.1e})"
            )
        feeds = {}
        for shape in SHAPES:
            batch, seq = (int(v) for v in shape.split("x"))
            feeds.update({f"{shape}/{k}": v for k, v in corpus.feeds(arch, size, batch, seq, seed=1).items()})
        np.savez(out / f"{tag}_feeds.npz", **feeds)
        manifest["cells"].append(entry)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ------------------------------------------------------------------------------------------------ run (there)


def _session(path: Path, threads: int, recipe: dict | None, seed: int, profile: str | None = None):
    import onnxruntime as ort

    from core.recipe import apply_recipe, sanitize_recipe

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    providers: list = ["CPUExecutionProvider"]
    if recipe:
        recipe = {k: v for k, v in sanitize_recipe(dict(recipe)).items() if k != "warmup"}
        options, providers = apply_recipe(recipe, options, target="cpu")
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    model = refill(onnx.load(str(path), load_external_data=False), seed)
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)


def _interleave(sessions: dict, feeds: dict, seconds: float, min_blocks: int) -> dict[str, np.ndarray]:
    keys = list(sessions)
    per = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sessions.items()}
    for k in keys:
        for _ in range(3):
            sessions[k].run(None, per[k])
    times: dict[str, list[float]] = {k: [] for k in keys}
    start, block = time.perf_counter(), 0
    while block < min_blocks or time.perf_counter() - start < seconds:
        shift = block % len(keys)
        for k in keys[shift:] + keys[:shift]:
            t0 = time.perf_counter_ns()
            sessions[k].run(None, per[k])
            times[k].append((time.perf_counter_ns() - t0) / 1e6)
        block += 1
    return {k: np.asarray(v) for k, v in times.items()}


def _op_totals(path: Path, recipe: dict | None, feeds: dict, runs: int) -> dict[str, float]:
    """ms per run by op type from ORT's profiler (kernel events), 1 thread."""
    session = _session(path, 1, recipe, 1, profile=str(path.with_suffix("")))
    feed = {i.name: feeds[i.name] for i in session.get_inputs()}
    for _ in range(runs + 2):
        session.run(None, feed)
    totals: dict[str, float] = {}
    for event in json.loads(Path(session.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            totals[op] = totals.get(op, 0.0) + event["dur"] / 1000.0 / (runs + 2)
    return totals


def profile(folder: Path, tags: list[str], shape: str, runs: int) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in (e for e in manifest["cells"] if e["tag"] in tags):
        npz = np.load(folder / f"{entry['tag']}_feeds.npz")
        feeds = {k.split("/", 1)[1]: npz[k] for k in npz.files if k.startswith(f"{shape}/")}
        totals = {"ort_default": _op_totals(folder / f"{entry['tag']}_upload.onnx", None, feeds, runs)}
        for label, variant in entry["variants"].items():
            totals[label] = _op_totals(folder / f"{entry['tag']}_{label}.onnx", variant["recipe"], feeds, runs)
        print(f"{entry['cell']} {shape}, 1 thread, ms per run by op type: op | " + " | ".join(totals))
        ops = sorted(
            {op for t in totals.values() for op in t}, key=lambda o: -max(t.get(o, 0.0) for t in totals.values())
        )
        for op in [*ops, "total"]:
            row = [sum(t.values()) if op == "total" else t.get(op, 0.0) for t in totals.values()]
            print(f"  {op:28s} " + " ".join(f"{v:9.3f}" for v in row), flush=True)


def run(
    folder: Path, seconds: float, threads: list[int], min_blocks: int, *, shapes: list[str], only: list[str]
) -> None:
    import onnxruntime as ort

    manifest = json.loads((folder / "manifest.json").read_text())
    cells = [e for e in manifest["cells"] if not only or e["cell"] in only]
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()}, size {manifest['size']}")
    print(
        "| cell | variant | shape | threads | ORT default ms | variant ms | variant over ORT default (paired) | A/A |"
        " blocks |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for entry in cells:
        tag = entry["tag"]
        npz = np.load(folder / f"{tag}_feeds.npz")
        labels = list(entry["variants"])
        for n in threads:
            sessions = {"ort_default": _session(folder / f"{tag}_upload.onnx", n, None, 1)}
            for label in labels:
                sessions[label] = _session(folder / f"{tag}_{label}.onnx", n, entry["variants"][label]["recipe"], 2)
            sessions["copy"] = _session(
                folder / f"{tag}_{labels[0]}.onnx", n, entry["variants"][labels[0]]["recipe"], 2
            )
            for shape in shapes or manifest["shapes"]:
                feeds = {k.split("/", 1)[1]: npz[k] for k in npz.files if k.startswith(f"{shape}/")}
                t = _interleave(sessions, feeds, seconds, min_blocks)
                aa = float(np.median(t["copy"] / t[labels[0]]))
                for label in labels:
                    paired = float(np.median(t["ort_default"] / t[label]))
                    print(
                        f"| {entry['cell']} | {label} | {shape} | {n} | {np.median(t['ort_default']):.3f} | "
                        f"{np.median(t[label]):.3f} | {paired:.3f}x | {aa:.3f} | {len(t[label])} |",
                        flush=True,
                    )
    print(f"load at the end {os.getloadavg()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quiet_ab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="run the fast jobs here and write stripped graphs, feeds and recipes")
    p.add_argument("cells", nargs="+", help="ARCH/EXPORTER, built by python -m tests.models.corpus")
    p.add_argument("--size", default="bench")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--variant",
        nargs=2,
        action="append",
        metavar=("LABEL", "JSON"),
        help="also pack fast with fuse_transformer's options overridden, e.g. nopack '{\"pack_qkv\": false}'",
    )
    r = sub.add_parser("run", help="time a packed folder (on the quiet host)")
    r.add_argument("folder", type=Path)
    r.add_argument("--seconds", type=float, default=6.0, help="timing per cell, shape and thread count")
    r.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    r.add_argument("--min-blocks", type=int, default=20)
    r.add_argument("--shapes", nargs="+", default=[], help="BATCHxSEQ (default: the packed ones)")
    r.add_argument("--only", nargs="+", default=[], help="cells (default: all packed)")
    r.add_argument("--profile", nargs="+", default=[], help="tags whose op-type totals to print after the timing")
    r.add_argument("--profile-runs", type=int, default=10)
    args = parser.parse_args(argv)
    if args.verb == "pack":
        pack(args.cells, args.size, args.out, {"fast": {}, **{k: json.loads(v) for k, v in args.variant or []}})
    else:
        run(args.folder, args.seconds, args.threads, args.min_blocks, shapes=args.shapes, only=args.only)
        for shape in args.shapes or SHAPES:
            profile(args.folder, args.profile, shape, args.profile_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
