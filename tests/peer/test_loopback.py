"""Five real peers gossiping over loopback with the members' training code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsec.crypto.identity import SigningIdentity
from fedsec.learning.training import train_local
from fedsec.peer.gossip import GossipSettings
from fedsec.peer.loopback import LoopbackMember, run_loopback
from fedsec.peer.messages import Vector
from fedsec.peer.runner import Timing, Trainer
from fedsec.peer.topology import sign_topology
from fedsec.task.defaults import TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

FED = "fed-loop"
PARAMS = TrainingParams(lr=0.5, batch_size=16, local_epochs=1)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _trainer(seed: int, flip: bool = False) -> Trainer:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((48, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)

    def train(model: Vector, round_: int) -> Vector:
        net = _net()
        load_flat_params(net, model.astype(np.float32))
        train_local(net, x, y, PARAMS, None, "cpu", seed * 1000 + round_)
        trained: Vector = flatten_params(net).astype(np.float64)
        return 2 * model - trained if flip else trained  # flip: −Δ

    return train


@pytest.mark.asyncio
async def test_five_peers_gossip_and_their_journals_match() -> None:
    admin = SigningIdentity.generate()
    ids = [SigningIdentity.generate() for _ in range(5)]
    members = [LoopbackMember(i, _trainer(n, flip=n == 4), 48) for n, i in enumerate(ids)]
    topology = sign_topology(admin, FED, bytes(32), 2)
    start = flatten_params(_net()).astype(np.float64)
    settings = GossipSettings(exchanges=2)
    results = await run_loopback(
        FED, admin.public_bytes, topology, members, start, 3, settings, Timing(20.0, 10.0)
    )
    flipper = ids[4].key_id
    for key, result in results.items():
        steps = [(o.round, o.exchange) for o in result.outcomes]
        assert steps == [(r, e) for r in range(3) for e in range(2)]
        assert all(not o.missing for o in result.outcomes)
        if flipper in result.peer.neighbours and key != flipper:
            # refused for its update from round 1 on, and not mixed with in that round
            assert all(flipper in o.refused for o in result.outcomes[2::2])
            assert all(flipper not in o.accepted for o in result.outcomes[2:])
    # every model one peer journalled as sent, the receiver journalled with the same hash
    fields = ("round", "exchange", "sender", "sha256")
    for key, result in results.items():
        for sent in result.peer.journal.of_kind("peer_sent"):
            received = results[sent["to"]].peer.journal.of_kind("peer_received")
            assert {**{k: sent[k] for k in fields if k in sent}, "sender": key} in [
                {k: r[k] for k in fields} for r in received
            ]
