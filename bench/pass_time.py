"""Wall time of single passes of the ``fast`` preset, two revisions interleaved, and whether they produce the same.

Each pass runs in a fresh process from each tree (``--before REV``: that revision's ``git archive``; ``--after``:
another revision, else the working tree) on the same input: the model after the fast preset's earlier passes,
built once by the after tree. Rounds alternate which tree goes first. Printed per model and pass: the median
seconds of the pass call (imports and loading excluded), the after/before ratio, and whether the two trees'
artifacts are byte-identical and their non-match reasons equal (sha256 of each).

    python -m bench.pass_time --before REV --model corpus:bart/ts_eager --passes fuse_gqa fuse_transformer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.job_time import REPO, extract, subject

PREPARE = """
import sys, onnx_ir as ir
from passes._infra import PassContext
from passes.registry import PRESETS, build_passes
model, wanted, out = ir.load(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
for p in build_passes(PRESETS["fast"].specs):
    if p.name in wanted:
        ir.save(model, f"{out}/{p.name}.onnx")
        wanted.remove(p.name)
        if not wanted:
            break
    model = p(model, PassContext()).model
"""

TIME = """
import hashlib, json, sys, time, onnx_ir as ir
from passes._infra import PassContext
from passes.registry import PRESETS, build_passes
name, source, artifact = sys.argv[1:4]
pas = next(p for p in build_passes(PRESETS["fast"].specs) if p.name == name)
model = ir.load(source)
started = time.perf_counter()
result = pas(model, PassContext())
seconds = time.perf_counter() - started
raw = ir.serde.serialize_model(result.model).SerializeToString()
reasons = "\\n".join(m.reason for m in result.non_matches).encode()
print("PASS " + json.dumps({"s": seconds, "model": hashlib.sha256(raw).hexdigest(),
      "reasons": hashlib.sha256(reasons).hexdigest(), "nodes": len(result.model.graph)}))
"""


def run(tree: Path, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], check=False, cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", required=True, help="corpus:ARCH/EXPORTER or bench model names")
    parser.add_argument("--passes", nargs="+", default=["fuse_gqa", "fuse_transformer"])
    parser.add_argument("--before", required=True, help="git revision of the before figures")
    parser.add_argument("--after", help="git revision of the after figures (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pass-time-") as scratch:
        trees = {"before": extract(args.before, Path(scratch) / "before")}
        trees["after"] = extract(args.after, Path(scratch) / "after") if args.after else REPO
        print(f"before {args.before}, after {args.after or 'working tree'}, load {os.getloadavg()[0]:.2f}")
        for name in args.model:
            inputs = Path(scratch) / name.replace(":", "_").replace("/", "_")
            inputs.mkdir()
            run(trees["after"], PREPARE, str(subject(name).path), ",".join(args.passes), str(inputs))
            seen: dict[tuple[str, str], list[dict]] = {}
            for round_ in range(args.rounds):
                order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
                for pas in args.passes:
                    for tree in order:
                        out = run(trees[tree], TIME, pas, str(inputs / f"{pas}.onnx"), str(inputs / "out.onnx"))
                        line = next(x for x in out.splitlines() if x.startswith("PASS "))
                        seen.setdefault((pas, tree), []).append(json.loads(line[5:]))
            for pas in args.passes:
                before, after = seen[(pas, "before")], seen[(pas, "after")]
                b, a = statistics.median(r["s"] for r in before), statistics.median(r["s"] for r in after)
                same_model = {r["model"] for r in before} == {r["model"] for r in after}
                same_reasons = {r["reasons"] for r in before} == {r["reasons"] for r in after}
                rounds = ", ".join(f"{x['s']:.2f}/{y['s']:.2f}" for x, y in zip(before, after, strict=True))
                print(
                    f"{name} {pas}: before {b:.2f} s, after {a:.2f} s, x{a / b:.2f} (rounds before/after: {rounds}); "
                    f"artifact identical: {same_model} ({after[0]['nodes']} nodes), reasons equal: {same_reasons}"
                )
        print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
