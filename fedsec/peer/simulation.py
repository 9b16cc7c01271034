"""``fedsec simulate --topology gossip``: a bundled task's training split among N real
peers on loopback (:mod:`fedsec.peer.loopback`), gossiping with no aggregator."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsec.crypto.identity import SigningIdentity
from fedsec.peer.gossip import GossipSettings
from fedsec.peer.loopback import LoopbackMember, run_loopback
from fedsec.peer.runner import task_trainer
from fedsec.peer.topology import SEED_BYTES, sign_topology
from fedsec.tasks import get_task
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params, load_flat_params
from fedsec.tasks.partition import parse_partition

FEDERATION_ID = "simulate-gossip"


@dataclass(frozen=True)
class GossipSimulation:
    task: str = "mnist1d"
    agents: int = 10
    rounds: int = 10
    degree: int = 4
    partition: str = "iid"
    local_epochs: int = 0  # 0: the task's default
    seed: int = 0
    robust: bool = True


async def run_gossip_simulation(spec: GossipSimulation) -> dict[str, Any]:
    """Run ``spec`` and return its summary: mean and least accuracy of the peers' own
    models on the task's test split, and how many neighbours' models were refused.

    Raises:
        ConfigError: an unknown task or partition.
        ProtocolError: a degree the roster cannot have (2..agents − 1, ≥ 3 agents).
    """
    started = time.perf_counter()
    task = get_task(spec.task)
    data = task.load()
    params = task.defaults
    if spec.local_epochs:
        params = dataclasses.replace(params, local_epochs=spec.local_epochs)
    parts = parse_partition(spec.partition).apply(data.y_train, spec.agents, spec.seed)
    members = [
        LoopbackMember(
            SigningIdentity.generate(),
            task_trainer(
                task, data.x_train[idx], data.y_train[idx], params, None, spec.seed * 1_000 + i
            ),
            len(idx),
        )
        for i, idx in enumerate(parts)
    ]
    admin = SigningIdentity.generate()
    topology = sign_topology(admin, FEDERATION_ID, secrets.token_bytes(SEED_BYTES), spec.degree)
    start = flatten_params(task.build_model(spec.seed)).astype(np.float64)
    results = await run_loopback(
        FEDERATION_ID,
        admin.public_bytes,
        topology,
        members,
        start,
        spec.rounds,
        GossipSettings(robust=spec.robust),
    )
    accuracies = []
    for result in results.values():
        net = task.build_model(0)
        load_flat_params(net, result.peer.model.astype(np.float32))
        accuracies.append(float(evaluate(net, data.x_test, data.y_test)[0]))
    refused = sum(len(o.refused) for r in results.values() for o in r.outcomes)
    return {
        "topology": "gossip",
        "task": spec.task,
        "agents": spec.agents,
        "degree": spec.degree,
        "rounds": spec.rounds,
        "partition": spec.partition,
        "accuracy_mean": round(float(np.mean(accuracies)), 4),
        "accuracy_min": round(float(np.min(accuracies)), 4),
        "refused_models": refused,
        "seconds": round(time.perf_counter() - started, 1),
    }
