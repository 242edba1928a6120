"""Settings read from the environment as deploy/env.example writes it: an empty value is an unset one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.broker import celery_config
from core.settings import Settings, render_env_example
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in [n for n in os.environ if n.startswith("ONNXFORGE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONNXFORGE_STORAGE__DATA_DIR", str(tmp_path / "data"))
    yield


def test_settings_treat_empty_broker_and_database_url_as_unset_when_read_from_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ONNXFORGE_BROKER__URL", "")
    monkeypatch.setenv("ONNXFORGE_DATABASE__URL", "")
    monkeypatch.setenv("ONNXFORGE_DATABASE__SCHEMA_NAME", "")

    settings = Settings()

    assert settings.broker.url is None
    assert settings.database.url is None
    assert settings.database.schema_name is None
    assert settings.embedded
    assert settings.database_url.startswith("sqlite:///")
    # Celery gets the embedded filesystem queue, not its own amqp:// default for an empty URL.
    assert celery_config(settings)["broker_url"] == "filesystem://localhost//"


def test_settings_refuse_production_when_broker_and_database_url_are_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFORGE_ENVIRONMENT", "production")
    monkeypatch.setenv("ONNXFORGE_BROKER__URL", "")
    monkeypatch.setenv("ONNXFORGE_DATABASE__URL", "")

    with pytest.raises(ValidationError, match="environment=production needs ONNXFORGE_BROKER__URL"):
        Settings()


def test_settings_treat_empty_url_as_unset_when_given_to_the_constructor() -> None:
    settings = Settings(broker={"url": "  "}, database={"url": ""})

    assert settings.embedded
    assert settings.database.url is None


def test_settings_accept_every_unset_value_of_env_example_when_loaded_as_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generated env.example, loaded as is, gives the defaults (nothing "" where None was meant)."""
    for line in render_env_example().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            if name != "ONNXFORGE_STORAGE__DATA_DIR":
                monkeypatch.setenv(name, value)

    settings = Settings()

    assert settings.embedded
    assert settings.database.url is None
    assert settings.auth.keys_file is None


def test_serve_refuses_to_start_when_production_has_empty_broker_url(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")} | {
        "ONNXFORGE_ENVIRONMENT": "production",
        "ONNXFORGE_BROKER__URL": "",
        "ONNXFORGE_DATABASE__URL": "",
        "ONNXFORGE_STORAGE__DATA_DIR": str(tmp_path / "data"),
    }

    result = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", "serve", "--port", "0"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip

    assert result.returncode != 0
    assert "environment=production needs ONNXFORGE_BROKER__URL" in result.stderr
    assert not (tmp_path / "data" / "onnxforge.db").exists()


def test_settings_put_job_scratch_on_local_disk_when_scratch_dir_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert Settings().storage.work_dir == (tmp_path / "data" / "work").resolve()  # unset: the shared volume

    monkeypatch.setenv("ONNXFORGE_STORAGE__SCRATCH_DIR", str(tmp_path / "local" / ".." / "scratch"))

    assert Settings().storage.work_dir == (tmp_path / "scratch").resolve()
