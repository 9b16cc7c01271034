"""A whole gossip federation on this machine: one real peer endpoint per member on
127.0.0.1, each running its own loop of rounds (``fedsec simulate --topology gossip`` and
the tests).  Nothing is shared between the members but the roster, the signed topology
and the starting model; every model travels as a signed HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web

from fedsec.crypto.identity import SigningIdentity
from fedsec.peer.gossip import GossipPeer, GossipSettings, RoundOutcome
from fedsec.peer.http import ARRIVED, peer_app
from fedsec.peer.journal import PeerJournal
from fedsec.peer.messages import Vector
from fedsec.peer.privacy import PeerCharging
from fedsec.peer.runner import DEFAULT_TIMING, Timing, Trainer, run_rounds
from fedsec.peer.topology import SignedTopology, topology_graph


@dataclass(frozen=True)
class LoopbackMember:
    identity: SigningIdentity
    trainer: Trainer
    samples: int
    charging: PeerCharging | None = None  # the member's ledger; None charges nothing


@dataclass(frozen=True)
class PeerResult:
    peer: GossipPeer
    outcomes: list[RoundOutcome]


async def run_loopback(
    federation_id: str,
    admin_public: bytes,
    topology: SignedTopology,
    members: Sequence[LoopbackMember],
    model: Vector,
    rounds: int,
    settings: GossipSettings | None = None,
    timing: Timing = DEFAULT_TIMING,
) -> dict[str, PeerResult]:
    """Run ``rounds`` rounds of every member over loopback; results by key id.

    Raises:
        SignatureError, ProtocolError: the topology does not verify or does not fit the
            roster (see :func:`fedsec.peer.topology.topology_graph`).
    """
    roster = {m.identity.key_id: m.identity.public_bytes for m in members}
    graph = topology_graph(topology, admin_public, federation_id, roster)
    peers = {
        m.identity.key_id: GossipPeer(
            federation_id,
            m.identity.key_id,
            graph.neighbors(m.identity.key_id),
            model,
            m.samples,
            PeerJournal(federation_id, m.identity),
            settings,
        )
        for m in members
    }
    identities = {m.identity.key_id: m.identity for m in members}
    async with serve_peers(peers, roster, identities) as (urls, apps):
        runs = [
            run_rounds(
                peers[k],
                m.identity,
                {n: urls[n] for n in peers[k].neighbours},
                m.trainer,
                rounds,
                apps[k][ARRIVED],
                timing,
                roster,
                charging=m.charging,
            )
            for m in members
            for k in [m.identity.key_id]
        ]
        outcomes = await asyncio.gather(*runs)
    return {k: PeerResult(peers[k], o) for k, o in zip(peers, outcomes, strict=True)}


@contextlib.asynccontextmanager
async def serve_peers(
    peers: Mapping[str, GossipPeer],
    roster: Mapping[str, bytes],
    identities: Mapping[str, SigningIdentity],
) -> AsyncIterator[tuple[dict[str, str], dict[str, web.Application]]]:
    """Each of ``peers`` (by key id) served on its own ephemeral 127.0.0.1 port, signing
    with its identity; yields their base urls and apps, and stops them all on exit."""
    runners, urls, apps = [], {}, {}
    try:
        for key, peer in peers.items():
            apps[key] = peer_app(peer, roster, identities[key])
            runner = web.AppRunner(apps[key], access_log=None)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls[key] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield urls, apps
    finally:
        for runner in runners:
            await runner.cleanup()
