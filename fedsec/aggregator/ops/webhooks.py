"""Alert webhooks: each alert POSTed as JSON to every configured URL, signed by the
aggregator.

The request is signed exactly as members sign theirs (RFC 9421, Ed25519, with a
``Content-Digest`` of the body) but with the aggregator's key, so a receiver verifies it
with the public key the federation publishes (``docs/monitoring.md`` shows how, with
:class:`fedsec.crypto.httpsig.RequestVerifier`).  The body carries the alert and the
capability that acknowledges it (``POST /v1/alerts/{id}/ack``).

Delivery never blocks a round: an alert is queued (bounded; an overflow is logged and
dropped) and delivered by a background task, each URL retried with exponential backoff
(``alerts.webhook_attempts``, ``alerts.webhook_backoff_s`` doubling up to
:data:`MAX_BACKOFF_S`).  A 2xx answer is delivered; anything else, or no answer within
``alerts.webhook_timeout_s``, is retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import aiohttp
import msgspec

from fedsec.aggregator.rounds.alerts import alert_view
from fedsec.aggregator.rounds.events import AlertRaised, Event
from fedsec.aio import cancel_and_wait
from fedsec.config import AlertsSection
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol import wire

log = logging.getLogger("fedsec.aggregator.webhooks")

#: The longest wait between two deliveries of one alert to one URL.
MAX_BACKOFF_S: Final = 60.0
#: Alerts waiting for delivery; past this, new ones are dropped (and logged): a receiver
#: that is down for days must not grow the aggregator's memory.
QUEUE_LIMIT: Final = 1000
#: Deliveries in flight at once, across URLs and alerts.
CONCURRENT_DELIVERIES: Final = 8


class WebhookPayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a webhook receives."""

    federation_id: str
    aggregator_public_key: str  # hex Ed25519: the key the request is signed with
    alert: wire.AlertView
    ack_path: str  # POST here (on the aggregator) with {"token": ack_token} to acknowledge
    ack_token: str


class WebhookSender:
    """Delivers alerts to ``cfg.webhooks``.

    Args:
        cfg: the ``[alerts]`` section.
        signer: the aggregator's signing identity.
        federation_id: the federation's id.
        sleep: how to wait between retries (tests pass a fast one).
    """

    def __init__(
        self,
        cfg: AlertsSection,
        signer: SigningIdentity,
        federation_id: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._cfg = cfg
        self._signer = signer
        self._federation_id = federation_id
        self._sleep = sleep
        # made now, so alerts raised before start() (at start-up) wait for delivery
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_LIMIT)
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.delivered = 0  # deliveries answered 2xx
        self.failed = 0  # (alert, URL) pairs given up on

    @property
    def enabled(self) -> bool:
        return bool(self._cfg.webhooks)

    def on_event(self, event: Event) -> None:
        """The event-bus listener: queue each new alert (never waits)."""
        if not isinstance(event, AlertRaised) or not self.enabled:
            return
        body = wire.encode(
            WebhookPayload(
                federation_id=self._federation_id,
                aggregator_public_key=self._signer.public_bytes.hex(),
                alert=alert_view(event.alert),
                ack_path=f"{wire.API_PREFIX}/alerts/{event.alert.id}/ack",
                ack_token=event.ack_token,
            )
        )
        try:
            self._queue.put_nowait(body)
        except asyncio.QueueFull:
            log.warning("event=webhook_dropped id=%d reason=queue_full", event.alert.id)

    async def start(self) -> None:
        """Start delivering (on the running event loop)."""
        if self.enabled:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop delivering; deliveries in flight are cancelled (they are logged)."""
        await cancel_and_wait(self._task, *self._inflight)

    async def drain(self, timeout: float) -> None:
        """Wait until every queued alert has been delivered or given up on (tests)."""
        async with asyncio.timeout(timeout):
            while not self._queue.empty() or self._inflight:
                await asyncio.sleep(0.01)

    async def _run(self) -> None:
        slots = asyncio.Semaphore(CONCURRENT_DELIVERIES)
        timeout = aiohttp.ClientTimeout(total=self._cfg.webhook_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                body = await self._queue.get()
                for url in self._cfg.webhooks:
                    task = asyncio.create_task(self._deliver(session, slots, url, body))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)

    async def _deliver(
        self,
        session: aiohttp.ClientSession,
        slots: asyncio.Semaphore,
        url: str,
        body: bytes,
    ) -> None:
        delay = self._cfg.webhook_backoff_s
        for attempt in range(1, self._cfg.webhook_attempts + 1):
            async with slots:
                problem = await self._post(session, url, body)
            if problem is None:
                self.delivered += 1
                log.info("event=webhook_delivered url=%s attempt=%d", url, attempt)
                return
            log.warning(
                "event=webhook_failed url=%s attempt=%d of=%d problem=%s",
                url,
                attempt,
                self._cfg.webhook_attempts,
                problem,
            )
            if attempt < self._cfg.webhook_attempts:
                await self._sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
        self.failed += 1
        log.error("event=webhook_given_up url=%s attempts=%d", url, self._cfg.webhook_attempts)

    async def _post(self, session: aiohttp.ClientSession, url: str, body: bytes) -> str | None:
        """One delivery; None when answered 2xx, else what went wrong."""
        headers = {"Content-Type": "application/json"}
        # signed afresh each time: a new created time and nonce, so a retry is never a replay
        headers.update(sign_request(self._signer, "POST", url, headers, body))
        try:
            async with session.post(url, data=body, headers=headers) as answer:
                await answer.read()
                if 200 <= answer.status < 300:
                    return None
                return f"status {answer.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return type(exc).__name__
