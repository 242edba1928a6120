"""Teams and API keys: bearer tokens that the operator maps to tenants (security.md T13).

The operator gives each team (tenant) one or more API keys and configures only their SHA-256 hashes, in a
JSON or TOML file (``auth.keys_file``) and/or the environment (``ONNXFORGE_AUTH__KEYS``, JSON), both of the
shape ``{"team-a": ["<64 hex digits>", ...]}``. ``onnxforge keys new`` makes a key and its hash;
``onnxforge keys hash`` hashes an existing one. The server never sees a key at rest: a presented token is
hashed and compared, in constant time, with every configured hash.

Keys are random (``new_key``: 256 bits), so a plain SHA-256 is enough: there is nothing to brute-force that
a slow password hash would protect.

Open mode (no token, every caller is tenant ``default``) is for a developer's own machine. ``auth.open_mode``
unset means open only when no keys are configured and ``api.host`` is a loopback address; true is refused
with a non-loopback host or with keys configured (core/settings.py). Because ``uvicorn --host`` and
``onnxforge serve --host`` can bind elsewhere than ``api.host`` says, open mode also checks, per request,
that the connection arrived on a loopback address; any other is refused with 401.

No FastAPI here: app/deps.py reads the header and calls ``Authenticator.authenticate``; app/errors.py turns
``AuthenticationError`` into ``401`` with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
from typing import TYPE_CHECKING

from core.errors import ErrorKind, InvalidConfigError, OnnxforgeError
from core.keys import DEFAULT_TENANT, load_keys_file

if TYPE_CHECKING:
    from core.settings import Settings

log = logging.getLogger("onnxforge.api")


class AuthenticationError(OnnxforgeError):
    """No valid bearer token. Answered as 401 with ``WWW-Authenticate: Bearer`` (app/errors.py)."""

    code = "UNAUTHENTICATED"
    kind = ErrorKind.INVALID_INPUT  # never reaches the generic mapping: app/errors.py has its own handler

    def __init__(self, message: str, *, invalid_token: bool) -> None:
        super().__init__(message)
        self.invalid_token = invalid_token

    @property
    def challenge(self) -> str:
        """The ``WWW-Authenticate`` value (RFC 6750 section 3: no error code when no token was sent)."""
        return 'Bearer realm="onnxforge"' + (', error="invalid_token"' if self.invalid_token else "")


class KeyRing:
    """Configured key hashes and their tenants; lookup compares against every hash in constant time."""

    def __init__(self, mappings: list[dict[str, list[str]]]) -> None:
        owner: dict[str, str] = {}
        for mapping in mappings:
            for tenant, digests in mapping.items():
                for digest in digests:
                    if owner.setdefault(digest, tenant) != tenant:
                        raise ValueError(
                            f"one API key hash is configured for both {owner[digest]!r} and {tenant!r}; "
                            "a key belongs to exactly one tenant"
                        )
        self._entries = [(bytes.fromhex(digest), tenant) for digest, tenant in owner.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._entries}

    def tenant_for(self, token: str) -> str | None:
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found = None
        for candidate, tenant in self._entries:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(digest, candidate):
                found = tenant
        return found


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Authenticator:
    """Who is calling: the tenant of a bearer token, or ``default`` in open mode."""

    open_mode: bool
    keys: KeyRing

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        """Load the keys (file and environment) and decide the mode; raise InvalidConfigError if unsafe.

        Run by the API at startup only: workers share Settings but serve no HTTP and need no keys.
        """
        auth = settings.auth
        try:
            from_file = load_keys_file(auth.keys_file) if auth.keys_file is not None else {}
            if auth.keys_file is not None and not any(from_file.values()):
                raise ValueError(f"auth.keys_file {auth.keys_file} lists no key hashes")
            keys = KeyRing([from_file, auth.keys])
        except ValueError as exc:
            raise InvalidConfigError(str(exc), code="AUTH_KEYS_INVALID") from None
        configured = len(keys) > 0
        if settings.environment == "production" and not configured:
            raise InvalidConfigError(
                "environment=production needs API keys: set ONNXFORGE_AUTH__KEYS_FILE (or ONNXFORGE_AUTH__KEYS) "
                "to the SHA-256 hashes of each tenant's keys; `onnxforge keys new` makes one",
                code="AUTH_KEYS_REQUIRED",
            )
        open_mode = auth.open_mode if auth.open_mode is not None else not configured and settings.binds_loopback_only
        if open_mode:
            log.warning("open mode: /v1 needs no token on loopback connections; callers are tenant %r", DEFAULT_TENANT)
        elif configured:
            log.info("API keys: %d for %d tenant(s)", len(keys), len(keys.tenants))
        else:
            log.warning(
                "no API keys are configured and open mode is off (api.host %s): every /v1 request will be "
                "refused with 401; set ONNXFORGE_AUTH__KEYS_FILE",
                settings.api.host,
            )
        return cls(open_mode=open_mode, keys=keys)

    def authenticate(self, token: str | None, *, local_host: str | None) -> str:
        """The caller's tenant. ``local_host``: the address the connection arrived on (ASGI ``server``)."""
        if self.open_mode:
            if _is_loopback(local_host):
                return DEFAULT_TENANT
            raise AuthenticationError(
                "this server runs in open mode, which serves loopback connections only; "
                "configure API keys to serve other addresses",
                invalid_token=False,
            )
        if not token:
            raise AuthenticationError(
                "an API key is required: send it as `Authorization: Bearer <key>`", invalid_token=False
            )
        tenant = self.keys.tenant_for(token)
        if tenant is None:
            raise AuthenticationError("the API key is not valid", invalid_token=True)
        return tenant
