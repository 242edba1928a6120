"""What the held-out decoder tests share: a cached export through ``fast`` up to a pass, and a greedy decode
of the fused graph beside the export on a growing cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes import registry
from passes._infra import PassContext
from tests.models.build_decoders import Signature, decoder_feeds, presents_as_past
from tests.passes._util import session


def fast_upto(path: Path, through: str = "fuse_gqa") -> tuple[ir.Model, dict[str, int]]:
    """The model after the fast preset's passes up to and including ``through`` (padding_elimination left out),
    and their counts as ``"pass.count"``, summed over a pass's runs (constant_folding runs twice)."""
    model = ir.load(path)
    specs = registry.PRESETS["fast"].specs
    upto = [s for s in specs[: [s.name for s in specs].index(through) + 1] if s.name != "padding_elimination"]
    counts: dict[str, int] = {}
    for p in registry.build_passes(upto):
        result = p(model, PassContext())
        model = result.model
        for key, value in result.counts.items():
            counts[f"{p.name}.{key}"] = counts.get(f"{p.name}.{key}", 0) + value
    return model, counts


def assert_decodes_like_export(path: Path, model: ir.Model, steps: int = 5, batch: int = 2, prompt: int = 6) -> None:
    """A prefill of ``batch`` x ``prompt`` tokens on an empty cache, then one token at a time on the export's own
    cache: every output of ``model`` (at ORT's default level) equal to the export's (optimizations off) at each
    step."""
    signature = Signature.of(path)
    reference, candidate = session(path), session(model, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    feeds = decoder_feeds(signature, batch, prompt, 0, seed=3)
    for step in range(steps):
        want = dict(zip(names, reference.run(names, feeds), strict=True))
        got = dict(zip(names, candidate.run(names, feeds), strict=True))
        for name in names:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} step {step}")
        past = presents_as_past(want)
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        length = past["past_key_values.0.key"].shape[2]
        feeds = decoder_feeds(signature, batch, 1, length, tokens=tokens, past_values=past)
