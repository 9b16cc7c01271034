"""Reading the aggregator's refusals: the :class:`~fedsec.errors.FedsecError` an error
answer names, its ``Retry-After`` and ``Date`` headers, and the sentences raised when a
refusal is about this agent's key or outlasts the retries.

Pure functions of what the answer carried; :mod:`.transport` decides what to retry.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
from typing import Final

import msgspec

from fedsec import errors
from fedsec.errors import (
    AggregatorRefused,
    AggregatorUnreachable,
    AuthError,
    ClockSkewError,
    FedsecError,
    ForbiddenError,
    Quarantined,
    RateLimited,
    RequestTimeout,
    RetryLater,
    ServerBusy,
)
from fedsec.protocol.wire import ErrorBody

#: Statuses that are temporary whatever code their body names (RFC 9110: 408 and 503
#: invite a retry, 429 is RFC 6585's "too many requests"), so a proxy's page or a code
#: this client does not know is still retried.
TEMPORARY_STATUSES: Final[dict[int, type[FedsecError]]] = {
    408: RequestTimeout,
    429: RateLimited,
    503: ServerBusy,
}


def _error_classes() -> dict[str, type[FedsecError]]:
    """Every FedsecError subclass in fedsec.errors, by its code (the server's names)."""
    found: dict[str, type[FedsecError]] = {}
    pending: list[type[FedsecError]] = [FedsecError]
    while pending:
        cls = pending.pop()
        if getattr(errors, cls.__name__, None) is cls and cls is not AggregatorRefused:
            found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


_ERROR_CLASSES: Final = _error_classes()


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in delta-seconds (RFC 9110 10.2.3), or None when absent
    or not a plain non-negative integer (an HTTP-date included: the caller's own backoff
    is as good a guess, and needs no trust in the server's clock)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        return None
    return float(text)


def clock_offset(date: str | None, now: float) -> float | None:
    """Server time (an HTTP ``Date`` header) minus ``now``, seconds; None if unusable."""
    if not date:
        return None
    try:
        when = email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)  # "-0000": UTC of unknown origin
    return when.timestamp() - now


def error_from_response(
    status: int, raw: bytes, request: str, retry_after: float | None = None
) -> FedsecError:
    """Turn a 4xx (or 503) answer into the matching FedsecError, carrying the server's
    sentence.

    The ``error`` code names the class; a 408, 429 or 503 whose code this client does
    not know, or whose body is not an ErrorBody, still becomes the status's temporary
    class (RequestTimeout, RateLimited, ServerBusy).

    Args:
        status: the HTTP status.
        raw: the body (already size-limited).
        request: ``"METHOD /path"``, for the note and for bodies that are not ErrorBody.
        retry_after: the ``Retry-After`` seconds, given to a RetryLater (its default
            when None).
    """
    try:
        body = msgspec.json.decode(raw, type=ErrorBody)
    except (msgspec.ValidationError, msgspec.DecodeError):
        text = raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
        code, detail = f"http_{status}", f"aggregator answered HTTP {status} to {request}: {text}"
        cls = None
    else:
        code, detail = body.error, body.detail
        cls = _ERROR_CLASSES.get(code)
    temporary = TEMPORARY_STATUSES.get(status)
    if temporary is not None and (cls is None or not issubclass(cls, RetryLater | RequestTimeout)):
        cls = temporary
    exc: FedsecError
    if cls is None or cls is FedsecError:
        exc = AggregatorRefused(detail, code, status)
    elif issubclass(cls, RetryLater):
        exc = cls(detail) if retry_after is None else cls(detail, retry_after)
    else:
        exc = cls(detail)
    exc.add_note(f"aggregator answered {request} with HTTP {status}")
    return exc


def for_operator(request: str, refusal: FedsecError, key_id: str) -> FedsecError:
    """``refusal``, worded for the operator when it is about this agent's key."""
    if isinstance(refusal, Quarantined):
        return refusal  # its sentence names the failed round and whom to ask
    if isinstance(refusal, ForbiddenError):
        exc: FedsecError = ForbiddenError(
            f"aggregator refused {request} as forbidden: {refusal.detail}; key {key_id} "
            "may not do this (its role, a revocation or another federation): ask the "
            "consortium admin to check its roster entry, and check aggregator_url"
        )
    elif type(refusal) is AuthError:
        exc = AuthError(
            f"aggregator refused {request} as unauthenticated: {refusal.detail}; "
            f"this agent's key {key_id} is not on the roster or was revoked: ask the "
            "consortium admin to enrol it (identity.pub)"
        )
    else:
        return refusal
    for note in getattr(refusal, "__notes__", ()):
        exc.add_note(note)
    return exc


def no_date_to_correct(request: str, refusal: ClockSkewError) -> ClockSkewError:
    """A ``clock_skew`` refusal whose answer gave no usable ``Date`` header."""
    return ClockSkewError(
        f"aggregator refused {request} for clock skew ({refusal.detail}) "
        "and sent no usable Date header to correct by; set this machine's clock "
        "right (NTP)"
    )


def skew_persists(request: str, refusal: ClockSkewError, offset_s: float) -> ClockSkewError:
    """A second ``clock_skew`` refusal of one request, after correcting by ``offset_s``."""
    return ClockSkewError(
        f"aggregator refused {request} for clock skew again after this agent "
        f"corrected its clock by {offset_s:+.0f} s from the aggregator's Date "
        f"header ({refusal.detail}); set this machine's clock right (NTP) and restart"
    )


def gave_up(
    base_url: str, request: str, attempts: int, reason: str, refusal: FedsecError | None
) -> FedsecError:
    """What is raised when every attempt failed: unreachable (``refusal`` None), or the
    last temporary refusal, saying how many attempts it outlasted."""
    if refusal is None:
        return AggregatorUnreachable(
            f"aggregator at {base_url} unreachable after {attempts} attempts: {reason}"
        )
    detail = f"aggregator still refused {request} after {attempts} attempts: "
    detail += refusal.detail
    if isinstance(refusal, RetryLater):
        return type(refusal)(detail, refusal.retry_after)
    return type(refusal)(detail)


def error_code(raw: bytes) -> str | None:
    """The ``error`` code of an error body, None when it is not an ErrorBody."""
    try:
        return msgspec.json.decode(raw, type=ErrorBody).error
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def short_reason(raw: bytes) -> str:
    """An error body in a few words, for the retry log line."""
    try:
        body = msgspec.json.decode(raw, type=ErrorBody)
        return f"{body.error}: {body.detail}"
    except (msgspec.ValidationError, msgspec.DecodeError):
        return raw[:120].decode("utf-8", "replace").strip()


def describe_failure(exc: BaseException) -> str:
    """A connection failure or timeout in a few words, for the retry log line."""
    if isinstance(exc, asyncio.TimeoutError):
        return "request timed out"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
