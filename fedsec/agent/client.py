"""The agent's HTTP client for the aggregator API (one method per endpoint of fedsec.wire).

Transport only: it builds URLs, signs every request (RFC 9421, also GETs, whose
body is empty), retries what may succeed on a second try, checks response sizes
before reading them and decodes answers into the typed messages of
:mod:`fedsec.wire`.  Protocol decisions belong to :mod:`fedsec.agent.runtime`.

Retry policy: connection failures, timeouts and 5xx answers are retried with
exponential backoff and jitter (``backoff_initial_s`` doubling up to
``backoff_max_s``, each delay drawn from [d/2, d] so agents that lost the
aggregator together do not return together); every retry is signed afresh, with
a new nonce, because the aggregator refuses a replayed one.  A 4xx is never
retried: it is the aggregator's considered answer and is raised at once as the
:class:`~fedsec.errors.FedsecError` subclass named by its ``error`` code (or
:class:`~fedsec.errors.AggregatorRefused` for a code this client does not know),
carrying the server's ``detail`` sentence.  A retried POST that the aggregator
did process before the connection broke comes back as a 409 ``duplicate``;
callers decide whether that means success.

The objects the aggregator signs are checked here against its pinned key as they
arrive: receipts and model manifests (their signature; the manifest's file hash is
checked by the caller, which holds the file).  Round specs are verified by the
runtime, which words the refusal.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final, TypeVar

import aiohttp
import msgspec
from yarl import URL

from fedsec import errors
from fedsec.aggregator.roster import RosterEntry
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import PublicIdentity, SigningIdentity
from fedsec.errors import (
    AggregatorRefused,
    AggregatorUnreachable,
    FedsecError,
    PayloadError,
    PayloadTooLarge,
)
from fedsec.modelfile import MAX_MANIFEST_BYTES, ModelManifest, verify_manifest
from fedsec.wire import (
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
#: Default cap on a model download when the caller gives none: 1 GiB is a float32
#: model of 256M parameters, far above the bundled tasks; the runtime passes a cap
#: derived from its own model's size instead.
DEFAULT_MAX_MODEL_BYTES: Final = 1024 * 1024 * 1024
#: Extra seconds a long-poll request may take beyond the wait the server was asked
#: for: the server answers at the end of the wait, and the answer still has to travel.
LONG_POLL_SLACK_S: Final = 15.0
#: Chunk size for streamed reads; 64 KiB is aiohttp's own default read buffer size.
_READ_CHUNK: Final = 64 * 1024

_RETRYABLE_EXCEPTIONS: Final = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)

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
        if cls.__module__ == errors.__name__ and cls is not AggregatorRefused:
            found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


_ERROR_CLASSES: Final = _error_classes()


def error_from_response(status: int, raw: bytes, request: str) -> FedsecError:
    """Turn a 4xx answer into the matching FedsecError, carrying the server's sentence.

    Args:
        status: the HTTP status.
        raw: the body (already size-limited).
        request: ``"METHOD /path"``, for the note and for bodies that are not ErrorBody.
    """
    try:
        body = msgspec.json.decode(raw, type=ErrorBody)
    except (msgspec.ValidationError, msgspec.DecodeError):
        text = raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
        exc: FedsecError = AggregatorRefused(
            f"aggregator answered HTTP {status} to {request}: {text}", f"http_{status}", status
        )
    else:
        cls = _ERROR_CLASSES.get(body.error)
        if cls is None or cls is FedsecError:
            exc = AggregatorRefused(body.detail, body.error, status)
        else:
            exc = cls(body.detail)
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
            self._session = aiohttp.ClientSession()
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
        """Send one signed request, retrying transient failures; return the body.

        Raises:
            FedsecError subclass: a 4xx answer (never retried).
            AggregatorRefused: an unexpected non-2xx, non-5xx status (e.g. a redirect).
            AggregatorUnreachable: every attempt failed (connection, timeout or 5xx).
            PayloadTooLarge: the answer exceeds ``max_bytes``.
        """
        target = self._target(path, query)
        url = URL(self._origin + target, encoded=True)
        request = f"{method} {target}"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        attempts = self.retry_max + 1
        reason = ""
        for attempt in range(attempts):
            if attempt:
                delay = self._backoff(attempt - 1)
                log.warning(
                    "aggregator_retry request=%r attempt=%d/%d delay_s=%.2f reason=%r",
                    request,
                    attempt + 1,
                    attempts,
                    delay,
                    reason,
                )
                await asyncio.sleep(delay)
            headers: dict[str, str] = {}
            if content_type is not None:
                headers["Content-Type"] = content_type
            headers.update(sign_request(self.identity, method, target, headers, body))
            try:
                async with self._http().request(
                    method,
                    url,
                    data=body if method != "GET" else None,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                ) as resp:
                    status = resp.status
                    if status >= 500:
                        detail = await _read_limited(resp, MAX_ERROR_BYTES, what, lenient=True)
                        reason = f"HTTP {status} {_short(detail)}".strip()
                        continue
                    if 400 <= status < 500:
                        raw = await _read_limited(resp, MAX_ERROR_BYTES, what, lenient=True)
                        raise error_from_response(status, raw, request)
                    if not 200 <= status < 300:
                        raise AggregatorRefused(
                            f"aggregator answered {request} with unexpected HTTP {status}",
                            f"http_{status}",
                            status,
                        )
                    return await _read_limited(resp, max_bytes, what)
            except _RETRYABLE_EXCEPTIONS as exc:
                reason = _describe(exc)
        raise AggregatorUnreachable(
            f"aggregator at {self.base_url} unreachable after {attempts} attempts: {reason}"
        )

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
