"""workers/gc_policy.py: a job's process keeps its imports out of the cycle collector's sight, without leaking
what the job itself leaves behind, and gives an in-process caller its collector back.

Each check runs in a fresh interpreter: a freeze is process-wide, and pytest's own objects must not decide it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_cli import FAST_ENV

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "models" / "mlp_cleanup.onnx"


def _python(code: str) -> list[str]:
    """The lines a fresh interpreter prints running ``code`` from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")} | FAST_ENV
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_imports_frozen_hides_the_imports_during_the_block_and_restores_the_collector_after_it():
    before, inside, after = _python(
        """
        import gc
        import numpy  # something imported, as a job's process has
        from workers.gc_policy import imports_frozen
        print(gc.get_freeze_count())
        with imports_frozen(process_exits=False):
            print(gc.get_freeze_count())
        print(gc.get_freeze_count())
        """
    )
    assert int(before) == 0
    assert int(inside) > 1000  # numpy's objects among them
    assert int(after) == 0


def test_imports_frozen_still_collects_the_cycles_the_job_leaves_behind():
    alive_after_collect, frozen_after = _python(
        """
        import gc, weakref
        from workers.gc_policy import imports_frozen

        class Node:
            pass

        with imports_frozen(process_exits=True):
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle, as an onnx_ir graph's nodes and values make
            ref = weakref.ref(a)
            del a, b
            gc.collect()
            print(ref() is not None)
        print(gc.get_freeze_count())
        """
    )
    assert alive_after_collect == "False"
    assert int(frozen_after) > 0  # the process exits next: its teardown does not walk the imports


def test_imports_frozen_leaves_a_freeze_the_caller_made_before_it():
    (after,) = _python(
        """
        import gc
        import numpy
        from workers.gc_policy import imports_frozen
        gc.freeze()
        with imports_frozen(process_exits=False):
            pass
        print(gc.get_freeze_count())
        """
    )
    assert int(after) > 1000


def test_cli_optimize_keeps_the_imports_frozen_only_when_the_process_exits_after_it(tmp_path):
    run = textwrap.dedent(
        f"""
        import atexit, gc, sys
        atexit.register(lambda: print(gc.get_freeze_count()))
        from onnxforge.cli import main
        args = ["optimize", {str(MODEL)!r}, "-o", {str(tmp_path / "out.onnx")!r}, "--preset", "safe"]
        """
    )
    # From the process's own command line (main() reads sys.argv, as `onnxforge` and `python -m` do).
    as_command = _python(run + "sys.argv[1:] = args\nrc = main()\nassert rc == 0, rc\n")
    # In process with explicit arguments (tests, embedding): the caller goes on afterwards.
    in_process = _python(run + "rc = main(args)\nassert rc == 0, rc\n")

    assert int(as_command[-1]) > 10000  # the pipeline's imports (onnx_ir, onnxscript, ORT), left frozen at exit
    assert int(in_process[-1]) == 0
