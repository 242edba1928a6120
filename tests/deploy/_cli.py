"""Shared checks: a container command is one the onnxforge CLI accepts; ONNXFORGE_* names are settings."""

from __future__ import annotations

import pytest

from core.settings import Settings


def assert_cli_accepts(argv: list[str]) -> None:
    from onnxforge.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on unknown commands or options
        pytest.fail(f"`onnxforge {' '.join(argv)}` is not accepted by the CLI (exit {exc.code})")


def assert_settings_accept_env(env: dict[str, str]) -> None:
    """Unknown nested names fail validation; unknown top-level names are checked against the fields."""
    mp = pytest.MonkeyPatch()
    try:
        for key in list(__import__("os").environ):
            if key.startswith("ONNXFORGE_"):
                mp.delenv(key)
        for key, value in env.items():
            top = key.removeprefix("ONNXFORGE_").split("__", 1)[0].lower()
            assert top in Settings.model_fields, f"{key} names no setting section or field"
            mp.setenv(key, value)
        Settings()
    finally:
        mp.undo()
