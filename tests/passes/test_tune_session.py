"""tune_session: the recipe in metadata_props is valid JSON in the agreed format and loads when applied.

The pass times sessions through the engine's measurement (``ctx.measure``), here the real one the pipeline
puts on the context (``workers.measurement.BenchmarkMeasure``)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from core.inputs import generate_input_sets
from core.recipe import RECIPE_KEY, apply_recipe, recipe_of
from passes._infra import PassContext
from passes.session.tune_session import TuneSession
from tests.passes._util import MLP_CLEANUP
from workers.measurement import BenchmarkMeasure

FAST = {"runs": 3, "threads": [0, 1], "optimization_levels": False, "max_seconds": 20}


def _model_and_samples() -> tuple[ir.Model, list[dict[str, np.ndarray]]]:
    proto = onnx.load(str(MLP_CLEANUP))
    return ir.serde.deserialize_model(proto), [s.feeds for s in generate_input_sets(proto, 2)]


def test_tune_session_writes_a_recipe_that_loads_when_applied():
    # setup
    model, samples = _model_and_samples()
    nodes = len(list(model.graph))
    # execute
    ctx = PassContext(samples=samples, measure=BenchmarkMeasure())
    result = TuneSession({**FAST, "write_default": True})(model, ctx)
    # assert
    assert result.modified and len(list(model.graph)) == nodes  # the graph is untouched
    recipe = json.loads(model.metadata_props[RECIPE_KEY])
    assert {"session_options", "session_config", "provider_options"} <= set(recipe)
    assert recipe == recipe_of(model) == result.notes["recipe"]
    assert result.counts["candidates"] == len(result.notes["candidates"]) >= 3
    options, providers = apply_recipe(recipe)
    path = MLP_CLEANUP  # same graph: the recipe must load with it
    session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    session.run(None, samples[0])
    from core.runtime import sanitize_recipe  # what core.runtime.load applies keeps every key

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = sanitize_recipe(recipe)
    assert clean["session_options"] == recipe["session_options"]


def test_tune_session_does_nothing_with_reason_when_there_are_no_samples():
    model, _ = _model_and_samples()
    result = TuneSession(FAST)(model, PassContext())
    assert not result.modified and "no samples" in result.non_matches[0].reason
    assert RECIPE_KEY not in model.metadata_props


def test_tune_session_keeps_other_recipe_keys_when_a_recipe_exists():
    model, samples = _model_and_samples()
    model.metadata_props[RECIPE_KEY] = json.dumps({"session_options": {"enable_mem_pattern": False}, "warmup": []})
    ctx = PassContext(samples=samples, measure=BenchmarkMeasure())
    result = TuneSession({**FAST, "write_default": True})(model, ctx)
    recipe = json.loads(model.metadata_props[RECIPE_KEY])
    assert result.modified and recipe["warmup"] == [] and recipe["session_options"]["enable_mem_pattern"] is False


def test_tune_session_does_nothing_with_reason_when_the_context_has_no_measurement():
    # setup
    model, samples = _model_and_samples()
    # execute
    result = TuneSession({**FAST, "write_default": True})(model, PassContext(samples=samples))
    # assert
    assert not result.modified and "no latency measurement" in result.non_matches[0].reason
    assert RECIPE_KEY not in model.metadata_props
