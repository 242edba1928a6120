"""A fuse_transformer candidate that fails without a message, or by a crash inside an engine, still says where
(issue 17, held-out round 7 and decoder round 10).

ORT's transformers optimizer rejected ViTDet's exports with a bare ``assert``; the report read "candidate ort
rejected: AssertionError: " and nothing else. The line that raised is named now.
"""

from __future__ import annotations

from passes.fusion.fuse_transformer import _failure


def _bare() -> None:
    raise AssertionError  # what a bare assert raises outside pytest's rewriting


def test_an_error_without_a_message_names_the_line_that_raised_it() -> None:
    try:
        _bare()
    except AssertionError as exc:
        text = _failure(exc)
    assert text.startswith("AssertionError: raised without a message at test_fuse_transformer_failure_text.py:")
    assert "(_bare: raise AssertionError" in text


def test_an_error_with_a_message_keeps_it() -> None:
    assert _failure(ValueError("shape mismatch")) == "ValueError: shape mismatch"


def test_ort_candidate_runs_when_the_head_count_is_unknown_but_the_hidden_size_is_not() -> None:
    """ORT's BertOnnxModel asserts that num_heads and hidden_size are both given and agree, or neither is:
    PEGASUS-X's heads were unknown (0) beside a hidden size of 32, and the ort candidate raised on that assert."""
    from collections import Counter

    import onnx

    from passes.fusion.fuse_transformer import _ort
    from tests.passes._util import MODELS

    proto = onnx.load(str(MODELS / "hf_bert_encoder.onnx"))
    for heads, hidden in ((0, 32), (3, 32)):  # unknown, and a count that does not divide the width
        fused = _ort(proto, "bert", heads, hidden, Counter())
        assert len(fused.graph.node) > 0


def test_an_engines_crash_names_the_line_it_raised_at() -> None:
    def crash() -> None:
        node = object()
        node[0]  # type: ignore[index]  # ORT's fusion_simplified_layernorm indexing a NodeProto, in miniature

    try:
        crash()
    except TypeError as exc:
        text = _failure(exc)
    assert text.startswith(
        "TypeError: 'object' object is not subscriptable (raised at test_fuse_transformer_failure_text.py:"
    )
    assert "(crash: node[0]" in text
