"""The signed, retrying transport under every endpoint call.

It signs each try afresh (RFC 9421, new nonce, ``created`` corrected by the clock
offset), reads answers no larger than the caller allows, sorts error answers into
what a later try may pass and what it may not (:mod:`.refusals` names them), and
waits between tries: our backoff with jitter, or the server's ``Retry-After``.
The retry policy itself is described in the package docstring.

Replicated aggregators: the transport holds the list of aggregator URLs the member was
configured with and sends to one at a time, staying with the one that last answered.
A try that cannot reach it (connection failure, timeout, a 5xx other than 503) moves
to the next URL; a ``503 not_leader`` moves to the leader its ``Fedsec-Leader`` header
names, but only when that URL is in the list: a replica cannot send a member's signed
requests anywhere the member did not choose.  A URL found unreachable is not followed on
a standby's word for a few seconds (the standbys name a dead leader until its lease
expires).  A move to a URL not yet tried for this request is at once; every move counts
against ``retry_max`` like any retry.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, NamedTuple, TypeVar

import aiohttp
from yarl import URL

from fedsec.aggregator_client import refusals
from fedsec.aggregator_client.limits import (
    IDLE_CONNECTION_S,
    MAX_ERROR_BYTES,
    MAX_JSON_BYTES,
    READ_CHUNK,
    UNREACHABLE_HOLD_S,
)
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    AggregatorRefused,
    ClockSkewError,
    ConfigError,
    FedsecError,
    PayloadTooLarge,
    ReplayError,
    RequestTimeout,
    RetryLater,
)
from fedsec.protocol.wire import LEADER_HEADER, NOT_LEADER, decode, encode

# The package's name, as before the split: operators and tests filter on it.
log = logging.getLogger("fedsec.aggregator_client")
# Jitter is no secret, but fedsec draws from one kind of generator only: the OS's.
_JITTER = secrets.SystemRandom()

_RETRYABLE_EXCEPTIONS: Final = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
#: Header fields aiohttp adds by default that tell the aggregator nothing (it compresses
#: no answer and serves one media type per route): ~90 bytes off every request, a tenth
#: of a member's fixed per-round upload.
_SKIPPED_HEADERS: Final = ("User-Agent", "Accept", "Accept-Encoding")

T = TypeVar("T")

#: One aggregator URL, or the URLs of its replicas (the order to try them in).
AggregatorUrls = str | Sequence[str]


@dataclass(frozen=True)
class _Aggregator:
    """One configured aggregator URL, normalised."""

    base_url: str  # without a trailing slash
    prefix: str  # a proxy's path prefix, or ""
    origin: str


def _aggregator(base_url: str) -> _Aggregator:
    """Raises:
    ConfigError: ``base_url`` is not an http(s) URL, or carries a query."""
    url = URL(base_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"aggregator URL {base_url!r} is not an http(s) URL")
    if url.query_string or url.fragment:
        raise ConfigError(f"aggregator URL {base_url!r} must not carry a query")
    return _Aggregator(str(url).rstrip("/"), url.raw_path.rstrip("/"), str(url.origin()))


def _aggregators(base_urls: AggregatorUrls) -> tuple[_Aggregator, ...]:
    """The configured URLs, normalised, each once, in order.

    Raises:
        ConfigError: none is given, or one is not an http(s) URL or carries a query.
    """
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    found: dict[str, _Aggregator] = {}
    for url in urls:
        aggregator = _aggregator(url)
        found.setdefault(aggregator.base_url, aggregator)
    if not found:
        raise ConfigError("no aggregator URL configured")
    return tuple(found.values())


class Route(NamedTuple):
    """An endpoint's method and its path with the parameters filled in (``/v1/...``)."""

    method: str
    path: str


@dataclass(frozen=True)
class _Call:
    """One request as :meth:`Transport.request` sends it, on every try."""

    method: str
    path: str  # encoded path and query under the aggregator's prefix
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
    not_leader: bool = False  # a replica that does not lead answered
    leader: str | None = None  # the URL its Fedsec-Leader header named


