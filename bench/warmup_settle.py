"""The first runs of a benchmark session, per input set: how many warm-up runs the gate needs.

Run ``python -m bench.warmup_settle [--model corpus:vit/ts_eager ...] [--runs 7] [--repeat 2]``.

A session is built as ``workers.benchmark`` builds it (ORT_ENABLE_ALL, ``make_session``), runs each of the
gate's input sets once (as at build: the arena grows to the largest set), then ``--runs`` runs of each set in
turn; every run is timed and printed in ms. The warm-up rule (``workers.benchmark.WARMUP_SETTLE``) stops once a
run is no more than 10% faster than the one before it (warming only makes runs faster; a slower one is noise),
and that run is timed as the set's first block; this shows where that happens on a model at bench size. Prints only;
the figures depend on the host's load (printed before and after).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.job_time import subject  # noqa: E402
from core.inputs import generate_input_sets  # noqa: E402
from workers.sessions import make_session  # noqa: E402


def _timed(session: object, feed: dict) -> float:
    start = time.perf_counter()
    session.run(None, feed)  # type: ignore[attr-defined]
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["corpus:vit/ts_eager", "corpus:whisper_encoder/ts_eager"])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each set after the build runs")
    parser.add_argument("--repeat", type=int, default=2, help="fresh sessions per model, interleaved by model")
    args = parser.parse_args(argv)
    import onnx

    print(f"load before: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    paths = {name: subject(name).path for name in args.model}
    sets = {name: generate_input_sets(onnx.load(str(p), load_external_data=False), 3) for name, p in paths.items()}
    for rep in range(args.repeat):
        for name, path in paths.items():
            session = make_session(path, optimize=True)
            build = [_timed(session, s.feeds) for s in sets[name]]
            print(f"{name} #{rep} build: {' '.join(f'{t:.0f}' for t in build)}")
            for s in sets[name]:
                runs = [_timed(session, s.feeds) for _ in range(args.runs)]
                print(f"{name} #{rep} {s.name}: {' '.join(f'{t:.0f}' for t in runs)}", flush=True)
    print(f"load after: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
