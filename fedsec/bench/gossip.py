"""``fedsec bench gossip``: decentralised gossip against aggregator-based FedAvg, and
robust filtering against sign-flip attackers.

In-process on purpose, as ``fedsec bench robust`` (two shared cores): every peer is the
real state machine (:class:`fedsec.peer.gossip.GossipPeer`, its messages encoded and
validated as on the wire, without the HTTP and signatures the tests cover), every peer
trains with the members' training code (:func:`fedsec.peer.runner.task_trainer`), and
the baseline is ``fedsec bench robust``'s FedAvg run (the aggregator's rule code) on the
same split, the same local epochs, the same training seeds (member i's round r trains
with the seed it has in FedAvg's round r, so the runs differ in how models are averaged
and not in which batches were drawn: two seeds of the same FedAvg already differ by
1.4 pt) and the same number of updates per round (every
member, every round): "total updates" counts local trainings, which gossip's extra
exchanges do not add to (they average, they do not train).  Peers run in lock step: each
round every peer trains, sends its model to its neighbours and combines, then every peer
sends its mixed model and combines again for each further exchange; the asynchronous
schedule and the timeout are the loopback tests' concern.

The sign-flip attacker trains honestly and keeps an honest model (so its messages stay
near its neighbours' models and the flipped direction is what they see), but sends
``SIGNFLIP_FACTOR`` times its update: ``fedsec bench robust``'s attack.  In the mixing
exchanges it sends its honest mixed model (the attack is on the update).
Accuracy is the mean over the honest peers' own models on the task's test split.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import torch

from fedsec.bench.common import with_environment
from fedsec.bench.robust import SIGNFLIP_FACTOR, Federation, make_federation, run_rule
from fedsec.crypto.identity import SigningIdentity
from fedsec.peer import messages
from fedsec.peer.gossip import GossipPeer, GossipSettings, RoundOutcome
from fedsec.peer.journal import PeerJournal
from fedsec.peer.limits import DEFAULT_EXCHANGES
from fedsec.peer.messages import Vector
from fedsec.peer.runner import task_trainer
from fedsec.peer.topology import sign_topology, topology_graph
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params, load_flat_params

FEDERATION_ID = "bench-gossip"


@dataclass(frozen=True)
class GossipRun:
    accuracy: float  # mean over honest peers
    worst: float  # the least accurate honest peer
    refused_bad: float  # share of attackers' messages refused by honest receivers
    refused_good: float  # share of honest messages refused by honest receivers
    seconds: float


def _peers(fed: Federation, degree: int, settings: GossipSettings) -> list[GossipPeer]:
    ids = [SigningIdentity.generate() for _ in range(fed.n)]
    admin = SigningIdentity.generate()
    topology = sign_topology(admin, FEDERATION_ID, fed.seed.to_bytes(32, "big"), degree)
    keys = [i.key_id for i in ids]
    graph = topology_graph(topology, admin.public_bytes, FEDERATION_ID, keys)
    start = flatten_params(fed.task.build_model(fed.seed)).astype(np.float64)
    return [
        GossipPeer(
            FEDERATION_ID,
            keys[i],
            graph.neighbors(keys[i]),
            start,
            len(fed.parts[i][1]),
            PeerJournal(FEDERATION_ID, ids[i]),
            settings,
        )
        for i in range(fed.n)
    ]


def run_gossip(fed: Federation, degree: int, settings: GossipSettings) -> GossipRun:
    """``fed.rounds`` lock-step gossip rounds of every peer (attackers as the module says)."""
    started = time.perf_counter()
    peers = _peers(fed, degree, settings)
    index = {p.me: i for i, p in enumerate(peers)}
    trainers = [
        task_trainer(fed.task, x, y, fed.params, fed.dp, fed.seed * 100_003 + i)
        for i, (x, y) in enumerate(fed.parts)
    ]
    refused = {True: [0, 0], False: [0, 0]}  # attacker? -> [refused, seen]
    for r in range(fed.rounds):
        sent: dict[str, bytes] = {}
        for i, peer in enumerate(peers):
            start = peer.model.copy()
            trained = trainers[i](start, (r + 1) * 1_009)  # FedAvg's round r + 1 seeds
            message = peer.own_model(trained)
            if i in fed.bad:
                flipped = SIGNFLIP_FACTOR * (trained - start)
                message = messages.make_model(
                    FEDERATION_ID, r, peer.me, peer.samples, start, flipped
                )
            sent[peer.me] = messages.encode(message)
        outcomes = _exchange(peers, sent, r)
        for i, outcome in enumerate(outcomes):
            if i not in fed.bad:
                for n in peers[i].neighbours:
                    tally = refused[index[n] in fed.bad]
                    tally[0] += n in outcome.refused
                    tally[1] += 1
        while peers[0].exchange:
            mixed = {p.me: messages.encode(p.mixing_model()) for p in peers}
            _exchange(peers, mixed, r)
    honest = [_accuracy(fed, p.model) for i, p in enumerate(peers) if i not in fed.bad]
    return GossipRun(
        float(np.mean(honest)),
        float(np.min(honest)),
        refused[True][0] / max(refused[True][1], 1),
        refused[False][0] / max(refused[False][1], 1),
        time.perf_counter() - started,
    )


def _exchange(peers: list[GossipPeer], sent: dict[str, bytes], round_: int) -> list[RoundOutcome]:
    """Every peer receives its neighbours' messages of this exchange, then combines."""
    for peer in peers:
        for n in sorted(peer.neighbours):
            peer.receive(n, sent[n], FEDERATION_ID, round_)
    return [peer.combine() for peer in peers]


