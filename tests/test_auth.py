"""API keys and tenants without a server: hashing, key files, settings validation, the open-mode decision.

The live-server side (401s, isolation on every route, upload slots) is in tests/api/test_tenants.py.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.auth import AuthenticationError, Authenticator, KeyRing
from core.errors import InvalidConfigError
from core.keys import DEFAULT_TENANT, check_key_mapping, hash_key, load_keys_file, new_key
from core.settings import Settings
from onnxforge.cli import main

KEY_A = "ofk_key-of-team-a"
KEY_B = "ofk_key-of-team-b"
PRODUCTION = {"environment": "production", "broker": {"url": "redis://h:6379/0"}, "database": {"url": "sqlite://"}}


@pytest.fixture(autouse=True)
def _no_onnxforge_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read ONNXFORGE_* from the environment; these tests say exactly what they set."""
    import os

    for name in list(os.environ):
        if name.startswith("ONNXFORGE_"):
            monkeypatch.delenv(name)


def _settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(storage={"data_dir": tmp_path}, **values)


# ------------------------------------------------------------------------------------------ hashing


def test_hash_key_is_the_sha256_hex_of_the_key() -> None:
    assert hash_key(KEY_A) == hashlib.sha256(KEY_A.encode()).hexdigest()


def test_new_key_is_random_and_prefixed() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("ofk_") and len(k) >= 40 for k in keys)


def test_keyring_returns_tenant_of_token_when_hash_configured() -> None:
    ring = KeyRing([{"team-a": [hash_key(KEY_A)]}, {"team-b": [hash_key(KEY_B), hash_key("ofk_second-b")]}])
    assert ring.tenant_for(KEY_A) == "team-a"
    assert ring.tenant_for("ofk_second-b") == "team-b"
    assert ring.tenant_for("ofk_unknown") is None
    assert ring.tenant_for(hash_key(KEY_A)) is None  # the stored hash is not a key
    assert ring.tenant_for("") is None
    assert (len(ring), ring.tenants) == (3, {"team-a", "team-b"})


def test_keyring_refuses_a_hash_configured_for_two_tenants() -> None:
    with pytest.raises(ValueError, match="both 'team-a' and 'team-b'"):
        KeyRing([{"team-a": [hash_key(KEY_A)]}, {"team-b": [hash_key(KEY_A)]}])


def test_check_key_mapping_lowercases_hashes() -> None:
    upper = hash_key(KEY_A).upper()
    assert check_key_mapping({"team-a": [upper]}, "test") == {"team-a": [upper.lower()]}


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"team-a": [KEY_A]}, "not a SHA-256 hash"),  # a plaintext key pasted by mistake
        ({"team-a": ["ab" * 31]}, "not a SHA-256 hash"),
        ({"team-a": hash_key(KEY_A)}, "needs a list"),
        ({"../x": [hash_key(KEY_A)]}, "must match"),
        ({"": [hash_key(KEY_A)]}, "must match"),
        ({"a" * 65: [hash_key(KEY_A)]}, "must match"),
        ([hash_key(KEY_A)], "expected an object"),
    ],
)
def test_check_key_mapping_refuses_when_mapping_malformed(mapping: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_key_mapping(mapping, "test")
    assert KEY_A not in str(info.value), "a plaintext key must never be echoed"


# ---------------------------------------------------------------------------------------- key files


def test_load_keys_file_reads_json(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"team-a": [hash_key(KEY_A)], "team-b": [hash_key(KEY_B)]}))
    assert load_keys_file(path) == {"team-a": [hash_key(KEY_A)], "team-b": [hash_key(KEY_B)]}


def test_load_keys_file_reads_toml(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'"team-a" = ["{hash_key(KEY_A)}"]\nteam_b = ["{hash_key(KEY_B)}"]\n')
    assert load_keys_file(path) == {"team-a": [hash_key(KEY_A)], "team_b": [hash_key(KEY_B)]}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("keys.yaml", "team-a: []", "must end in .json or .toml"),
        ("keys.json", "{not json", "not valid JSON"),
        ("keys.toml", "= nope", "not valid TOML"),
        ("keys.json", '{"team-a": ["ofk_plain"]}', "not a SHA-256 hash"),
    ],
)
def test_load_keys_file_refuses_when_file_malformed(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_keys_file(path)


def test_load_keys_file_refuses_when_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_keys_file(tmp_path / "absent.json")


# ----------------------------------------------------------------------------------------- settings


def test_settings_read_keys_from_environment_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFORGE_AUTH__KEYS", json.dumps({"team-a": [hash_key(KEY_A)]}))
    monkeypatch.setenv("ONNXFORGE_AUTH__KEYS_FILE", "")  # as deploy/env.example writes an unset value
    monkeypatch.setenv("ONNXFORGE_AUTH__OPEN_MODE", "")
    settings = _settings(tmp_path)
    assert settings.auth.keys == {"team-a": [hash_key(KEY_A)]}
    assert settings.auth.keys_file is None
    assert settings.auth.open_mode is None
    assert Authenticator.from_settings(settings).keys.tenant_for(KEY_A) == "team-a"


def test_settings_refuse_plaintext_key_in_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFORGE_AUTH__KEYS", json.dumps({"team-a": [KEY_A]}))
    with pytest.raises(ValidationError, match="not a SHA-256 hash"):
        _settings(tmp_path)


def test_settings_read_upload_slots_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXFORGE_API__MAX_CONCURRENT_UPLOADS_PER_TENANT", "5")
    assert _settings(tmp_path).api.max_concurrent_uploads_per_tenant == 5
    with pytest.raises(ValidationError):
        _settings(tmp_path, api={"max_concurrent_uploads_per_tenant": 0})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "api.example.com"])
