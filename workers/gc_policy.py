"""The cyclic garbage collector in a process that runs one job: the imports kept out of its sight.

A job's process (``onnxforge optimize``, ``python -m workers.child``) imports ~110k long-lived objects before
its first pass (onnx_ir brings sympy, the constant folder brings onnxscript and onnx.reference). None of them
becomes garbage during the job, yet every full collection walks them all: the one before each benchmark
session is built and after one is dropped (workers/benchmark.py), the collector's own, and the interpreter's
at exit. Measured on corpus:resnet/ts_eager bench size (2 shared CPUs, load ~9): 0.37 s of collections in the
pipeline, 0.01 s with the imports frozen; the interpreter's teardown 0.25-0.35 s, ~0.1 s frozen.

``gc.freeze`` moves what exists now to the permanent generation: reference counting still frees those
objects, the cycle collector no longer visits them; what the job allocates afterwards is collected as
before. A process that exits after the job leaves them frozen, so that its exit does not walk them either;
an in-process caller (tests, embedding) gets its collector back as it was when the job ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_frozen(*, process_exits: bool) -> Iterator[None]:
    """Freeze every object tracked now for the duration of the block; ``process_exits``: the process ends
    right after it, so they stay frozen. A freeze the caller made before is never undone."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not process_exits and frozen_before == 0:
            gc.unfreeze()
