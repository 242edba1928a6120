"""A fuse_transformer candidate that fails without a message still says where (issue 17, held-out round 7).

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
