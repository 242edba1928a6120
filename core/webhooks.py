"""Webhooks: a signed POST to the job's ``callback_url`` once it ends (security.md T14 for the destination).

**Destination policy** (``check_destination``; at submit, 422, and again before every delivery):

* ``https`` only, unless ``webhooks.allow_http``; no user info, no fragment, at most 2048 characters;
* the host must be on ``webhooks.allowed_hosts`` (exact, or ``*.example.com`` for subdomains; an empty list
  turns webhooks off);
* the name is resolved once and every address must be public (not private, loopback, link-local such as
  the 169.254.169.254 metadata service, multicast, reserved or unspecified) unless
  ``webhooks.allow_private``; IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry.
* the tenant must have a secret (``webhooks.secrets``), or nothing could be signed.

Failures raise ``InvalidInputError`` with code CALLBACK_URL_INVALID (not a usable URL) or
CALLBACK_URL_NOT_ALLOWED (a usable URL the operator's policy refuses).

**Delivery** (``deliver``; run by workers, workers/webhooks.py): the connection goes to the address resolved
and checked just before (no second lookup that DNS rebinding could answer differently), with the original
host name in ``Host`` and as TLS SNI, so certificates are verified against the name. No redirects (a 3xx is
a failed attempt), ``webhooks.timeout_seconds`` for connect and read, at most 64 KiB of the answer read.
Any 2xx is delivered.

**Signature.** Body: JSON ``{"event": "job.<state>", "job": {id, state, error, links, summary, cached_from,
created_at, finished_at}}``. Headers::

    X-Onnxforge-Timestamp: <unix seconds>
    X-Onnxforge-Signature: sha256=<hex HMAC-SHA256(tenant secret, "<timestamp>." + raw body)>
    X-Onnxforge-Delivery: <job id>

A receiver recomputes the HMAC over the timestamp, a dot and the raw body, compares in constant time, and
rejects timestamps more than a few minutes old (replay protection); the job id makes retries idempotent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import socket
import time
from typing import Any
from urllib.parse import SplitResult, urlsplit

from core.errors import InvalidInputError
from core.settings import WebhooksSettings
from core.store import Job

SIGNATURE_HEADER = "X-Onnxforge-Signature"
TIMESTAMP_HEADER = "X-Onnxforge-Timestamp"
DELIVERY_HEADER = "X-Onnxforge-Delivery"
MAX_URL_CHARS = 2048
MAX_RESPONSE_BYTES = 64 << 10
USER_AGENT = "onnxforge-webhook/1"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class CallbackUrlError(InvalidInputError):
    code = "CALLBACK_URL_INVALID"


def _invalid(message: str) -> CallbackUrlError:
    return CallbackUrlError(message, code="CALLBACK_URL_INVALID")


def _refused(message: str) -> CallbackUrlError:
    return CallbackUrlError(message, code="CALLBACK_URL_NOT_ALLOWED")


@dataclasses.dataclass(frozen=True)
class Destination:
    url: str
    scheme: str
    host: str  # lower-case name or IP literal, without brackets
    port: int
    target: str  # path and query
    address: IPAddress  # the checked address to connect to


def _parse(url: str) -> SplitResult:
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise _invalid(f"callback_url must be a URL of at most {MAX_URL_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise _invalid("callback_url must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise _invalid(f"callback_url is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise _invalid("callback_url must be an http(s) URL")
    if not parts.hostname:
        raise _invalid("callback_url has no host")
    if parts.username is not None or parts.password is not None:
        raise _invalid("callback_url must not carry user info (credentials); sign requests with the webhook secret")
    if parts.fragment:
        raise _invalid("callback_url must not have a fragment")
    return parts


def _host_allowed(host: str, allowed: list[str]) -> bool:
    for entry in allowed:
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and host != entry[2:]:
                return True
        elif host == entry:
            return True
    return False


def _public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise _refused(f"callback_url host {host!r} does not resolve ({exc})") from None
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise _refused(f"callback_url host {host!r} does not resolve")
    return addresses


def check_destination(url: str, policy: WebhooksSettings, *, has_secret: bool = True) -> Destination:
    """Parse, check and resolve ``url`` (see the module docstring); raises CallbackUrlError."""
    parts = _parse(url)
    if parts.scheme == "http" and not policy.allow_http:
        raise _refused("callback_url must use https (the operator does not allow http)")
    host = (parts.hostname or "").lower().rstrip(".")
    if not policy.allowed_hosts:
        raise _refused("webhooks are not enabled on this server (webhooks.allowed_hosts is empty)")
    if not _host_allowed(host, policy.allowed_hosts):
        raise _refused(f"callback_url host {host!r} is not on the operator's allow-list (webhooks.allowed_hosts)")
    if not has_secret:
        raise _refused("no webhook secret is configured for this tenant; ask the operator for one")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = _resolve(host, port)
    if not policy.allow_private:
        bad = [str(a) for a in addresses if not _public(a)]
        if bad:
            raise _refused(
                f"callback_url host {host!r} resolves to a non-public address ({', '.join(bad)}); refused "
                "(webhooks.allow_private is off)"
            )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Destination(url, parts.scheme, host, port, target, addresses[0])


# ------------------------------------------------------------------------------------------------ payload


def payload(job: Job) -> dict[str, Any]:
    base = f"/v1/jobs/{job.id}"
    done = job.state == "succeeded"
    return {
        "event": f"job.{job.state}",
        "job": {
            "id": job.id,
            "state": job.state,
            "error": {"code": job.error_code, "message": job.error_message or "", "pass": job.error_pass}
            if job.error_code
            else None,
            "links": {
                "self": base,
                "report": f"{base}/report" if done else None,
                "report_html": f"{base}/report.html" if done else None,
                "artifact": f"{base}/artifact" if done else None,
            },
            "summary": job.summary,
            "cached_from": job.cached_from,
            "created_at": job.created_at.isoformat(),
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        },
    }


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Onnxforge-Signature`` value: HMAC-SHA256 over ``<timestamp>.<body>``."""
    mac = hmac.new(secret.encode("utf-8"), timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str, *, max_age_seconds: float = 300) -> bool:
    """What a receiver does (documented and used by the tests): signature matches and timestamp is fresh."""
    try:
        fresh = abs(time.time() - int(timestamp)) <= max_age_seconds
    except ValueError:
        return False
    return fresh and hmac.compare_digest(sign(secret, timestamp, body), signature)


