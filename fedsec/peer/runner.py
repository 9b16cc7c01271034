"""One peer's loop of rounds: train, send to the neighbours, wait for theirs, combine;
then each further exchange of the round: send the mixed model, wait, combine.

The I/O around :class:`fedsec.peer.gossip.GossipPeer`: training runs in a worker thread
(the members' training entry point, :func:`fedsec.learning.training.train_local`), sends
go to every neighbour at once, and the wait for the neighbours' models ends when all of
them are in or at the round timeout, whichever is first: a slow or missing neighbour is
skipped, never waited for past it.  Each round's training is charged to the member's
privacy ledger before it starts and marked released before its update can leave
(:mod:`fedsec.peer.privacy`); a spent budget stops the peer before it trains.

A peer that notices it missed rounds (a neighbour's round too far ahead to use,
:meth:`fedsec.peer.gossip.GossipPeer.noticed_behind`; or, with ``catch_up_at_start``, a
restarted peer) asks every neighbour for a signed offer (:func:`catch_up`) and rejoins
from those that pass :func:`fedsec.peer.catchup.open_offer`; each refused offer is logged
with its code and reason and left out, and the peer is unchanged unless a neighbour is
more than :data:`~fedsec.peer.limits.MAX_AHEAD` rounds ahead of it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
import numpy as np

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import FedsecError
from fedsec.learning.training import DPParams, train_local
from fedsec.peer import messages
from fedsec.peer.catchup import NONCE_HEX, Asked, CatchUp, OfferRequest, open_offer
from fedsec.peer.gossip import GossipPeer, RoundOutcome
from fedsec.peer.http import fetch_offer, send_model
from fedsec.peer.limits import (
    DEFAULT_OFFER_TIMEOUT_S,
    DEFAULT_ROUND_TIMEOUT_S,
    DEFAULT_SEND_TIMEOUT_S,
    MAX_AHEAD,
)
from fedsec.peer.messages import PeerModel, Vector
from fedsec.peer.privacy import PeerCharging
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

log = logging.getLogger("fedsec.peer")

#: Local training of one round: the model it starts from -> the model it ends with.
Trainer = Callable[[Vector, int], Vector]


@dataclass(frozen=True)
class Timing:
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    offer_timeout_s: float = DEFAULT_OFFER_TIMEOUT_S


DEFAULT_TIMING: Final = Timing()


def task_trainer(
    task: Task,
    x: np.ndarray,
    y: np.ndarray,
    params: TrainingParams,
    dp: DPParams | None,
    seed: int,
) -> Trainer:
    """A trainer running the task's model through the members' local training; round
    ``r`` trains with seed ``seed + r`` (secret in production, as the agent's is)."""

    def train(model: Vector, round_: int) -> Vector:
        net = task.build_model(0)
        load_flat_params(net, model.astype(np.float32))
        train_local(net, x, y, params, dp, "cpu", seed + round_, task=task)
        trained: Vector = flatten_params(net).astype(np.float64)
        return trained

    return train


async def run_rounds(
    peer: GossipPeer,
    identity: SigningIdentity,
    neighbour_urls: Mapping[str, str],
    trainer: Trainer,
    rounds: int,
    arrived: asyncio.Condition,
    timing: Timing = DEFAULT_TIMING,
    roster: Mapping[str, bytes] | None = None,
    catch_up_at_start: bool = False,
    tls: ssl.SSLContext | None = None,
    charging: PeerCharging | None = None,
) -> list[RoundOutcome]:
    """Run ``peer`` until its round is ``rounds``; ``arrived`` is its endpoint's
    condition (:data:`fedsec.peer.http.ARRIVED`).  With ``roster`` (key id -> public
    key) the peer catches up when it notices it missed rounds, and first thing with
    ``catch_up_at_start``; ``tls`` verifies the neighbours' https endpoints (None: the
    system's trust store).  With ``charging`` each round's training is charged to the
    member's privacy ledger before it starts and released before its update leaves
    (:mod:`fedsec.peer.privacy`); None charges nothing (simulations without DP).

    Returns:
        Each exchange's outcome, in order.

    Raises:
        BudgetExhausted: the next round would exceed the member's budget; the peer
            stops before training it, as it was (nothing sent, nothing journalled).
    """
    outcomes = []
    connector = aiohttp.TCPConnector(ssl=tls) if tls is not None else None
    async with aiohttp.ClientSession(connector=connector) as session:
        if roster is not None and catch_up_at_start:
            await catch_up(session, peer, identity, neighbour_urls, roster, timing)
        while peer.round < rounds:
            if roster is not None and peer.noticed_behind():
                await catch_up(session, peer, identity, neighbour_urls, roster, timing)
                if peer.round >= rounds:
                    break
            charge = None
            if charging is not None:  # before training: see fedsec.peer.privacy
                charge = await asyncio.to_thread(charging.charge, peer.round)
            start = peer.model.copy()
            trained = await asyncio.to_thread(trainer, start, peer.round)
            if charging is not None and charge is not None:  # before it can leave
                await asyncio.to_thread(charging.release, charge, peer.round)
            message = peer.own_model(trained)
            while True:
                await _send_all(session, peer, identity, neighbour_urls, message, timing)
                outcomes.append(await _combine_when_ready(peer, arrived, timing))
                if peer.exchange == 0:
                    break
                message = peer.mixing_model()
    return outcomes


async def _combine_when_ready(
    peer: GossipPeer, arrived: asyncio.Condition, timing: Timing
) -> RoundOutcome:
    async with arrived:
        try:
            await asyncio.wait_for(arrived.wait_for(peer.ready), timing.round_timeout_s)
        except TimeoutError:
            log.info("event=peer_round_timeout round=%d exchange=%d", peer.round, peer.exchange)
    return peer.combine()


async def _send_all(
    session: aiohttp.ClientSession,
    peer: GossipPeer,
    identity: SigningIdentity,
    neighbour_urls: Mapping[str, str],
    message: PeerModel,
    timing: Timing,
) -> None:
    async def one(to: str, url: str) -> None:
        try:
            status, text = await send_model(session, url, identity, message, timing.send_timeout_s)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("event=peer_send_failed to=%s round=%d error=%r", to, message.round, exc)
            return
        if status == 200:
            peer.record_sent(to, message)
        else:
            log.info("event=peer_send_refused to=%s status=%d body=%s", to, status, text[:200])

    await asyncio.gather(*(one(to, url) for to, url in sorted(neighbour_urls.items())))


async def catch_up(
    session: aiohttp.ClientSession,
    peer: GossipPeer,
    identity: SigningIdentity,
    neighbour_urls: Mapping[str, str],
    roster: Mapping[str, bytes],
    timing: Timing = DEFAULT_TIMING,
) -> CatchUp | None:
    """Ask every neighbour for its offer and, if one is more than
    :data:`~fedsec.peer.limits.MAX_AHEAD` rounds ahead of ``peer``, rejoin from the
    offers that pass every check (:meth:`fedsec.peer.gossip.GossipPeer.catch_up`).

    Returns:
        Where the peer continues, or None when it stays as it was (the log says why).
    """
    nonce = secrets.token_hex(NONCE_HEX // 2)
    request = OfferRequest(peer.federation_id, identity.key_id, nonce)

    async def one(sender: str, url: str) -> tuple[str, messages.PeerModel | None]:
        asked = Asked(
            peer.federation_id,
            identity.key_id,
            nonce,
            sender,
            roster[sender],
            peer.values,
            peer.round,
        )
        try:
            raw = await fetch_offer(
                session, url, identity, request, peer.values, timing.offer_timeout_s
            )
            return sender, open_offer(raw, asked)
        except FedsecError as exc:
            log.info("event=peer_offer_refused sender=%s code=%s detail=%s", sender, exc.code, exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("event=peer_offer_failed sender=%s error=%r", sender, exc)
        return sender, None

    answers = await asyncio.gather(*(one(n, u) for n, u in sorted(neighbour_urls.items())))
    offered = {n: m for n, m in answers if m is not None}
    newest = max((m.round for m in offered.values()), default=None)
    if newest is None or newest <= peer.round + MAX_AHEAD:
        log.info("event=peer_not_behind round=%d newest_offer=%s", peer.round, newest)
        return None
    try:
        caught = peer.catch_up({n: messages.encode(m) for n, m in offered.items()}, nonce)
    except FedsecError as exc:
        log.info("event=peer_catch_up_refused code=%s detail=%s", exc.code, exc)
        return None
    log.info("event=peer_caught_up round=%d sources=%s", caught.round, ",".join(caught.sources))
    return caught
