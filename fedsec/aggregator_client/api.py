"""The client: one typed method per endpoint of :mod:`fedsec.protocol.endpoints`, over
the signed transport.  The round, model and roster calls are here; the SecAgg+ stage
calls are in :mod:`.stages` and the audit calls in :mod:`.audit`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import TracebackType

import aiohttp
import msgspec

from fedsec import errors
from fedsec.aggregator_client.audit import AuditCalls
from fedsec.aggregator_client.calls import route, seconds
from fedsec.aggregator_client.custodian import CustodianCalls
from fedsec.aggregator_client.limits import (
    DEFAULT_MAX_MODEL_BYTES,
    LONG_POLL_SLACK_S,
    MAX_ERROR_BYTES,
    MAX_RECEIPT_BYTES,
)
from fedsec.aggregator_client.stages import StageCalls
from fedsec.aggregator_client.transport import AggregatorUrls, Route, Transport
from fedsec.crypto.identity import PublicIdentity, SigningIdentity
from fedsec.modelfile import MAX_MANIFEST_BYTES, ModelManifest, verify_manifest
from fedsec.protocol.roster import RosterEntry
from fedsec.protocol.wire import (
    EvaluationReport,
    FederationStatus,
    JoinRequest,
    JoinResponse,
    PrivacyReport,
    Receipt,
    RoundState,
    encode,
)


class RosterBody(msgspec.Struct, frozen=True):
    """``GET /v1/roster``: admin-signed roster entries and the admin key that signed them.

    Unknown top-level fields (a serial, the federation id) are tolerated so the
    aggregator can add context; each entry is strict.
    """

    entries: list[RosterEntry]
    admin_public_key: str


class AggregatorClient(StageCalls, AuditCalls, CustodianCalls):
    """Signed, retrying HTTP client for one aggregator (or its replicas).

    Args:
        base_url: the aggregator's base URL (``https://host:port``, optionally with a
            path prefix when behind a proxy; ``/v1/...`` is appended), or the URLs of its
            replicas: requests move between them as the transport's docstring says, and
            follow a ``not_leader`` answer only to a URL in this list.
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

    Raises:
        ConfigError: no URL, or one that is not an http(s) URL or carries a query.

    ``clock_offset_s`` is the aggregator's clock minus ours, learnt from the ``Date``
    header of a ``clock_skew`` refusal and added to every later ``created``.
    """

    def __init__(
        self,
        base_url: AggregatorUrls,
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
        transport = Transport(
            base_url,
            identity,
            timeout_s=timeout_s,
            retry_max=retry_max,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            session=session,
            sleep=sleep,
            clock=clock,
        )
        self._transport = transport
        self.aggregator = PublicIdentity(aggregator_public_key)
        # the transport's settings, as it normalised them; fixed for the client's life
        self.base_urls = transport.base_urls
        self.identity = transport.identity
        self.timeout_s = transport.timeout_s
        self.retry_max = transport.retry_max
        self.backoff_initial_s = transport.backoff_initial_s
        self.backoff_max_s = transport.backoff_max_s

    @property
    def base_url(self) -> str:
        """The aggregator URL requests go to now (the one that answered last)."""
        return self._transport.base_url

    @property
    def clock_offset_s(self) -> float:
        """The aggregator's clock minus ours, seconds (0 until a ``clock_skew`` refusal)."""
        return self._transport.clock_offset_s

    @clock_offset_s.setter
    def clock_offset_s(self, value: float) -> None:
        self._transport.clock_offset_s = value

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
        await self._transport.close()

    def for_group(self, url: str) -> AggregatorClient:
        """A client for a shard group's server at ``url`` (from the signed spec), with
        this client's URLs after it: a try that cannot reach the group server moves on
        to them as the transport's rules say.  Same identity, pinned key, settings and
        connection pool (not closed by the new client's :meth:`close`)."""
        transport = self._transport
        return AggregatorClient(
            (url, *(u for u in self.base_urls if u != url)),
            self.identity,
            self.aggregator.public_bytes,
            timeout_s=self.timeout_s,
            retry_max=self.retry_max,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            session=transport.shared_session(),
            sleep=transport.sleep,
            clock=transport.clock,
        )

    # -- rounds, models, roster -------------------------------------------------------

    async def health(self) -> bool:
        """``GET /health``: whether the aggregator says it is up."""
        raw = await self._transport.request(
            route("health"), max_bytes=MAX_ERROR_BYTES, what="health"
        )
        try:
            return bool(msgspec.json.decode(raw).get("status") == "ok")
        except (msgspec.DecodeError, AttributeError):
            return False

    async def status(self) -> FederationStatus:
        """``GET /status``: the federation's status and round history (summaries)."""
        return await self._transport.json(route("status"), FederationStatus, what="status")

    async def get_round(self, wait_token: int | None = None, timeout: float = 0.0) -> RoundState:
        """``GET /round``: the current round; with a token, long-poll until it changes.

        Args:
            wait_token: the token of the last state seen; the server answers when it
                changes or after ``timeout`` seconds.  None answers at once.
            timeout: seconds the server may wait.
        """
        query: dict[str, int | str] = {}
        if wait_token is not None:
            query = {"wait": wait_token, "timeout": seconds(timeout)}
        return await self._transport.json(
            route("get_round"),
            RoundState,
            query=query,
            what="round state",
            timeout_s=self.timeout_s + max(timeout, 0.0) + LONG_POLL_SLACK_S,
        )

    async def join(self, round: int, attempt: int, request: JoinRequest) -> JoinResponse:
        """``POST /rounds/{r}/join``."""
        return await self._transport.json(
            route("join", round=round),
            JoinResponse,
            query={"attempt": attempt},
            payload=request,
            what="join response",
        )

    async def report(self, round: int, attempt: int, report: PrivacyReport) -> None:
        """``POST /rounds/{r}/report``: the signed privacy report."""
        await self._transport.request(
            route("report", round=round),
            query={"attempt": attempt},
            body=encode(report),
            content_type="application/json",
            max_bytes=MAX_ERROR_BYTES,
            what="report answer",
        )

    async def evaluation(self, round: int, attempt: int, report: EvaluationReport) -> None:
        """``POST /rounds/{r}/evaluation``: the signed evaluation report of the model that
        attempt ``attempt`` of round ``r`` produced."""
        await self._transport.request(
            route("evaluation", round=round),
            query={"attempt": attempt},
            body=encode(report),
            content_type="application/json",
            max_bytes=MAX_ERROR_BYTES,
            what="evaluation answer",
        )

    async def receipt(self, round: int) -> Receipt:
        """``GET /rounds/{r}/receipt``: our receipt for round ``r``, verified."""
        raw = await self._transport.request(
            route("receipt", round=round), max_bytes=MAX_RECEIPT_BYTES, what="receipt"
        )
        return self._verified_receipt(raw)

    async def latest_manifest(self) -> ModelManifest:
        """``GET /models/latest``: the newest model manifest, signature verified."""
        return await self._manifest(route("latest_manifest"))

    async def manifest(self, version: int) -> ModelManifest:
        """``GET /models/{v}/manifest``: signature verified; the file hash is the caller's."""
        manifest = await self._manifest(route("manifest", version=version))
        if manifest.version != version:
            raise errors.IntegrityError(
                f"asked for the manifest of model v{version}, got v{manifest.version}"
            )
        return manifest

    async def made_as(self, manifest: ModelManifest) -> str:
        """The kind of the version whose file ``manifest`` names: a rollback's target's
        (so a rollback to a hidden version is read as the sealed release it is).

        Raises:
            IntegrityError: a rollback that names no earlier version.
            FedsecError: the aggregator's refusal.
        """
        while manifest.kind == "rollback":
            if manifest.parent is None or manifest.parent >= manifest.version:
                raise errors.IntegrityError(
                    f"rollback v{manifest.version} names no earlier version"
                )
            manifest = await self.manifest(manifest.parent)
        return manifest.kind

    async def model_bytes(self, version: int, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> bytes:
        """``GET /models/{v}``: the safetensors file, refused past ``max_bytes``."""
        return await self._transport.request(
            route("model", version=version), max_bytes=max_bytes, what=f"model v{version}"
        )

    async def roster(self) -> RosterBody:
        """``GET /roster``: admin-signed entries; the caller verifies them, pinning the admin."""
        return await self._transport.json(route("get_roster"), RosterBody, what="roster")

    async def _manifest(self, manifest_route: Route) -> ModelManifest:
        raw = await self._transport.request(
            manifest_route, max_bytes=MAX_MANIFEST_BYTES, what="model manifest"
        )
        manifest = ModelManifest.from_json(raw)
        verify_manifest(manifest, self.aggregator.public_bytes)
        return manifest