class _ClockSkew(Exception):
    """A ``clock_skew`` refusal and the clock offset its ``Date`` header gives (None:
    no usable header)."""

    def __init__(self, refusal: ClockSkewError, offset_s: float | None) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal
        self.offset_s = offset_s


class Transport:
    """Signed, retrying requests to one aggregator (or its replicas); the arguments are
    :class:`~fedsec.aggregator_client.AggregatorClient`'s.

    ``clock_offset_s`` is the aggregator's clock minus ours, learnt from the ``Date``
    header of a ``clock_skew`` refusal and added to every later ``created``.
    """

    def __init__(
        self,
        base_url: AggregatorUrls,
        identity: SigningIdentity,
        *,
        timeout_s: float,
        retry_max: int,
        backoff_initial_s: float,
        backoff_max_s: float,
        session: aiohttp.ClientSession | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._aggregators = _aggregators(base_url)
        self._at = 0  # the aggregator sent to: the one that answered last
        # index -> when it was last found unreachable (time.monotonic)
        self._unreachable_at: dict[int, float] = {}
        self.identity = identity
        self.timeout_s = float(timeout_s)
        self.retry_max = int(retry_max)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self._session = session
        self._own_session = session is None
        self._sleep = sleep
        self._clock = clock
        self.clock_offset_s = 0.0

    @property
    def base_url(self) -> str:
        """The URL requests go to now (the first configured until a move)."""
        return self._aggregators[self._at].base_url

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Every configured aggregator URL, normalised, in order."""
        return tuple(a.base_url for a in self._aggregators)

    async def close(self) -> None:
        """Close the session if this transport created it."""
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def sleep(self) -> Callable[[float], Awaitable[None]]:
        """How retries wait."""
        return self._sleep

    @property
    def clock(self) -> Callable[[], float]:
        """The Unix time source signatures' ``created`` is read from."""
        return self._clock

    def shared_session(self) -> aiohttp.ClientSession:
        """The HTTP session (created now if none yet), for another transport to share."""
        return self._http()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_CONNECTION_S)
            )
        return self._session

    def _addressed(self, call: _Call) -> _Call:
        """``call`` sent to the current aggregator (its origin and path prefix)."""
        aggregator = self._aggregators[self._at]
        target = aggregator.prefix + call.path
        return replace(call, target=target, url=URL(aggregator.origin + target, encoded=True))

    def _delay(self, retry: int, setback: _Setback) -> float:
        """Seconds before retry number ``retry`` (0-based): the server's Retry-After,
        capped so one answer cannot park the agent past its stage deadlines, else our
        backoff with full jitter, drawn from [0, d]: a thousand agents that lost the
        aggregator together (a restart) come back spread over the whole window, not in
        its second half (Brooker, "Exponential backoff and jitter", AWS 2015)."""
        if setback.retry_after is not None:
            return min(setback.retry_after, self.backoff_max_s)
        delay = min(self.backoff_max_s, self.backoff_initial_s * (2.0**retry))
        return _JITTER.uniform(0.0, delay)

    def _created(self) -> int:
        """Signature creation time: the local clock corrected by the aggregator's offset."""
        return round(self._clock() + self.clock_offset_s)

    async def request(
        self,
        route: Route,
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
        path = route.path
        if query:
            path += "?" + str(URL.build(query=dict(query)).raw_query_string)
        unaddressed = _Call(
            method=route.method,
            path=path,
            target=path,
            url=URL(path, encoded=True),
            body=body,
            content_type=content_type,
            max_bytes=max_bytes,
            what=what,
            timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s),
        )
        call = self._addressed(unaddressed)
        attempts = self.retry_max + 1
        tries = 0
        corrected = False
        tried = {self._at}  # aggregators asked during this request
        while True:
            try:
                outcome = await self._send(call)
            except _ClockSkew as skew:
                if corrected:
                    raise refusals.skew_persists(
                        call.request, skew.refusal, self.clock_offset_s
                    ) from None
                self._correct_clock(call, skew)
                corrected = True
                continue  # the correction is not a retry: once per request, at once
            if not isinstance(outcome, _Setback):
                return outcome
            tries += 1
            if tries >= attempts:
                raise refusals.gave_up(
                    ", ".join(self.base_urls),
                    call.request,
                    attempts,
                    outcome.reason,
                    outcome.refusal,
                )
            moved_to = self._move(call, outcome)
            if moved_to is not None:
                call = self._addressed(call)
                if moved_to not in tried:  # another aggregator, not asked yet: at once
                    tried.add(moved_to)
                    continue
            await self._pause(call, tries, attempts, outcome)

    def _move(self, call: _Call, setback: _Setback) -> int | None:
        """Choose the aggregator for the next try after ``setback``; the index moved to,
        None when staying.  An unreachable one gives way to the next in the list; a
        standby to the leader it names if that is configured and was not found
        unreachable in the last :data:`UNREACHABLE_HOLD_S`, else to the next one not
        found so, else it stays (it may lead next); any other refusal stays.
        """
        if len(self._aggregators) == 1 or not (setback.refusal is None or setback.not_leader):
            return None
        now = time.monotonic()
        if setback.refusal is None:
            self._unreachable_at[self._at] = now
        held = {i for i, t in self._unreachable_at.items() if now - t < UNREACHABLE_HOLD_S}
        if setback.not_leader and setback.leader:
            named = self._index_of(setback.leader)
            if named is None:
                log.warning(
                    "aggregator_leader_refused request=%r from=%r named=%r detail=%r",
                    call.request,
                    self.base_url,
                    setback.leader[:200],
                    "the leader a replica named is not one of this member's configured "
                    "aggregator URLs; not followed",
                )
            elif named != self._at and named not in held:
                return self._go(named, call, setback)
        count = len(self._aggregators)
        others = [(self._at + k) % count for k in range(1, count)]
        if setback.not_leader:
            others = [i for i in others if i not in held]
        return self._go(others[0], call, setback) if others else None

    def _go(self, index: int, call: _Call, setback: _Setback) -> int:
        log.warning(
            "aggregator_switch request=%r from=%r to=%r reason=%r",
            call.request,
            self.base_url,
            self._aggregators[index].base_url,
            setback.reason,
        )
        self._at = index
        return index

    def _index_of(self, url: str) -> int | None:
        """The configured aggregator ``url`` names (normalised as configured), or None."""
        try:
            wanted = _aggregator(url).base_url
        except (ConfigError, ValueError):
            return None
        return next((i for i, a in enumerate(self._aggregators) if a.base_url == wanted), None)

    async def _pause(self, call: _Call, tries: int, attempts: int, setback: _Setback) -> None:
        """Wait before the next try, saying so in the log (never the body or the key)."""
        delay = self._delay(tries - 1, setback)
        log.warning(
            "aggregator_retry request=%r attempt=%d/%d delay_s=%.2f reason=%r",
            call.request,
            tries + 1,
            attempts,
            delay,
            setback.reason,
        )
        await self._sleep(delay)

    async def _send(self, call: _Call) -> bytes | _Setback:
        """One try, signed afresh (new nonce, corrected ``created``).

        Returns:
            The body of a 2xx answer, or the setback a later try may not meet.

        Raises:
            _ClockSkew: refused for clock skew.
            FedsecError subclass: a refusal no retry can change (see :meth:`request`).
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
                skip_auto_headers=_SKIPPED_HEADERS,
                timeout=call.timeout,
                allow_redirects=False,
            ) as resp:
                if 200 <= resp.status < 300:
                    return await read_limited(resp, call.max_bytes, call.what)
                if resp.status < 400:
                    raise AggregatorRefused(
                        f"aggregator answered {call.request} with unexpected HTTP {resp.status}",
                        f"http_{resp.status}",
                        resp.status,
                    )
                raw = await read_limited(resp, MAX_ERROR_BYTES, call.what, lenient=True)
                return self._judge(call, resp.status, raw, resp.headers)
        except _RETRYABLE_EXCEPTIONS as exc:
            return _Setback(refusals.describe_failure(exc))

    def _judge(self, call: _Call, status: int, raw: bytes, headers: Mapping[str, str]) -> _Setback:
        """Sort an error answer: what a later try may pass is a setback, the rest raises.

        Raises:
            _ClockSkew: a ``clock_skew`` refusal, with the offset its ``Date`` header gives.
            FedsecError subclass: a refusal no retry can change.
        """
        reason = f"HTTP {status} {refusals.short_reason(raw)}".strip()
        retry_after = refusals.parse_retry_after(headers.get("Retry-After"))
        if status >= 500 and status != 503:
            return _Setback(reason)  # our aggregator's bug or a proxy's: as unreachable
        refusal = refusals.error_from_response(status, raw, call.request, retry_after)
        if isinstance(refusal, ClockSkewError):
            offset_s = refusals.clock_offset(headers.get("Date"), self._clock())
            raise _ClockSkew(refusal, offset_s)
        if status == 503 and refusals.error_code(raw) == NOT_LEADER:
            return _Setback(reason, retry_after, refusal, True, headers.get(LEADER_HEADER))
        if isinstance(refusal, RetryLater | RequestTimeout):
            return _Setback(reason, retry_after, refusal)
        if isinstance(refusal, ReplayError):
            return _Setback(reason, None, refusal)  # nonce store full: back off, sign anew
        raise refusals.for_operator(call.request, refusal, self.identity.key_id)

    def _correct_clock(self, call: _Call, skew: _ClockSkew) -> None:
        """Sign from now on with the aggregator's time.

        Raises:
            ClockSkewError: the answer carried no usable ``Date`` header.
        """
        if skew.offset_s is None:
            raise refusals.no_date_to_correct(call.request, skew.refusal)
        self.clock_offset_s = skew.offset_s
        log.warning(
            "aggregator_clock_offset offset_s=%.0f request=%r detail=%r",
            skew.offset_s,
            call.request,
            f"clock offset of {skew.offset_s:.0f} s against the aggregator; check NTP",
        )

    async def json(
        self,
        route: Route,
        kind: type[T],
        *,
        query: Mapping[str, int | str] | None = None,
        payload: Any = None,
        max_bytes: int = MAX_JSON_BYTES,
        what: str,
        timeout_s: float | None = None,
    ) -> T:
        """:meth:`request` with ``payload`` sent as JSON, the answer decoded as ``kind``."""
        raw = await self.request(
            route,
            query=query,
            body=b"" if payload is None else encode(payload),
            content_type=None if payload is None else "application/json",
            max_bytes=max_bytes,
            what=what,
            timeout_s=timeout_s,
        )
        return decode(raw, kind, max_bytes=max_bytes, what=what, unique_keys=False)


async def read_limited(
    resp: aiohttp.ClientResponse, max_bytes: int, what: str, *, lenient: bool = False
) -> bytes:
    """Read a body of at most ``max_bytes``, refusing before reading when it says it is larger.

    With ``lenient`` (error bodies) an oversized body is cut at the limit rather than
    refused: the status already says what happened.

    Raises:
        PayloadTooLarge: the body is, or says it is, over ``max_bytes`` (not lenient).
    """
    declared = resp.content_length
    if declared is not None and declared > max_bytes and not lenient:
        raise PayloadTooLarge(
            f"aggregator's {what} is {declared} bytes, over the limit of {max_bytes}"
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await resp.content.read(READ_CHUNK)
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
