"""Alert webhooks (issue 14): an alert raised while the aggregator serves is POSTed as a
signed JSON :class:`~fedsec.aggregator.ops.webhooks.WebhookPayload` that a receiver
verifies with the aggregator's pinned public key (RFC 9421, as ``docs/monitoring.md``
shows); failed deliveries are retried, each freshly signed, then given up on; raising
never waits for a receiver; the payload's capability acknowledges its alert and nothing
else does.

The receiver is a real aiohttp application on 127.0.0.1 in the test's event loop; the
aggregator is served as ``fedsec aggregator serve`` serves it
(:func:`tests.support.hostile.serve`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from multidict import CIMultiDict

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.keys import OPS
from fedsec.aggregator.ops import Operations
from fedsec.aggregator.ops.webhooks import WebhookPayload
from fedsec.aggregator.rounds.events import AlertRaised, Event
from fedsec.aggregator.storage.interfaces import AlertRow
from fedsec.crypto.httpsig import NonceCache, RequestVerifier
from fedsec.crypto.identity import key_id
from fedsec.errors import AuthError, ReplayError
from fedsec.protocol import wire
from tests.support.aggregator import (
    FED,
    FakeClock,
    Federation,
    fix_cohort,
    identity_for,
    log_entries,
    make_federation,
)
from tests.support.hostile import (
    HOST,
    RawAnswer,
    Served,
    assert_unchanged,
    durable_state,
    exchange,
    request_head,
    serve,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

HOOK = "/hook"
WAIT_S = 5.0  # far above what a delivery on loopback takes; far below the test timeout
# Fast retries, and a round that never moves on its own (the ticker runs a fake clock).
ALERTS = {"webhook_backoff_s": 0.01, "webhook_timeout_s": 2.0, "webhook_attempts": 3}
ROUND = {"open_s": 3600.0}
AGENTS = ("a0", "a1", "a2")


# -- a webhook receiver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    method: str
    raw_path: str
    headers: CIMultiDict[str]
    body: bytes

    def payload(self) -> WebhookPayload:
        return msgspec.json.decode(self.body, type=WebhookPayload)

    def nonce(self) -> str:
        match = re.search(r';nonce="([^"]+)"', self.headers["Signature-Input"])
        assert match is not None, self.headers["Signature-Input"]
        return match.group(1)


@dataclass
class Receiver:
    """Records every delivery; answers ``answers`` first (then 204), or, when ``hold``,
    never answers until the test ends."""

    answers: list[int] = field(default_factory=list)
    hold: bool = False
    port: int = 0
    deliveries: list[Delivery] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}{HOOK}"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.deliveries.append(
            Delivery(request.method, request.raw_path, CIMultiDict(request.headers), body)
        )
        if self.hold:
            # the sender gives up long before; released when the test ends
            await asyncio.wait_for(self.release.wait(), 10.0)
        status = self.answers.pop(0) if self.answers else 204
        return web.Response(status=status)

    async def wait_for(self, count: int) -> list[Delivery]:
        """The first ``count`` deliveries, once they have arrived (within WAIT_S)."""
        async with asyncio.timeout(WAIT_S):
            while len(self.deliveries) < count:
                await asyncio.sleep(0.01)
        return self.deliveries[:count]


StartReceiver = Callable[..., Awaitable[Receiver]]


@pytest_asyncio.fixture
async def receivers() -> AsyncIterator[StartReceiver]:
    started: list[tuple[Receiver, web.AppRunner]] = []

    async def start(answers: tuple[int, ...] = (), hold: bool = False) -> Receiver:
        receiver = Receiver(list(answers), hold)
        app = web.Application()
        app.router.add_post(HOOK, receiver.handle)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        receiver.port = runner.addresses[0][1]
        started.append((receiver, runner))
        return receiver

    yield start
    for receiver, runner in started:
        receiver.release.set()
        await runner.cleanup()


def _verifier(public: bytes) -> RequestVerifier:
    """What a receiver runs: the aggregator's pinned key, replays refused."""
    pinned = key_id(public)
    return RequestVerifier(lambda kid: public if kid == pinned else None, NonceCache(600))


