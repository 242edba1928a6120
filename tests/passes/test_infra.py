"""passes/_infra.py: the pass contract that ``Pass.__call__`` enforces, and the no-op defaults of the base.

The passes below are test-only: each breaks (or keeps) one clause of the contract on a real model."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from pydantic import Field

from core.errors import InvalidPassOptionsError, PassError
from passes._infra import InputChange, Pass, PassContext, PassOptions, PassResult
from tests.passes._util import MLP_CLEANUP


def _model() -> ir.Model:
    return ir.serde.deserialize_model(onnx.load(str(MLP_CLEANUP)))


class _WritesAdapter(Pass):
    name = "test_writes_adapter"
    summary = "test only: adds a side file, declared or not"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        ctx.side_files[".onnx_adapter"] = b"weights"
        return PassResult(model, True, verify_with_side_file=".onnx_adapter")


class _DeclaresAdapter(_WritesAdapter):
    name = "test_declares_adapter"
    adds_files = (".onnx_adapter",)


class _ChangesInputsUndeclared(Pass):
    name = "test_changes_inputs_undeclared"
    summary = "test only: says it changed the inputs without declaring it"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return PassResult(model, True, inputs_changed=InputChange([{"name": "x", "dtype": "uint8"}], [], 0))


def test_pass_raises_pass_error_when_it_adds_a_side_file_it_does_not_declare():
    with pytest.raises(PassError) as info:
        _WritesAdapter()(_model(), PassContext())
    assert info.value.pass_name == "test_writes_adapter" and "adds_files" in info.value.message


def test_pass_returns_side_file_to_verify_with_when_it_declares_the_file():
    # setup
    ctx = PassContext()
    # execute
    result = _DeclaresAdapter()(_model(), ctx)
    # assert
    assert result.verify_with_side_file == ".onnx_adapter" and ctx.side_files == {".onnx_adapter": b"weights"}


def test_pass_raises_pass_error_when_it_asks_to_verify_with_an_undeclared_file():
    class AsksOnly(Pass):
        name = "test_asks_only"
        summary = "test only"

        def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
            return PassResult(model, True, verify_with_side_file=".onnx_adapter")

    with pytest.raises(PassError) as info:
        AsksOnly()(_model(), PassContext())
    assert "not in its adds_files" in info.value.message


def test_pass_raises_pass_error_when_it_changes_inputs_without_declaring_changes_inputs():
    with pytest.raises(PassError) as info:
        _ChangesInputsUndeclared()(_model(), PassContext())
    assert "changes_inputs" in info.value.message


def test_pass_declares_nothing_special_when_it_keeps_the_base_defaults(tmp_path: Path):
    # setup
    p = _DeclaresAdapter()
    # execute
    p.confine_paths(tmp_path)  # no file options: nothing to confine, nothing raised
    # assert
    assert p.raw_inputs() == {}
    assert (Pass.changes_inputs, Pass.may_freeze_axes, Pass.adds_files) == (False, False, ())
    assert PassContext().measure is None


class _Limit(PassOptions):
    limit: int = Field(3, description="test only: a bound")


class _Typed(Pass[_Limit]):
    name = "test_typed"
    summary = "test only: options declared by the type argument"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return PassResult(model, False, {"limit": self.options.limit})


class _TypedChild(_Typed):
    name = "test_typed_child"


def test_pass_validates_options_against_its_type_argument_when_declared_as_pass_of_options():
    # execute
    result = _Typed({"limit": 7})(_model(), PassContext())
    # assert
    assert _Typed.Options is _Limit and _TypedChild.Options is _Limit
    assert result.counts == {"limit": 7} and _Typed.options_schema()["properties"]["limit"]["default"] == 3
    with pytest.raises(InvalidPassOptionsError):
        _Typed({"limt": 7})


def test_pass_refuses_the_class_when_its_options_contradict_its_type_argument():
    with pytest.raises(TypeError, match="differs from the Pass"):

        class Contradicts(Pass[_Limit]):
            name = "test_contradicts"
            summary = "test only"
            Options = PassOptions

    with pytest.raises(TypeError, match="takes a PassOptions subclass"):

        class NotOptions(Pass[int]):  # type: ignore[type-var]
            name = "test_not_options"
            summary = "test only"
