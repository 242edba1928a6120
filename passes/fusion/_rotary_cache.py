"""The cos/sin caches ``com.microsoft::RotaryEmbedding`` reads, [max_positions, rotary_dim / 2], as constants.

The op looks rows up by position instead of computing ``cos(position * inv_freq)`` per call, so the rows are
computed here exactly as the graph computed them: the angle as one float32 product (the graph's ``Mul`` or
single-term ``MatMul``), the cosine rounded from float64, then the graph's ``attention_scaling`` in float32.
Where the exporter folded the table (``Gather(cos_cached, position_ids)``) its rows are taken as they are.

How many rows: a folded table has its own; a graph computing angles says nothing about its context length,
so ``max_positions`` comes from the pass option, else the model's ``max_position_embeddings`` metadata, else
``DEFAULT_MAX_POSITIONS``. ORT's kernel refuses a position at or past the last row (``position_ids value N
is out of range``) rather than reading past it, so a longer context fails loudly, never silently wrong.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_match import CosSin

DEFAULT_MAX_POSITIONS = 4096
_METADATA_KEYS = ("max_position_embeddings", "max_positions", "n_positions", "max_sequence_length")


def metadata_max_positions(model: ir.Model) -> int | None:
    for key in _METADATA_KEYS:
        text = model.metadata_props.get(key)
        if text is not None and text.strip().isdigit() and int(text) > 0:
            return int(text)
    return None


def rows(factor: CosSin, max_positions: int, op: str) -> np.ndarray:
    """The cache for one factor (``op`` is "cos" or "sin"), float32 [positions, rotary_dim / 2]."""
    if factor.kind == "table":
        table = factor.values
    else:
        positions = np.arange(max_positions, dtype=np.float32)[:, None]
        angles = (positions * factor.values[None, :]).astype(np.float32)
        table = (np.cos if op == "cos" else np.sin)(angles.astype(np.float64)).astype(np.float32)
    return (table * np.float32(factor.scale)).astype(np.float32) if factor.scale != 1.0 else table


def rope_theta(inv_freq: np.ndarray) -> float | None:
    """The base of default rope, ``inv_freq[i] = theta ** (-2i / rotary_dim)``; None for a scaled variant
    (linear, dynamic, YaRN, llama3) whose frequencies do not follow it."""
    half = inv_freq.size
    if half < 2 or inv_freq[0] != 1.0 or not np.all(inv_freq > 0):
        return None
    theta = float(inv_freq[1]) ** (-half)
    expected = theta ** (-np.arange(half, dtype=np.float64) / half)
    if not np.allclose(inv_freq, expected, rtol=1e-4):
        return None
    return float(np.round(theta, 1 if theta < 1e4 else 0))