# -- the aggregator --------------------------------------------------------------------------------


@dataclass
class Aggregator:
    fed: Federation
    served: Served
    clock: FakeClock
    heard: list[AlertRaised]

    @property
    def ops(self) -> Operations:
        return self.served.app[OPS]

    @property
    def port(self) -> int:
        return self.served.port

    def raise_alert(self, kind: Any = "round_stalled", subject: str = "round 1.0 open") -> AlertRow:
        row = self.served.coord.alert_desk.raise_alert(kind, subject, f"{kind} about {subject}")
        assert row is not None
        return row

    def token_of(self, row: AlertRow) -> str:
        (event,) = [e for e in self.heard if e.alert.id == row.id]
        return event.ack_token

    def alert(self, alert_id: int) -> AlertRow | None:
        return self.fed.ws.state.alerts.get(alert_id)


StartAggregator = Callable[..., Awaitable[Aggregator]]


def _federation(root: Path, alerts: Mapping[str, Any]) -> Federation:
    """A fresh workspace whose federation.toml carries ``alerts``, with AGENTS enrolled."""
    return make_federation(
        root, AGENTS, round=ROUND, validation=False, sections={"alerts": dict(alerts)}
    )


@pytest_asyncio.fixture
async def aggregators(tmp_path: Path, receivers: StartReceiver) -> AsyncIterator[StartAggregator]:
    """Serves aggregators (stopped before the receivers, which this depends on)."""
    started: list[Aggregator] = []

    async def start(
        webhooks: list[str],
        prepare: Callable[[Federation, FakeClock], None] | None = None,
        **alerts: Any,
    ) -> Aggregator:
        fed = _federation(
            tmp_path / f"ws{len(started)}", {**ALERTS, **alerts, "webhooks": webhooks}
        )
        clock = FakeClock()
        if prepare is not None:
            prepare(fed, clock)
        coord = Coordinator(fed.ws, clock=clock)
        heard: list[AlertRaised] = []

        def listen(event: Event) -> None:
            if isinstance(event, AlertRaised):
                heard.append(event)

        coord.events.subscribe(listen, replay=True)
        served = await serve(fed.ws, coord)
        agg = Aggregator(fed, served, clock, heard)
        started.append(agg)
        return agg

    yield start
    for agg in started:
        await agg.served.stop()
        agg.fed.ws.close()


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- delivery --------------------------------------------------------------------------------------


