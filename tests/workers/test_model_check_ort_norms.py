"""workers/model_check.py: a model ORT's own tools wrote, with its ONNX-domain RMS norm, is accepted (issue 17).

ORT's transformers optimizer (``optimize_model``, here ``model_type="gpt2"`` as a user picks it for a Llama) and
an ORT session's ``optimized_model_filepath`` write ``SimplifiedLayerNormalization`` in the ONNX domain, which
ONNX has no schema for: ``onnxforge optimize`` refused the upload ("No Op registered for
SimplifiedLayerNormalization", ``python -m bench.heldout_export_variants --only llama --exporters ort_opt``).
The committed tiny Llama (``tests/models/corpus/llama_ts_eager.onnx``) is put through ORT's optimizer here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.models.corpus import feeds
from tests.passes._util import session
from workers.model_check import check_model

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "models" / "corpus" / "llama_ts_eager.onnx"


@pytest.fixture(scope="module")
def ort_optimized(tmp_path_factory) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    out = tmp_path_factory.mktemp("ort_opt") / "llama_ort_opt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # opt_level=0: ORT's session pass (level 1 and up) imports torch, which CI does not install; its Python
        # fusions alone write the ONNX-domain norm this file is about
        optimize_model(str(LLAMA), model_type="gpt2", num_heads=4, hidden_size=32, opt_level=0).save_model_to_file(
            str(out)
        )
    return out


def test_ort_optimizer_llama_is_accepted_and_only_its_norms_are_waived(ort_optimized) -> None:
    proto = onnx.load(str(ort_optimized))
    norms = [n for n in proto.graph.node if n.op_type == "SimplifiedLayerNormalization" and n.domain == ""]
    assert norms  # the first norm (the others became com.microsoft::SkipSimplifiedLayerNormalization): the premise
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(ort_optimized))
    check_model(ort_optimized)
    # anything else the checker refuses still fails: a norm over another axis cannot be written out and is named
    next(a for a in norms[0].attribute if a.name == "axis").i = 1
    bad = ort_optimized.with_name("axis1.onnx")
    onnx.save(proto, str(bad))
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        check_model(bad)


def test_unknown_onnx_domain_op_is_still_refused(tmp_path) -> None:
    graph = helper.make_graph(
        [helper.make_node("NotAnOp", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.zeros(1, np.float32), "unused")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(onnx.checker.ValidationError, match="NotAnOp"):
        check_model(path)


def test_ort_optimizer_llama_goes_through_a_job(ort_optimized, tmp_path) -> None:
    out, report = tmp_path / "fast.onnx", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")}
    env |= {"ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS": "0.3", "ONNXFORGE_PIPELINE__LEDGER_RUNS": "2"}
    args = ["optimize", str(ort_optimized), "-o", str(out), "--passes", "shape_inference,fuse_gqa"]
    proc = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", *args, "--report", str(report)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(report.read_text())
    assert rep["verification"]["ok"]
    fused = {p["name"]: p for p in rep["passes"]}["fuse_gqa"]
    assert fused["status"] in ("applied", "rolled_back") and fused["counts"].get("fused_gqa") == 2
    reference, returned = session(ort_optimized), session(out)
    for batch, seq in ((1, 7), (3, 23)):
        x = feeds("llama", "tiny", batch, seq, seed=seq, pad=True)
        np.testing.assert_allclose(returned.run(None, x)[0], reference.run(None, x)[0], atol=1e-4, rtol=1e-3)