@dataclasses.dataclass(frozen=True)
class Attempt:
    delivered: bool
    error: str | None = None
    status: int | None = None


def deliver(job: Job, secret: str, policy: WebhooksSettings) -> Attempt:
    """One delivery attempt of ``job``'s webhook; never raises for network or policy failures."""
    import httpx

    url = str((job.config or {}).get("callback_url") or "")
    try:
        dest = check_destination(url, policy)
    except CallbackUrlError as exc:
        return Attempt(False, f"{exc.code}: {exc.message}")
    body = json.dumps(payload(job), sort_keys=True, separators=(",", ":")).encode("utf-8")
    timestamp = str(int(time.time()))
    literal = f"[{dest.address}]" if dest.address.version == 6 else str(dest.address)
    default_port = 443 if dest.scheme == "https" else 80
    netloc_host = f"[{dest.host}]" if ":" in dest.host else dest.host
    headers = {
        "Host": netloc_host if dest.port == default_port else f"{netloc_host}:{dest.port}",
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: sign(secret, timestamp, body),
        DELIVERY_HEADER: job.id,
    }
    extensions = {"sni_hostname": dest.host} if dest.scheme == "https" else {}
    timeout = httpx.Timeout(policy.timeout_seconds)
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client,
            client.stream(
                "POST",
                f"{dest.scheme}://{literal}:{dest.port}{dest.target}",
                content=body,
                headers=headers,
                extensions=extensions,
            ) as response,
        ):
            read = 0
            for chunk in response.iter_raw():
                read += len(chunk)
                if read >= MAX_RESPONSE_BYTES:
                    break
            status = response.status_code
    except httpx.HTTPError as exc:
        return Attempt(False, f"{type(exc).__name__}: {str(exc)[:200]}")
    if 200 <= status < 300:
        return Attempt(True, status=status)
    return Attempt(False, f"the receiver answered {status}", status)
