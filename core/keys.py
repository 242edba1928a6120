"""API keys and their tenants as the operator configures them: hashing, new keys, the keys file.

Ground, not HTTP: settings validate ``auth.keys`` with ``check_key_mapping`` and the CLI's ``keys``
commands use ``new_key``/``hash_key``, while app/auth.py authenticates requests against the hashes.
Keys are random (``new_key``: 256 bits), so a plain SHA-256 is enough: there is nothing to brute-force
that a slow password hash would protect.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"
KEY_PREFIX = "ofk_"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """The SHA-256 (hex) that the operator configures for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_key_mapping(mapping: object, source: str) -> dict[str, list[str]]:
    """Validate ``{tenant: [sha256 hex, ...]}``; hashes are lower-cased. Raises ValueError naming ``source``."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{source}: expected an object mapping each tenant to a list of SHA-256 hashes")
    checked: dict[str, list[str]] = {}
    for tenant, hashes in mapping.items():
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise ValueError(f"{source}: tenant {str(tenant)[:64]!r} must match {TENANT_PATTERN.pattern}")
        if isinstance(hashes, str) or not isinstance(hashes, list):
            raise ValueError(f"{source}: tenant {tenant!r} needs a list of SHA-256 hashes")
        digests = []
        for value in hashes:
            digest = value.strip().lower() if isinstance(value, str) else ""
            if not _SHA256_HEX.fullmatch(digest):
                # Never echo the value: it may be a plaintext key pasted by mistake.
                raise ValueError(
                    f"{source}: tenant {tenant!r} has an entry that is not a SHA-256 hash (64 hex digits); "
                    "configure hashes, never keys: `onnxforge keys hash` prints the hash of a key"
                )
            digests.append(digest)
        checked[tenant] = digests
    return checked


def load_keys_file(path: Path) -> dict[str, list[str]]:
    """Read a keys file: JSON (``.json``) or TOML (``.toml``), both ``tenant = [hashes]`` at the top level."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ValueError(f"auth.keys_file {path}: the name must end in .json or .toml")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"auth.keys_file {path}: cannot read it ({exc.strerror})") from exc
    try:
        data: Any = json.loads(raw) if suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"auth.keys_file {path}: not valid {suffix[1:].upper()} ({exc})") from None
    return check_key_mapping(data, f"auth.keys_file {path}")
