"""GPT-J with a KV cache for tests/passes/test_fuse_rotary_interleaved.py (interleaved partial rotary, issue 17/19).

Run ``python -m tests.models.build_heldout_interleaved``: GPT-J from its config (2 layers, hidden 32, 4 heads of 8,
``rotary_dim`` 4 of 8, random weights), in Optimum's ``text-generation-with-past`` signature (``position_ids`` an
input) through ``bench.heldout_dec_past``'s builder and its checks against torch, TorchScript exporter, to
``tests/models/heldout/gptj_past_ts.onnx``. The no-cache exports the test reads come from the held-out probes as
they are: ``heldout_gptj_partial_rotary_dynamo.onnx`` (``bench.heldout_dec_nocache --only gptj --exporters
dynamo``), ``heldout_cohere_dynamo.onnx`` (``--only cohere --exporters dynamo``) and
``heldout_roformer_ts_eager.onnx`` (``bench.heldout_text --only roformer --exporters ts_eager``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from bench import heldout_dec_past as past

OUT = Path(__file__).resolve().parent / "heldout" / "gptj_past_ts.onnx"
GPTJ = past.Probe(
    "gptj",
    "GPTJConfig",
    "GPTJForCausalLM",
    kv_heads=past.HEADS,
    extra=(("rotary_dim", 4), ("n_inner", 64), ("bos_token_id", 0), ("eos_token_id", 2)),
    note="interleaved partial rotary (4 of 8), parallel residual",
)


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        info = past.build(GPTJ, "ts", reuse=False, out=Path(scratch), script="tests.models.build_heldout_interleaved")
        if not info.get("ok"):
            print(info, file=sys.stderr)
            return 1
        shutil.copyfile(info["file"], OUT)
    print(f"{OUT}: {info['nodes']} nodes, max abs vs torch {info['max_abs_vs_torch']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
