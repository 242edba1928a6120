"""bench._copies: the load order of several sessions per model (bench.step_ab, bench.decoders_genai)."""

from __future__ import annotations

import pytest

from bench._copies import load_copies, pick, rotated


def test_load_copies_round_robin_rotated_after_a_ballast() -> None:
    loaded: list[str] = []

    def make(item: str) -> str:
        loaded.append(item)
        return f"{item}{sum(1 for x in loaded if x == item)}"

    ballast, sessions = load_copies(["a", "b", "c"], 3, make)
    assert ballast == "a1"
    # Each round starts one model further on: no model always loads first (or last).
    assert loaded == ["a", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert sessions == [["a2", "a3", "a4"], ["b1", "b2", "b3"], ["c1", "c2", "c3"]]


def test_rotated_and_pick() -> None:
    assert rotated(range(4), 1) == [1, 2, 3, 0]
    assert rotated([5, 6], 3) == [6, 5]
    assert rotated([], 2) == []
    assert [pick(["x", "y", "z"], turn) for turn in range(5)] == ["x", "y", "z", "x", "y"]


def test_load_copies_needs_one() -> None:
    with pytest.raises(ValueError):
        load_copies(["a"], 0, str)