async def test_an_alert_is_delivered_signed_by_the_aggregator(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    receiver = await receivers()
    agg = await aggregators([receiver.url], stall_s=60.0)
    public = agg.fed.ws.signer.public_bytes
    # raised by the served aggregator's own ticker: the round has not moved for stall_s
    agg.clock.advance(61.0)
    (delivery,) = await receiver.wait_for(1)
    (row,) = agg.fed.ws.state.alerts.recent()
    assert (row.kind, row.subject) == ("round_stalled", "round 1.0 open")

    assert (delivery.method, delivery.raw_path) == ("POST", HOOK)
    assert delivery.headers["Content-Type"] == "application/json"
    payload = delivery.payload()
    assert payload.federation_id == FED
    assert payload.aggregator_public_key == public.hex()
    assert payload.alert == wire.AlertView(
        id=row.id,
        kind="round_stalled",
        subject="round 1.0 open",
        detail=row.detail,
        raised_at=row.raised_at,
        acked_at=None,
        acked_by=None,
    )
    assert payload.ack_path == f"/v1/alerts/{row.id}/ack"
    assert re.fullmatch(r"[0-9a-f]{64}", payload.ack_token)
    assert hashlib.sha256(payload.ack_token.encode()).hexdigest() == row.ack_sha256
    assert payload.ack_token.encode() not in b"".join(
        json.dumps(e).encode() for e in log_entries(agg.fed.ws)
    )

    verifier = _verifier(public)
    # the body altered on the way: refused (and its nonce not spent)
    tampered = delivery.body.replace(b"round_stalled", b"round_aborted")
    assert tampered != delivery.body
    with pytest.raises(AuthError) as refused:
        verifier.verify("POST", delivery.raw_path, delivery.headers, tampered)
    assert not isinstance(refused.value, ReplayError)
    # sent to another path than the one signed: refused
    with pytest.raises(AuthError):
        verifier.verify("POST", "/other", delivery.headers, delivery.body)
    # a receiver pinning another key refuses it
    stranger = identity_for("not-the-aggregator").public_bytes
    with pytest.raises(AuthError):
        RequestVerifier(lambda kid: stranger, NonceCache(600)).verify(
            "POST", delivery.raw_path, delivery.headers, delivery.body
        )
    assert verifier.verify("POST", delivery.raw_path, delivery.headers, delivery.body) == key_id(
        public
    )
    # ...once: the same delivery replayed is refused
    with pytest.raises(ReplayError):
        verifier.verify("POST", delivery.raw_path, delivery.headers, delivery.body)

    await agg.ops.webhooks.drain(WAIT_S)
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (1, 0)


def _damage_a_model(fed: Federation, clock: FakeClock) -> None:
    """Close round 1 (version 2), then damage version 2's file on disk."""
    coord = Coordinator(fed.ws, clock=clock)
    cohort = fix_cohort(coord, fed.identities, AGENTS)
    for m in AGENTS:
        coord.advertise(m, 1, 0, cohort.advertise(m))
    for m in AGENTS:
        coord.share_keys(m, 1, 0, cohort.share_keys(m, coord.key_list(m, 1, 0)))
    for m in AGENTS:
        cohort.receive_shares(m, coord.share_relay(m, 1, 0))
    for m in AGENTS:
        coord.masked_input(m, 1, 0, *cohort.upload(m))
    for m in AGENTS:
        coord.consistency(m, 1, 0, cohort.sign(m, coord.unmask_request(m, 1, 0)))
    for m in AGENTS:
        coord.unmask(m, 1, 0, cohort.unmask(m, coord.consistency_proof(m, 1, 0)))
    newest = fed.ws.models.latest()
    assert newest.version == 2
    path = fed.root / "models" / f"{newest.sha256}.safetensors"
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")


async def test_an_alert_raised_at_start_up_is_delivered_once_serving(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    receiver = await receivers()
    agg = await aggregators([receiver.url], prepare=_damage_a_model)
    (row,) = agg.fed.ws.state.alerts.recent()
    assert row.kind == "model_unusable"  # raised while the coordinator started
    (delivery,) = await receiver.wait_for(1)
    payload = delivery.payload()
    assert (payload.alert.id, payload.alert.kind, payload.alert.subject) == (
        row.id,
        "model_unusable",
        "model 2",
    )
    assert hashlib.sha256(payload.ack_token.encode()).hexdigest() == row.ack_sha256
    _verifier(agg.fed.ws.signer.public_bytes).verify(
        delivery.method, delivery.raw_path, delivery.headers, delivery.body
    )
    await agg.ops.webhooks.drain(WAIT_S)
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (1, 0)


async def test_every_configured_receiver_gets_every_alert(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    first, second = await receivers(), await receivers()
    agg = await aggregators([first.url, second.url])
    rows = [agg.raise_alert("round_aborted", f"round 1.{i}") for i in range(3)]
    await agg.ops.webhooks.drain(WAIT_S)
    for receiver in (first, second):
        ids = sorted(d.payload().alert.id for d in receiver.deliveries)
        assert ids == [r.id for r in rows]
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (6, 0)


async def test_a_failing_receiver_is_retried_with_fresh_signatures(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    receiver = await receivers(answers=(500, 500))
    agg = await aggregators([receiver.url], webhook_attempts=5)
    row = agg.raise_alert()
    await agg.ops.webhooks.drain(WAIT_S)
    deliveries = receiver.deliveries
    assert len(deliveries) == 3
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (1, 0)
    # the same alert each time, each signed afresh: no retry looks like a replay
    assert {d.body for d in deliveries} == {deliveries[0].body}
    assert deliveries[0].payload().alert.id == row.id
    assert len({d.nonce() for d in deliveries}) == 3
    assert len({d.headers["Signature"] for d in deliveries}) == 3
    verifier = _verifier(agg.fed.ws.signer.public_bytes)
    for d in deliveries:
        verifier.verify(d.method, d.raw_path, d.headers, d.body)


async def test_a_receiver_that_is_down_is_given_up_on_after_webhook_attempts(
    aggregators: StartAggregator,
) -> None:
    agg = await aggregators([f"http://{HOST}:{_closed_port()}{HOOK}"], webhook_attempts=3)
    row = agg.raise_alert()
    await agg.ops.webhooks.drain(WAIT_S)
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (0, 1)
    # the alert itself stands, open
    assert agg.alert(row.id) == row


async def test_raising_an_alert_never_waits_for_a_receiver(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    receiver = await receivers(hold=True)
    agg = await aggregators([receiver.url], webhook_timeout_s=0.3, webhook_attempts=2)
    start = time.perf_counter()
    row = agg.raise_alert()
    took = time.perf_counter() - start
    # raise_alert is synchronous and returned before any delivery was even tried
    assert receiver.deliveries == [] and agg.ops.webhooks.delivered == 0
    # one delivery waits webhook_timeout_s for this receiver: a raise that waited for it
    # would take that long at least (it takes ~10 ms here: the state commit and log entry)
    assert took < 0.3, f"raising an alert took {took:.3f} s"
    await receiver.wait_for(1)
    # while the receiver sits on the delivery, the aggregator answers
    answer = await exchange(agg.port, request_head("GET", "/v1/health"), timeout=2.0)
    assert answer.status == 200
    await agg.ops.webhooks.drain(WAIT_S)
    assert len(receiver.deliveries) == 2  # each attempt timed out after 0.3 s
    assert (agg.ops.webhooks.delivered, agg.ops.webhooks.failed) == (0, 1)
    assert agg.alert(row.id) == row


# -- acknowledging with the payload's capability ---------------------------------------------------


def _ack_request(path: str, body: bytes, content_type: str = "application/json") -> bytes:
    headers = [("Host", f"{HOST}"), ("Content-Type", content_type)]
    return request_head("POST", path, headers, content_length=len(body)) + body


async def _ack(agg: Aggregator, path: str, body: bytes) -> RawAnswer:
    answer = await exchange(agg.port, _ack_request(path, body), timeout=5.0)
    assert answer.status < 500, answer
    return answer


async def test_the_payloads_token_acknowledges_its_alert(
    receivers: StartReceiver, aggregators: StartAggregator
) -> None:
    receiver = await receivers()
    agg = await aggregators([receiver.url])
    row = agg.raise_alert()
    other = agg.raise_alert("member_refused", "member a1")
    await agg.ops.webhooks.drain(WAIT_S)
    payload = next(d.payload() for d in receiver.deliveries if d.payload().alert.id == row.id)
    assert (
        agg.ops.metrics.registry.get_sample_value("fedsec_alerts_open", {"kind": "round_stalled"})
        == 1
    )

    answer = await _ack(agg, payload.ack_path, wire.encode(wire.AlertAck(token=payload.ack_token)))
    assert answer.status == 200, answer
    view = msgspec.json.decode(answer.body, type=wire.AlertView)
    stored = agg.alert(row.id)
    assert stored is not None
    assert (view.id, view.acked_by, view.acked_at) == (row.id, "webhook", agg.clock.now)
    assert (stored.acked_by, stored.acked_at) == ("webhook", agg.clock.now)
    assert agg.alert(other.id) == other  # only its own alert
    assert not agg.ops.metrics.registry.get_sample_value(
        "fedsec_alerts_open", {"kind": "round_stalled"}
    )
    # acknowledging again (a receiver's retry) answers the same and changes nothing
    agg.clock.advance(10.0)
    again = await _ack(agg, payload.ack_path, wire.encode(wire.AlertAck(token=payload.ack_token)))
    assert (again.status, again.json()) == (200, answer.json())
    assert agg.alert(row.id) == stored

    # the same alert raised again is a new one: the old capability does not open it
    fresh = agg.raise_alert()
    assert fresh.id != row.id
    refused = await _ack(
        agg, f"/v1/alerts/{fresh.id}/ack", wire.encode(wire.AlertAck(token=payload.ack_token))
    )
    assert refused.status == 403 and refused.error()[0] == "forbidden"
    assert agg.alert(fresh.id) == fresh


@pytest.mark.parametrize(
    ("name", "path", "body", "status"),
    [
        ("forged token", "/v1/alerts/{id}/ack", "forged", 403),
        ("another alert's token", "/v1/alerts/{id}/ack", "other", 403),
        ("unknown alert", "/v1/alerts/999/ack", "forged", 403),
        ("unknown alert, real token", "/v1/alerts/999/ack", "token", 403),
        ("malformed JSON", "/v1/alerts/{id}/ack", b'{"token": ', 400),
        ("not an object", "/v1/alerts/{id}/ack", b'["x"]', 400),
        ("empty body", "/v1/alerts/{id}/ack", b"", 400),
        ("short token", "/v1/alerts/{id}/ack", {"token": "ab" * 31}, 400),
        ("long token", "/v1/alerts/{id}/ack", {"token": "ab" * 33}, 400),
        ("upper-case hex", "/v1/alerts/{id}/ack", "upper", 400),
        ("not hex", "/v1/alerts/{id}/ack", {"token": "zz" * 32}, 400),
        ("token not a string", "/v1/alerts/{id}/ack", {"token": 7}, 400),
        ("extra field", "/v1/alerts/{id}/ack", "extra", 400),
        ("oversized body", "/v1/alerts/{id}/ack", "oversized", 413),
        ("query parameter", "/v1/alerts/{id}/ack?by=me", "token", 400),
        ("id with a leading zero", "/v1/alerts/0{id}/ack", "token", 400),
        ("id not a number", "/v1/alerts/one/ack", "token", 400),
        ("negative id", "/v1/alerts/-1/ack", "token", 400),
    ],
)
async def test_anything_but_the_alerts_own_capability_is_refused(
    receivers: StartReceiver,
    aggregators: StartAggregator,
    name: str,
    path: str,
    body: Any,
    status: int,
) -> None:
    receiver = await receivers()
    agg = await aggregators([receiver.url])
    row = agg.raise_alert()
    other = agg.raise_alert("member_refused", "member a1")
    await agg.ops.webhooks.drain(WAIT_S)
    token = agg.token_of(row)
    raw: bytes
    if body == "forged":
        raw = json.dumps({"token": secrets.token_hex(32)}).encode()
    elif body == "other":
        raw = json.dumps({"token": agg.token_of(other)}).encode()
    elif body == "token":
        raw = json.dumps({"token": token}).encode()
    elif body == "upper":
        raw = json.dumps({"token": token.upper()}).encode()
    elif body == "extra":
        raw = json.dumps({"token": token, "by": "webhook"}).encode()
    elif body == "oversized":
        raw = json.dumps({"token": token, "pad": " " * 1024}).encode()
        assert len(raw) > 1024
    elif isinstance(body, dict):
        raw = json.dumps(body).encode()
    else:
        raw = body
    before = durable_state(agg.fed.ws)
    answer = await _ack(agg, path.format(id=row.id), raw)
    assert answer.status == status, (name, answer)
    error, detail = answer.error()
    assert token not in detail and token not in answer.body.decode()
    if status == 403:
        assert error == "forbidden"
        assert re.fullmatch(r"that token does not acknowledge alert \d+", detail), detail
    assert agg.alert(row.id) == row and agg.alert(other.id) == other
    assert_unchanged(before, durable_state(agg.fed.ws))
