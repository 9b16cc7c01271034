"""The HTTP client for the aggregator API, shared by agents and auditors (one method per
endpoint of :mod:`fedsec.protocol.endpoints`).

Transport only: it builds URLs, signs every request (RFC 9421, also GETs, whose
body is empty), retries what may succeed on a second try, checks response sizes
before reading them and decodes answers into the typed messages of
:mod:`fedsec.protocol.wire`.  Protocol decisions belong to :mod:`fedsec.agent.runtime`.

Retry policy: connection failures, timeouts and 5xx answers are retried with
exponential backoff and jitter (``backoff_initial_s`` doubling up to
``backoff_max_s``, each delay drawn from [d/2, d] so agents that lost the
aggregator together do not return together); every retry is signed afresh, with
a new nonce, because the aggregator refuses a replayed one.  Refusals that a later
try may pass are retried within the same budget of ``retry_max`` retries: 429
``rate_limited``, 503 (``busy`` or any code) and 408 ``request_timeout`` after the
answer's ``Retry-After`` seconds (capped at ``backoff_max_s``; the backoff when the
header is absent or malformed), and 401 ``replayed`` (a nonce store full or a
stale nonce) after the backoff.  When the budget runs out the last refusal is
raised as its class (:class:`~fedsec.errors.RetryLater`,
:class:`~fedsec.errors.ReplayError`, :class:`~fedsec.errors.RequestTimeout`), so
the runtime can tell it from a permanent one.  A 401 ``clock_skew`` resets the
client's clock offset from the answer's ``Date`` header and resends at once, once
per request; a second one raises :class:`~fedsec.errors.ClockSkewError`.  Any
other 4xx is the aggregator's considered answer and is raised at once as the
:class:`~fedsec.errors.FedsecError` subclass named by its ``error`` code (or
:class:`~fedsec.errors.AggregatorRefused` for a code this client does not know),
carrying the server's ``detail`` sentence; 401 ``unauthenticated`` and 403
``forbidden`` also say what the operator should do.  A retried POST that the
aggregator did process before the connection broke comes back as a 409
``duplicate``; callers decide whether that means success.

The objects the aggregator signs are checked here against its pinned key as they
arrive: receipts and model manifests (their signature; the manifest's file hash is
checked by the caller, which holds the file).  Round specs are verified by the
runtime, which words the refusal.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeVar

import aiohttp
import msgspec
from yarl import URL

from fedsec import errors
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import PublicIdentity, SigningIdentity
from fedsec.errors import (
    AggregatorRefused,
    AggregatorUnreachable,
    AuthError,
    ClockSkewError,
    FedsecError,
    ForbiddenError,
    PayloadError,
    PayloadTooLarge,
    RateLimited,
    ReplayError,
    RequestTimeout,
    RetryLater,
    ServerBusy,
)
from fedsec.modelfile import MAX_MANIFEST_BYTES, ModelManifest, verify_manifest
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.protocol.roster import RosterEntry
from fedsec.protocol.wire import (
    API_PREFIX,
    Accepted,
    AdvertiseKeysBody,
    Challenge,
    ChallengeList,
    ChallengeRequest,
    ContributionStatement,
    ErrorBody,
    JoinRequest,
    JoinResponse,
    KeyListBody,
    MaskedInputAnswer,
    PrivacyReport,
    Receipt,
    Reveal,
    RevealBody,
    RevealList,
    RoundState,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_MODEL_BYTES",
    "MAX_ERROR_BYTES",
    "MAX_JSON_BYTES",
    "MAX_RECEIPT_BYTES",
    "AggregatorClient",
    "RosterBody",
    "error_from_response",
    "parse_retry_after",
]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ limits
#: Largest JSON answer read (round state, key lists, share relays, roster).  A key
#: list entry is ~300 bytes and a round spec lists the cohort twice (cohort and
#: weight caps), so 16 MiB holds cohorts of tens of thousands, two orders of
#: magnitude above the aggregator's default max_agents (100), while bounding what a
#: hostile or broken server can make the agent buffer.
MAX_JSON_BYTES: Final = 16 * 1024 * 1024
#: Largest error body read: an ErrorBody is a code and one sentence; 64 KiB is
#: ample and a server cannot flood the agent through its error path.
MAX_ERROR_BYTES: Final = 64 * 1024
#: A receipt is a dozen short fields (~500 bytes); 64 KiB as for errors.
MAX_RECEIPT_BYTES: Final = 64 * 1024
#: Default cap on a model download when the caller gives none; the runtime passes a cap
#: derived from its own model's size instead.
DEFAULT_MAX_MODEL_BYTES: Final = MAX_MODEL_BYTES
#: Extra seconds a long-poll request may take beyond the wait the server was asked
#: for: the server answers at the end of the wait, and the answer still has to travel.
LONG_POLL_SLACK_S: Final = 15.0
#: Chunk size for streamed reads; 64 KiB is aiohttp's own default read buffer size.
_READ_CHUNK: Final = 64 * 1024
#: Seconds an idle pooled connection is kept for reuse.  Under the aggregator's default
#: server.header_timeout_s (10 s), so the client gives a connection up before the server
#: closes it and never sends a request onto a connection that is being closed.
IDLE_CONNECTION_S: Final = 5.0

_RETRYABLE_EXCEPTIONS: Final = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
#: Statuses that are temporary whatever code their body names (RFC 9110: 408 and 503
#: invite a retry, 429 is RFC 6585's "too many requests"), so a proxy's page or a code
#: this client does not know is still retried.
_TEMPORARY_STATUSES: Final[dict[int, type[FedsecError]]] = {
    408: RequestTimeout,
    429: RateLimited,
    503: ServerBusy,
}

T = TypeVar("T")


class RosterBody(msgspec.Struct, frozen=True):
    """``GET /v1/roster``: admin-signed roster entries and the admin key that signed them.

    Unknown top-level fields (a serial, the federation id) are tolerated so the
    aggregator can add context; each entry is strict.
    """

    entries: list[RosterEntry]
    admin_public_key: str


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


@dataclass(frozen=True)
class _Call:
    """One request as :meth:`AggregatorClient._request` sends it, on every try."""

    method: str
    target: str  # encoded path and query, exactly as signed
    url: URL
    body: bytes
    content_type: str | None
    max_bytes: int
    what: str
    timeout: aiohttp.ClientTimeout

    @property
    def request(self) -> str:
        return f"{self.method} {self.target}"


@dataclass(frozen=True)
class _Setback:
    """A try that failed in a way a later one, signed afresh, may not."""

    reason: str
    retry_after: float | None = None  # the server's Retry-After; None: our own backoff
    refusal: FedsecError | None = None  # raised when tries run out; None: unreachable


class _ClockSkew(Exception):
    """A ``clock_skew`` refusal and the clock offset its ``Date`` header gives (None:
    no usable header)."""

    def __init__(self, refusal: ClockSkewError, offset_s: float | None) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal
        self.offset_s = offset_s


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


def _clock_offset(date: str | None, now: float) -> float | None:
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
    temporary = _TEMPORARY_STATUSES.get(status)
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


class AggregatorClient:
    """Signed, retrying HTTP client for one aggregator.

    Args:
        base_url: the aggregator's base URL (``https://host:port``, optionally with a
            path prefix when behind a proxy); ``/v1/...`` is appended.
        identity: the agent's signing identity; signs every request.
        aggregator_public_key: the aggregator's pinned Ed25519 key (32 bytes).
        timeout_s: per-request timeout (long polls get the wait on top).
        retry_max: retries after the first try (so ``retry_max + 1`` attempts).
        backoff_initial_s: first retry delay; doubles per retry.
        backoff_max_s: longest retry delay.
        session: an aiohttp session to use (not closed by :meth:`close`); default one
            of our own.
        sleep: how retries wait (tests pass one that records the delays).
        clock: Unix time source for signatures' ``created`` (tests pass a wrong one).

    ``clock_offset_s`` is the aggregator's clock minus ours, learnt from the ``Date``
    header of a ``clock_skew`` refusal and added to every later ``created``.
    """

    def __init__(
        self,
        base_url: str,
        identity: SigningIdentity,
        aggregator_public_key: bytes,
        *,
        timeout_s: float = 30.0,
        retry_max: int = 8,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        session: aiohttp.ClientSession | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        url = URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise errors.ConfigError(f"aggregator URL {base_url!r} is not an http(s) URL")
        if url.query_string or url.fragment:
            raise errors.ConfigError(f"aggregator URL {base_url!r} must not carry a query")
        self.base_url = str(url).rstrip("/")
        self._prefix = url.raw_path.rstrip("/") + API_PREFIX
        self._origin = str(url.origin())
        self.identity = identity
        self.aggregator = PublicIdentity(aggregator_public_key)
        self.timeout_s = float(timeout_s)
        self.retry_max = int(retry_max)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self._session = session
        self._own_session = session is None
        self._sleep = sleep
        self._clock = clock
        self.clock_offset_s = 0.0

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> AggregatorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session if this client created it."""
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_S)
            )
        return self._session

    # -- transport --------------------------------------------------------------------

    def _target(self, path: str, query: Mapping[str, int | str] | None) -> str:
        """Encoded path and query exactly as sent and signed."""
        target = self._prefix + path
        if query:
            target += "?" + str(URL.build(query=dict(query)).raw_query_string)
        return target

    def _backoff(self, retry: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_initial_s * (2.0**retry))
        return random.uniform(delay / 2.0, delay)

    def _delay(self, retry: int, setback: _Setback) -> float:
        """Seconds before retry number ``retry`` (0-based): the server's Retry-After,
        capped so one answer cannot park the agent past its stage deadlines, else ours."""
        if setback.retry_after is not None:
            return min(setback.retry_after, self.backoff_max_s)
        return self._backoff(retry)

    def _created(self) -> int:
        """Signature creation time: the local clock corrected by the aggregator's offset."""
        return round(self._clock() + self.clock_offset_s)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, int | str] | None = None,
        body: bytes = b"",
        content_type: str | None = None,
        max_bytes: int,
        what: str,
        timeout_s: float | None = None,
    ) -> bytes:
        """Send one signed request, retrying what may pass on a later try; return the body.

        Raises:
            AuthError: 401 ``unauthenticated`` (the key is not on the roster); not retried.
            ForbiddenError: 403 ``forbidden``; not retried.
            ClockSkewError: refused for clock skew again after correcting the clock, or
                with no usable ``Date`` header to correct it by.
            RetryLater, ReplayError, RequestTimeout: still refused after every attempt.
            FedsecError subclass: any other 4xx (never retried).
            AggregatorRefused: an unexpected non-2xx, non-4xx, non-5xx status (a redirect).
            AggregatorUnreachable: every attempt failed (connection, timeout or 5xx).
            PayloadTooLarge: the answer exceeds ``max_bytes``.
        """
        target = self._target(path, query)
        call = _Call(
            method=method,
            target=target,
            url=URL(self._origin + target, encoded=True),
            body=body,
            content_type=content_type,
            max_bytes=max_bytes,
            what=what,
            timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s),
        )
        attempts = self.retry_max + 1
        tries = 0
        corrected = False
        while True:
            try:
                outcome = await self._send(call)
            except _ClockSkew as skew:
                if corrected:
                    raise self._skew_persists(call, skew.refusal) from None
                self._correct_clock(call, skew)
                corrected = True
                continue  # the correction is not a retry: once per request, at once
            if not isinstance(outcome, _Setback):
                return outcome
            tries += 1
            if tries >= attempts:
                raise self._gave_up(call, attempts, outcome)
            delay = self._delay(tries - 1, outcome)
            log.warning(
                "aggregator_retry request=%r attempt=%d/%d delay_s=%.2f reason=%r",
                call.request,
                tries + 1,
                attempts,
                delay,
                outcome.reason,
            )
            await self._sleep(delay)

    async def _send(self, call: _Call) -> bytes | _Setback:
        """One try, signed afresh (new nonce, corrected ``created``).

        Returns:
            The body of a 2xx answer, or the setback a later try may not meet.

        Raises:
            _ClockSkew: refused for clock skew.
            FedsecError subclass: a refusal no retry can change (see :meth:`_request`).
        """
        headers: dict[str, str] = {}
        if call.content_type is not None:
            headers["Content-Type"] = call.content_type
        headers.update(
            sign_request(
                self.identity, call.method, call.target, headers, call.body, created=self._created()
            )
        )
        try:
            async with self._http().request(
                call.method,
                call.url,
                data=call.body if call.method != "GET" else None,
                headers=headers,
                timeout=call.timeout,
                allow_redirects=False,
            ) as resp:
                if 200 <= resp.status < 300:
                    return await _read_limited(resp, call.max_bytes, call.what)
                if resp.status < 400:
                    raise AggregatorRefused(
                        f"aggregator answered {call.request} with unexpected HTTP {resp.status}",
                        f"http_{resp.status}",
                        resp.status,
                    )
                raw = await _read_limited(resp, MAX_ERROR_BYTES, call.what, lenient=True)
                return self._judge(call, resp.status, raw, resp.headers)
        except _RETRYABLE_EXCEPTIONS as exc:
            return _Setback(_describe(exc))

    def _judge(self, call: _Call, status: int, raw: bytes, headers: Mapping[str, str]) -> _Setback:
        """Sort an error answer: what a later try may pass is a setback, the rest raises.

        Raises:
            _ClockSkew: a ``clock_skew`` refusal, with the offset its ``Date`` header gives.
            FedsecError subclass: a refusal no retry can change.
        """
        reason = f"HTTP {status} {_short(raw)}".strip()
        retry_after = parse_retry_after(headers.get("Retry-After"))
        if status >= 500 and status != 503:
            return _Setback(reason)  # our aggregator's bug or a proxy's: as unreachable
        refusal = error_from_response(status, raw, call.request, retry_after)
        if isinstance(refusal, ClockSkewError):
            raise _ClockSkew(refusal, _clock_offset(headers.get("Date"), self._clock()))
        if isinstance(refusal, RetryLater | RequestTimeout):
            return _Setback(reason, retry_after, refusal)
        if isinstance(refusal, ReplayError):
            return _Setback(reason, None, refusal)  # nonce store full: back off, sign anew
        raise self._permanent(call, refusal)

    def _permanent(self, call: _Call, refusal: FedsecError) -> FedsecError:
        """``refusal``, worded for the operator when it is about this agent's key."""
        key = self.identity.key_id
        if isinstance(refusal, ForbiddenError):
            exc: FedsecError = ForbiddenError(
                f"aggregator refused {call.request} as forbidden: {refusal.detail}; key {key} "
                "may not do this (its role, a revocation or another federation): ask the "
                "consortium admin to check its roster entry, and check aggregator_url"
            )
        elif type(refusal) is AuthError:
            exc = AuthError(
                f"aggregator refused {call.request} as unauthenticated: {refusal.detail}; "
                f"this agent's key {key} is not on the roster or was revoked: ask the "
                "consortium admin to enrol it (identity.pub)"
            )
        else:
            return refusal
        for note in getattr(refusal, "__notes__", ()):
            exc.add_note(note)
        return exc

    def _correct_clock(self, call: _Call, skew: _ClockSkew) -> None:
        """Sign from now on with the aggregator's time.

        Raises:
            ClockSkewError: the answer carried no usable ``Date`` header.
        """
        if skew.offset_s is None:
            raise ClockSkewError(
                f"aggregator refused {call.request} for clock skew ({skew.refusal.detail}) "
                "and sent no usable Date header to correct by; set this machine's clock "
                "right (NTP)"
            )
        self.clock_offset_s = skew.offset_s
        log.warning(
            "aggregator_clock_offset offset_s=%.0f request=%r detail=%r",
            skew.offset_s,
            call.request,
            f"clock offset of {skew.offset_s:.0f} s against the aggregator; check NTP",
        )

    def _skew_persists(self, call: _Call, refusal: ClockSkewError) -> ClockSkewError:
        return ClockSkewError(
            f"aggregator refused {call.request} for clock skew again after this agent "
            f"corrected its clock by {self.clock_offset_s:+.0f} s from the aggregator's Date "
            f"header ({refusal.detail}); set this machine's clock right (NTP) and restart"
        )

    def _gave_up(self, call: _Call, attempts: int, setback: _Setback) -> FedsecError:
        refusal = setback.refusal
        if refusal is None:
            return AggregatorUnreachable(
                f"aggregator at {self.base_url} unreachable after {attempts} attempts: "
                f"{setback.reason}"
            )
        detail = f"aggregator still refused {call.request} after {attempts} attempts: "
        detail += refusal.detail
        if isinstance(refusal, RetryLater):
            return type(refusal)(detail, refusal.retry_after)
        return type(refusal)(detail)

    async def _json(
        self,
        method: str,
        path: str,
        kind: type[T],
        *,
        query: Mapping[str, int | str] | None = None,
        payload: Any = None,
        max_bytes: int = MAX_JSON_BYTES,
        what: str,
        timeout_s: float | None = None,
    ) -> T:
        body = b"" if payload is None else encode(payload)
        raw = await self._request(
            method,
            path,
            query=query,
            body=body,
            content_type=None if payload is None else "application/json",
            max_bytes=max_bytes,
            what=what,
            timeout_s=timeout_s,
        )
        return decode(raw, kind, max_bytes=max_bytes, what=what)

    # -- endpoints --------------------------------------------------------------------

    async def health(self) -> bool:
        """``GET /health``: whether the aggregator says it is up."""
        raw = await self._request("GET", "/health", max_bytes=MAX_ERROR_BYTES, what="health")
        try:
            return bool(msgspec.json.decode(raw).get("status") == "ok")
        except (msgspec.DecodeError, AttributeError):
            return False

    async def get_round(self, wait_token: int | None = None, timeout: float = 0.0) -> RoundState:
        """``GET /round``: the current round; with a token, long-poll until it changes.

        Args:
            wait_token: the token of the last state seen; the server answers when it
                changes or after ``timeout`` seconds.  None answers at once.
            timeout: seconds the server may wait.
        """
        query: dict[str, int | str] = {}
        if wait_token is not None:
            query = {"wait": wait_token, "timeout": _seconds(timeout)}
        return await self._json(
            "GET",
            "/round",
            RoundState,
            query=query,
            what="round state",
            timeout_s=self.timeout_s + max(timeout, 0.0) + LONG_POLL_SLACK_S,
        )

    async def join(self, round: int, attempt: int, request: JoinRequest) -> JoinResponse:
        """``POST /rounds/{r}/join``."""
        return await self._json(
            "POST",
            f"/rounds/{round}/join",
            JoinResponse,
            query={"attempt": attempt},
            payload=request,
            what="join response",
        )

    async def report(self, round: int, attempt: int, report: PrivacyReport) -> None:
        """``POST /rounds/{r}/report``: the signed privacy report."""
        await self._request(
            "POST",
            f"/rounds/{round}/report",
            query={"attempt": attempt},
            body=encode(report),
            content_type="application/json",
            max_bytes=MAX_ERROR_BYTES,
            what="report answer",
        )

    def _stage_query(self, attempt: int, wait: float) -> dict[str, int | str]:
        query: dict[str, int | str] = {"attempt": attempt}
        if wait > 0:
            query["wait"] = _seconds(wait)
        return query

    def _wait_timeout(self, wait: float) -> float | None:
        """Client timeout for an answer the aggregator may hold ``wait`` seconds."""
        return self.timeout_s + wait + LONG_POLL_SLACK_S if wait > 0 else None

    async def _stage_json(
        self,
        method: str,
        path: str,
        kind: type[T],
        attempt: int,
        wait: float,
        what: str,
        payload: Any = None,
    ) -> T:
        """A SecAgg+ stage request whose answer the aggregator may hold ``wait`` seconds."""
        return await self._json(
            method,
            path,
            kind,
            query=self._stage_query(attempt, wait),
            payload=payload,
            what=what,
            timeout_s=self._wait_timeout(wait),
        )

    async def advertise(
        self, round: int, attempt: int, body: AdvertiseKeysBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/advertise``: our signed ephemeral public keys.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                share_keys; the answer then carries the key list (``keys``).
        """
        return await self._stage_json(
            "POST",
            f"/rounds/{round}/advertise",
            Accepted,
            attempt,
            wait,
            "advertise answer",
            payload=body,
        )

    async def keys(self, round: int, attempt: int, wait: float = 0.0) -> KeyListBody:
        """``GET /rounds/{r}/keys``: the relayed key list (long-polled up to ``wait`` s)."""
        return await self._stage_json(
            "GET", f"/rounds/{round}/keys", KeyListBody, attempt, wait, "key list"
        )

    async def post_shares(
        self, round: int, attempt: int, body: ShareKeysBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/shares``: our encrypted shares for relay.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                masked_input; the answer then carries our share relay (``relay``).
        """
        return await self._stage_json(
            "POST",
            f"/rounds/{round}/shares",
            Accepted,
            attempt,
            wait,
            "shares answer",
            payload=body,
        )

    async def get_shares(self, round: int, attempt: int, wait: float = 0.0) -> ShareRelayBody:
        """``GET /rounds/{r}/shares``: shares addressed to us and the participants
        (long-polled up to ``wait`` s)."""
        return await self._stage_json(
            "GET", f"/rounds/{round}/shares", ShareRelayBody, attempt, wait, "share relay"
        )

    async def masked_input(
        self,
        round: int,
        attempt: int,
        vector: bytes,
        statement: ContributionStatement,
        wait: float = 0.0,
    ) -> tuple[Receipt, UnmaskRequestBody | None]:
        """``POST /rounds/{r}/masked-input``: the packed vector with the signed contribution
        statement (commitment and signature as query parameters).

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                the unmask stage (SecAgg+); the answer then carries our unmask request.

        Returns:
            The verified receipt, and the unmask request when one came with it.

        Raises:
            SignatureError: the receipt is not signed by the pinned aggregator key.
        """
        query = self._stage_query(attempt, wait)
        query.update(commitment=statement.commitment, signature=statement.signature)
        raw = await self._request(
            "POST",
            f"/rounds/{round}/masked-input",
            query=query,
            body=vector,
            content_type="application/octet-stream",
            max_bytes=MAX_JSON_BYTES if wait > 0 else MAX_RECEIPT_BYTES,
            what="receipt",
            timeout_s=self._wait_timeout(wait),
        )
        if wait > 0:
            try:
                answer = decode(raw, MaskedInputAnswer, max_bytes=MAX_JSON_BYTES, what="receipt")
            except PayloadError:
                pass  # an aggregator that does not hold answers sends the bare receipt
            else:
                answer.receipt.verify(self.aggregator.public_bytes)
                return answer.receipt, answer.unmask
        return self._verified_receipt(raw), None

    async def get_unmask(self, round: int, attempt: int, wait: float = 0.0) -> UnmaskRequestBody:
        """``GET /rounds/{r}/unmask``: survivors and dropped members (long-polled up to
        ``wait`` s)."""
        return await self._stage_json(
            "GET", f"/rounds/{round}/unmask", UnmaskRequestBody, attempt, wait, "unmask request"
        )

    async def unmask(
        self, round: int, attempt: int, body: UnmaskResponseBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/unmask``: our shares for unmasking.

        Args:
            wait: seconds the aggregator may hold the answer until the attempt is over;
                the answer then carries the round state (``state``).
        """
        return await self._stage_json(
            "POST",
            f"/rounds/{round}/unmask",
            Accepted,
            attempt,
            wait,
            "unmask answer",
            payload=body,
        )

    async def receipt(self, round: int) -> Receipt:
        """``GET /rounds/{r}/receipt``: our receipt for round ``r``, verified."""
        raw = await self._request(
            "GET", f"/rounds/{round}/receipt", max_bytes=MAX_RECEIPT_BYTES, what="receipt"
        )
        return self._verified_receipt(raw)

    async def latest_manifest(self) -> ModelManifest:
        """``GET /models/latest``: the newest model manifest, signature verified."""
        return await self._manifest("/models/latest")

    async def manifest(self, version: int) -> ModelManifest:
        """``GET /models/{v}/manifest``: signature verified; the file hash is the caller's."""
        manifest = await self._manifest(f"/models/{version}/manifest")
        if manifest.version != version:
            raise errors.IntegrityError(
                f"asked for the manifest of model v{version}, got v{manifest.version}"
            )
        return manifest

    async def model_bytes(self, version: int, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> bytes:
        """``GET /models/{v}``: the safetensors file, refused past ``max_bytes``."""
        return await self._request(
            "GET", f"/models/{version}", max_bytes=max_bytes, what=f"model v{version}"
        )

    async def roster(self) -> RosterBody:
        """``GET /roster``: admin-signed entries; the caller verifies them, pinning the admin."""
        return await self._json("GET", "/roster", RosterBody, what="roster")

    # -- audit ------------------------------------------------------------------------

    async def challenges(self) -> ChallengeList:
        """``GET /audit/challenges``: open challenges addressed to us."""
        return await self._json("GET", "/audit/challenges", ChallengeList, what="challenges")

    async def reveal(self, body: RevealBody) -> Reveal:
        """``POST /audit/reveals``: answer a challenge with a sealed reveal."""
        return await self._json(
            "POST",
            "/audit/reveals",
            Reveal,
            payload=body,
            what="reveal acknowledgement",
            max_bytes=DEFAULT_MAX_MODEL_BYTES,
        )

    async def challenge(self, request: ChallengeRequest) -> Challenge:
        """``POST /audit/challenges`` (auditor role)."""
        return await self._json(
            "POST", "/audit/challenges", Challenge, payload=request, what="challenge"
        )

    async def reveals(self) -> RevealList:
        """``GET /audit/reveals`` (auditor role): reveals sealed to us."""
        return await self._json(
            "GET", "/audit/reveals", RevealList, what="reveals", max_bytes=DEFAULT_MAX_MODEL_BYTES
        )

    # -- helpers ----------------------------------------------------------------------

    async def _manifest(self, path: str) -> ModelManifest:
        raw = await self._request("GET", path, max_bytes=MAX_MANIFEST_BYTES, what="model manifest")
        manifest = ModelManifest.from_json(raw)
        verify_manifest(manifest, self.aggregator.public_bytes)
        return manifest

    def _verified_receipt(self, raw: bytes) -> Receipt:
        receipt = decode(raw, Receipt, max_bytes=MAX_RECEIPT_BYTES, what="receipt")
        receipt.verify(self.aggregator.public_bytes)
        return receipt


async def _read_limited(
    resp: aiohttp.ClientResponse, max_bytes: int, what: str, *, lenient: bool = False
) -> bytes:
    """Read a body of at most ``max_bytes``, refusing before reading when it says it is larger.

    With ``lenient`` (error bodies) an oversized body is cut at the limit rather than
    refused: the status already says what happened.
    """
    declared = resp.content_length
    if declared is not None and declared > max_bytes and not lenient:
        raise PayloadTooLarge(
            f"aggregator's {what} is {declared} bytes, over the limit of {max_bytes}"
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await resp.content.read(_READ_CHUNK)
        if not chunk:
            break
        size += len(chunk)
        if size > max_bytes:
            if lenient:
                chunks.append(chunk[: max_bytes - (size - len(chunk))])
                break
            raise PayloadTooLarge(f"aggregator's {what} exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _seconds(value: float) -> str:
    """Seconds as a plain decimal ("30", "0.5"; never exponent notation), at ms precision."""
    text = f"{min(max(value, 0.0), 1e9):.3f}".rstrip("0").rstrip(".")
    return text or "0"


def _short(raw: bytes) -> str:
    try:
        body = msgspec.json.decode(raw, type=ErrorBody)
        return f"{body.error}: {body.detail}"
    except (msgspec.ValidationError, msgspec.DecodeError):
        return raw[:120].decode("utf-8", "replace").strip()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "request timed out"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