def _accuracy(fed: Federation, model: Vector) -> float:
    net = fed.task.build_model(0)
    load_flat_params(net, model.astype(np.float32))
    return float(evaluate(net, fed.x_eval, fed.y_eval)[0])


def _emit(line: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(with_environment(line), sort_keys=True))
    else:
        click.echo(" ".join(f"{k}={v}" for k, v in line.items()))


@click.command()
@click.option("--task", default="mnist1d", show_default=True)
@click.option("--agents", type=int, default=20, show_default=True)
@click.option("--degree", type=int, default=4, show_default=True)
@click.option("--bad", type=float, default=0.2, show_default=True, help="share of attackers")
@click.option("--rounds", type=int, default=60, show_default=True)
@click.option("--local-epochs", type=int, default=2, show_default=True)
@click.option("--partition", default="iid", show_default=True, help="iid or dirichlet:ALPHA")
@click.option("--min-cosine", type=float, default=0.0, show_default=True)
@click.option(
    "--exchanges",
    type=int,
    default=DEFAULT_EXCHANGES,
    show_default=True,
    help="model exchanges per round, the first with the training (GossipSettings.exchanges)",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--reference",
    type=click.Choice(["median", "own"]),
    default="median",
    show_default=True,
    help="what a neighbour's update is judged against (GossipSettings.reference)",
)
@click.option(
    "--runs",
    default="fedavg,clean,robust,plain",
    show_default=True,
    help="fedavg: aggregator-based baseline; clean, clean-plain: gossip without attackers "
    "with and without filtering; robust, plain: under sign-flip with and without filtering",
)
@click.option("--json", "as_json", is_flag=True)
def bench_gossip(
    task: str,
    agents: int,
    degree: int,
    bad: float,
    rounds: int,
    local_epochs: int,
    partition: str,
    min_cosine: float,
    exchanges: int,
    seed: int,
    reference: str,
    runs: str,
    as_json: bool,
) -> None:
    """Gossip averaging vs aggregator FedAvg, and robust filtering vs sign-flip attackers."""
    torch.set_num_threads(1)
    clean = make_federation(task, agents, 0.0, partition, rounds, seed, local_epochs=local_epochs)
    attacked = make_federation(
        task, agents, bad, partition, rounds, seed, local_epochs=local_epochs
    )
    common = {
        "bench": "gossip",
        "task": task,
        "agents": agents,
        "degree": degree,
        "rounds": rounds,
        "local_epochs": local_epochs,
        "partition": partition,
        "seed": seed,
    }
    for name in [r.strip() for r in runs.split(",") if r.strip()]:
        if name == "fedavg":
            started = time.perf_counter()
            result = run_rule(clean, flatten_params(clean.task.build_model(seed)), "fedavg", "none")
            line = {"run": name, "accuracy": round(result.accuracy, 4)}
            line["seconds"] = round(time.perf_counter() - started, 1)
        else:
            fed = clean if name.startswith("clean") else attacked
            settings = GossipSettings(
                robust=not name.endswith("plain"),
                min_cosine=min_cosine,
                reference=reference,  # type: ignore[arg-type]  # click.Choice checked it
                exchanges=exchanges,
            )
            g = run_gossip(fed, degree, settings)
            line = {
                "run": name,
                "attackers": len(fed.bad),
                "robust": settings.robust,
                "min_cosine": min_cosine,
                "reference": reference,
                "exchanges": exchanges,
                "accuracy": round(g.accuracy, 4),
                "worst_peer": round(g.worst, 4),
                "refused_attacker_share": round(g.refused_bad, 4),
                "refused_honest_share": round(g.refused_good, 4),
                "seconds": round(g.seconds, 1),
            }
        _emit({**common, **line}, as_json)
