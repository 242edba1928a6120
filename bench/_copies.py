"""Several sessions per model, loaded so that no model's timing rests on one session's memory placement (issue 19's
decoder A/Bs: ``bench.step_ab``, ``bench.decoders_genai``).

Sessions of one file in one process decode 10-15% apart on the shared host (6 sessions of one ``fast`` artifact:
6.14 to 7.00 ms per step at 1 thread), and the first session a process loads was the slow one in 3 of 4 runs: one
session per model lets where its weights landed pass for the graph's cost. So each model gets ``copies``
sessions, loaded round-robin with the order rotated per round (loaded round-robin without the rotation, the
model listed first still measured 3-5% slower), after one session that is never timed; the timing loop uses a
model's copies in turn (``pick``), and its medians run over all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Session = TypeVar("Session")


def load_copies(
    items: Sequence[Item], copies: int, make: Callable[[Item], Session]
) -> tuple[Session, list[list[Session]]]:
    """``(ballast, sessions)``: ``sessions[k]`` holds ``copies`` sessions of ``items[k]``, loaded in round ``c`` in
    the order ``k = c, c+1, ..`` (mod the number of items); ``ballast``, a session of ``items[0]`` loaded before
    them all, is the one never to time. Keep it referenced until the timings end, so the others keep the
    placement they were loaded with."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    ballast = make(items[0])
    sessions: list[list[Session]] = [[] for _ in items]
    for c in range(copies):
        for k in rotated(range(len(items)), c):
            sessions[k].append(make(items[k]))
    return ballast, sessions


def rotated(order: Sequence[int] | range, shift: int) -> list[int]:
    """``order`` started at its ``shift``-th element (mod its length), wrapping round."""
    order = list(order)
    if not order:
        return order
    shift %= len(order)
    return order[shift:] + order[:shift]


def pick(copies_of: Sequence[Session], turn: int) -> Session:
    """The copy a timing round ``turn`` uses: each in turn."""
    return copies_of[turn % len(copies_of)]