def test_settings_refuse_open_mode_when_host_not_loopback(tmp_path: Path, host: str) -> None:
    with pytest.raises(ValidationError, match="open_mode=true"):
        _settings(tmp_path, api={"host": host}, auth={"open_mode": True})


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_settings_accept_open_mode_when_host_loopback(tmp_path: Path, host: str) -> None:
    assert _settings(tmp_path, api={"host": host}, auth={"open_mode": True}).auth.open_mode is True


def test_settings_refuse_open_mode_when_keys_configured(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="contradicts"):
        _settings(tmp_path, auth={"open_mode": True, "keys": {"team-a": [hash_key(KEY_A)]}})
    with pytest.raises(ValidationError, match="contradicts"):
        _settings(tmp_path, auth={"open_mode": True, "keys_file": tmp_path / "keys.json"})


def test_settings_refuse_open_mode_when_production(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="production"):
        _settings(tmp_path, auth={"open_mode": True}, **PRODUCTION)


# ------------------------------------------------------------------------------------ authenticator


def test_authenticator_is_open_when_no_keys_and_loopback(tmp_path: Path) -> None:
    auth = Authenticator.from_settings(_settings(tmp_path))
    assert auth.open_mode
    assert auth.authenticate(None, local_host="127.0.0.1") == DEFAULT_TENANT
    assert auth.authenticate("ofk_anything", local_host="::1") == DEFAULT_TENANT


@pytest.mark.parametrize("local_host", ["10.1.2.3", "192.168.0.2", None, "/run/onnxforge.sock"])
def test_authenticator_refuses_open_mode_when_connection_not_on_loopback(tmp_path: Path, local_host: str) -> None:
    """``uvicorn --host 0.0.0.0`` can bind beyond what api.host says: open mode then still serves loopback only."""
    auth = Authenticator.from_settings(_settings(tmp_path))
    with pytest.raises(AuthenticationError, match="loopback"):
        auth.authenticate(None, local_host=local_host)


def test_authenticator_requires_token_when_host_not_loopback(tmp_path: Path) -> None:
    auth = Authenticator.from_settings(_settings(tmp_path, api={"host": "0.0.0.0"}))
    assert not auth.open_mode
    with pytest.raises(AuthenticationError) as info:
        auth.authenticate(None, local_host="127.0.0.1")
    assert info.value.challenge == 'Bearer realm="onnxforge"'


def test_authenticator_requires_token_when_open_mode_false(tmp_path: Path) -> None:
    auth = Authenticator.from_settings(_settings(tmp_path, auth={"open_mode": False}))
    assert not auth.open_mode
    with pytest.raises(AuthenticationError):
        auth.authenticate(None, local_host="127.0.0.1")


def test_authenticator_maps_keys_from_file_and_environment(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"team-a": [hash_key(KEY_A)]}))
    settings = _settings(tmp_path, auth={"keys_file": keys_file, "keys": {"team-b": [hash_key(KEY_B)]}})
    auth = Authenticator.from_settings(settings)
    assert not auth.open_mode
    assert auth.authenticate(KEY_A, local_host="127.0.0.1") == "team-a"
    assert auth.authenticate(KEY_B, local_host="10.0.0.1") == "team-b"
    with pytest.raises(AuthenticationError) as info:
        auth.authenticate("ofk_wrong", local_host="127.0.0.1")
    assert info.value.challenge == 'Bearer realm="onnxforge", error="invalid_token"'
    assert info.value.code == "UNAUTHENTICATED"


def test_authenticator_refuses_to_start_when_production_has_no_keys(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError) as info:
        Authenticator.from_settings(_settings(tmp_path, **PRODUCTION))
    assert info.value.code == "AUTH_KEYS_REQUIRED"


def test_authenticator_starts_when_production_has_keys(tmp_path: Path) -> None:
    settings = _settings(tmp_path, auth={"keys": {"team-a": [hash_key(KEY_A)]}}, **PRODUCTION)
    assert not Authenticator.from_settings(settings).open_mode


def test_create_app_refuses_to_start_when_production_has_no_keys(tmp_path: Path) -> None:
    from app.main import create_app

    with pytest.raises(InvalidConfigError, match="production needs API keys"):
        create_app(_settings(tmp_path, **PRODUCTION))


@pytest.mark.parametrize(
    ("name", "content"), [("keys.json", "{}"), ("keys.json", '{"team-a": []}'), ("absent.json", None)]
)
def test_authenticator_refuses_to_start_when_keys_file_empty_or_missing(
    tmp_path: Path, name: str, content: str | None
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidConfigError) as info:
        Authenticator.from_settings(_settings(tmp_path, auth={"keys_file": path}))
    assert info.value.code == "AUTH_KEYS_INVALID"


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_keys_new_prints_a_key_and_its_hash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["sha256"] == hash_key(lines["key"])


def test_cli_keys_hash_reads_the_key_from_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(KEY_A + "\n"))
    assert main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_key(KEY_A)


def test_cli_keys_hash_exits_2_when_stdin_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["keys", "hash"]) == 2
