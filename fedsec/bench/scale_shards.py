"""``fedsec bench scale --shards 1,2,4``: the aggregator's summation of one round of n
members, in one SecAgg+ session and split into shard groups, in this process.

Every member is a real :class:`~fedsec.crypto.secagg.ClientSession` under the
parameters its spec gives it (its group's, when sharded), and every message goes through
the real session interface (:func:`fedsec.summation.open_session`: a
:class:`~fedsec.summation.secagg.SecAggPlusSession`, or a
:class:`~fedsec.summation.sharded.ShardedSession` of one per group), as the round engine
drives it.  Only the aggregator's side is timed (process CPU around each session call):
taking every message, the relays each member fetches, closing the stages and unmasking.
A fraction of the members may drop after sharing keys, so each group unmasks their
pairwise masks out of its sum.

Each shard count runs the same members with the same inputs and the same seed, so the
rows of one member count must report the same ``sum_sha256``: the groups' ring sums add
up to one session's, bit for bit (``same_sum_as_one_session``).  The groups run one after
another here, in one process: a row shows what splitting does to the work (a group's
graph is of its own size, so each member has fewer neighbours), not the speed-up of
groups summed by worker processes side by side: ``--shard-workers`` adds a row per shard
count with each group in a worker process (``round.shard_workers``), whose
``unmask_wall_s`` against the in-process row's is what unmasking on several cores buys.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import numpy as np

from fedsec.bench.common import with_environment
from fedsec.bench.secagg import codec_round_spec
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec
from fedsec.crypto.secagg import ClientSession, default_neighbors
from fedsec.protocol import codec, wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ring_width import ring_bits_for
from fedsec.protocol.shards import ShardGroup
from fedsec.summation import SessionInputs, SummationSession, open_session
from fedsec.summation.sharded import shard_groups

T = TypeVar("T")
BITS = 8
#: mnist1d's model size, the issue's d
DEFAULT_DIM = 5210


class _Clock:
    """The aggregator's CPU seconds, summed over the session calls it makes."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        start = time.process_time()
        try:
            return fn(*args)
        finally:
            self.seconds += time.process_time() - start


def _spec(members: list[str], dim: int, shards: int, seed: bytes) -> wire.RoundSpec:
    ring = ring_bits_for(BITS, len(members), 0)
    base = codec_round_spec(members, QuantSpec(BITS, 1.0, ring), dim, wire.PLAIN_CODEC, seed)
    k, t = default_neighbors(len(members))
    groups = [
        ShardGroup(g, *default_neighbors(len(g))) for g in shard_groups(members, base.seed, shards)
    ]
    return msgspec.structs.replace(base, neighbors=k, threshold=t, groups=groups)


def shards_row(
    members: int,
    shards: int,
    dim: int = DEFAULT_DIM,
    dropout: float = 0.0,
    seed: int = 0,
    workers: bool = False,
) -> dict[str, Any]:
    """One round of ``members`` in ``shards`` groups (1: one session), each group in a
    worker process with ``workers`` (``round.shard_workers``); its row.

    Raises:
        FedsecError: the round cannot close (too many dropped for a group's threshold).
    """
    names = [f"m{i:04d}" for i in range(members)]
    keys = {m: SigningIdentity(hashlib.sha256(f"{seed}/{m}".encode()).digest()) for m in names}
    roster = {m: k.public_bytes for m, k in keys.items()}
    spec = _spec(names, dim, shards, hashlib.sha256(f"round/{seed}".encode()).digest())
    clients = {m: ClientSession(spec.member_params(m), m, keys[m], roster) for m in names}
    lost = set(names[: math.floor(dropout * members)])
    clock = _Clock()
    inputs = SessionInputs(roster, 3, shard_workers=workers and shards > 1)
    session = clock(open_session, spec, inputs)
    started = time.perf_counter()
    _key_stages(session, clients, clock)
    encoding = codec_for(spec)
    for i, m in enumerate(names):
        clients[m].receive_shares(codec.share_relay(clock(session.share_relay, m), m))
        if m in lost:
            continue
        rng = np.random.default_rng([seed, i])  # test updates only, never masks
        delta = (rng.standard_normal(dim) / math.sqrt(dim)).astype(np.float32)
        ring = encoding.encode(delta, 1.0, hashlib.sha256(f"rounding/{m}".encode()).digest())
        clock(session.receive, "masked_input", clients[m].masked_input(ring.ring))
    clock(session.close, "masked_input")
    alive = [m for m in names if m not in lost]
    for m in alive:
        request = codec.unmask_request(clock(session.unmask_request, m, 1))
        clock(session.receive, "consistency", clients[m].sign_survivors(request))
    clock(session.close, "consistency")
    for m in alive:
        proof = codec.consistency_proof(clock(session.consistency_proof, m, 1), m)
        clock(session.receive, "unmask", clients[m].unmask(proof))
    before, unmask_started = clock.seconds, time.perf_counter()
    result = clock(session.finalize)
    unmask_wall_s = time.perf_counter() - unmask_started
    sizes = [len(g.members) for g in spec.groups] or [members]
    return with_environment(
        {
            "bench": "scale",
            "part": "summation",
            "members": members,
            "shards": shards,
            "dim": dim,
            "dropout": dropout,
            "group_members_min": min(sizes),
            "group_members_max": max(sizes),
            "neighbors": sorted({g.neighbors for g in spec.groups} or {spec.neighbors}),
            "survivors": len(result.survivors),
            "aggregator_cpu_s": round(clock.seconds, 3),
            "aggregator_cpu_ms_per_member": round(1000 * clock.seconds / members, 3),
            "shard_workers": workers and shards > 1,
            # in the aggregator's process; a worker's CPU is its own process's
            "unmask_cpu_s": round(clock.seconds - before, 3),
            "unmask_wall_s": round(unmask_wall_s, 3),
            "wall_s": round(time.perf_counter() - started, 3),
            "sum_sha256": result.sum_sha256,
            "group_sum_sha256": [g.sum_sha256 for g in result.groups],
            "seed": seed,
            "cores": len(os.sched_getaffinity(0)),
        }
    )


def _key_stages(
    session: SummationSession, clients: dict[str, ClientSession], clock: _Clock
) -> None:
    """advertise and share_keys, every member answering; both stages closed."""
    for client in clients.values():
        clock(session.receive, "advertise", client.advertise())
    clock(session.close, "advertise")
    for m, client in clients.items():
        key_list = codec.key_list(clock(session.key_list, m))
        clock(session.receive, "share_keys", client.share_keys(key_list))
    clock(session.close, "share_keys")


def shards_rows(
    members: int, shards: list[int], dim: int, dropout: float, seed: int, workers: bool = False
) -> list[dict[str, Any]]:
    """One row per shard count for ``members`` (and with ``workers``, one more per shard
    count above 1, its groups in worker processes); each row says whether its sum is that
    of the one-session row (the first shard count given when 1 is not among them)."""
    shards_row(8, 1, dim, 0.0, seed)  # warm-up: the first round also loads compiled loops
    runs = [(n, False) for n in shards] + [(n, True) for n in shards if workers and n > 1]
    rows = [shards_row(members, n, dim, dropout, seed, w) for n, w in runs]
    reference = next((r for r in rows if r["shards"] == 1), rows[0])["sum_sha256"]
    for row in rows:
        row["same_sum_as_one_session"] = row["sum_sha256"] == reference
    return rows
