"""One peer's loop of rounds: train, send to the neighbours, wait for theirs, combine;
then each further exchange of the round: send the mixed model, wait, combine.

The I/O around :class:`fedsec.peer.gossip.GossipPeer`: training runs in a worker thread
(the members' training entry point, :func:`fedsec.learning.training.train_local`), sends
go to every neighbour at once, and the wait for the neighbours' models ends when all of
them are in or at the round timeout, whichever is first: a slow or missing neighbour is
skipped, never waited for past it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
import numpy as np

from fedsec.crypto.identity import SigningIdentity
from fedsec.learning.training import DPParams, train_local
from fedsec.peer.gossip import GossipPeer, RoundOutcome
from fedsec.peer.http import send_model
from fedsec.peer.limits import DEFAULT_ROUND_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S
from fedsec.peer.messages import PeerModel, Vector
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

log = logging.getLogger("fedsec.peer")

#: Local training of one round: the model it starts from -> the model it ends with.
Trainer = Callable[[Vector, int], Vector]


@dataclass(frozen=True)
class Timing:
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S


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
) -> list[RoundOutcome]:
    """Run ``rounds`` rounds of ``peer``; ``arrived`` is its endpoint's condition
    (:data:`fedsec.peer.http.ARRIVED`).  Returns each exchange's outcome, in order."""
    outcomes = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            start = peer.model.copy()
            trained = await asyncio.to_thread(trainer, start, peer.round)
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
