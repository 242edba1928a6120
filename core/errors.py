"""One exception family for the whole project, free of HTTP.

Every error carries a stable ``code`` (part of the public API: clients switch on it), a human message,
and where it applies the pass it happened in and the passes that ran before it. ``kind`` says what sort
of failure it is; the API maps kinds to status codes in one place (app/errors.py), the worker maps them
to failed jobs, and the CLI to exit codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any


class ErrorKind(StrEnum):
    INVALID_INPUT = "invalid_input"  # the request or the model is wrong: fix it and resubmit
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # the resource is not in a state that allows this
    TOO_LARGE = "too_large"
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"  # a dependency (broker, database, storage) is down: retry later
    INTERNAL = "internal"


class OnnxforgeError(Exception):
    code: str = "INTERNAL_ERROR"
    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        pass_name: str | None = None,
        passes_before: Sequence[str] = (),
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.pass_name = pass_name
        self.passes_before = list(passes_before)
        self.detail = detail or {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "pass": self.pass_name,
            "passes_before": self.passes_before,
            **({"detail": self.detail} if self.detail else {}),
        }

    def __str__(self) -> str:
        where = f" (in pass {self.pass_name})" if self.pass_name else ""
        return f"{self.code}: {self.message}{where}"


class InvalidInputError(OnnxforgeError):
    code = "INVALID_INPUT"
    kind = ErrorKind.INVALID_INPUT


class InvalidConfigError(InvalidInputError):
    code = "INVALID_CONFIG"


class UnknownPassError(InvalidConfigError):
    code = "UNKNOWN_PASS"


class InvalidPassOptionsError(InvalidConfigError):
    code = "INVALID_PASS_OPTIONS"


class InvalidModelError(InvalidInputError):
    code = "INVALID_MODEL"


class NotFoundError(OnnxforgeError):
    code = "NOT_FOUND"
    kind = ErrorKind.NOT_FOUND


class ConflictError(OnnxforgeError):
    code = "CONFLICT"
    kind = ErrorKind.CONFLICT


class TooLargeError(OnnxforgeError):
    code = "PAYLOAD_TOO_LARGE"
    kind = ErrorKind.TOO_LARGE


class UnavailableError(OnnxforgeError):
    code = "SERVICE_UNAVAILABLE"
    kind = ErrorKind.UNAVAILABLE


class PassError(OnnxforgeError):
    """A pass raised, or broke its contract (e.g. an in-place pass returned another model)."""

    code = "PASS_FAILED"
    kind = ErrorKind.INTERNAL


class VerificationError(OnnxforgeError):
    """The optimized model computes something else than the original, beyond tolerance."""

    code = "VERIFICATION_FAILED"
    kind = ErrorKind.INTERNAL


class RegressionError(OnnxforgeError):
    """The optimized model is slower than the original (raised only when the job asks to fail on it)."""

    code = "PERFORMANCE_REGRESSION"
    kind = ErrorKind.INTERNAL
