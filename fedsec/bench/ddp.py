"""``fedsec bench ddp``: record-level distributed DP against central DP, in one process.

Each round, every member Poisson-samples its records with rate q, sums its per-sample
clipped gradients (:mod:`fedsec.learning.distributed`), and discretises the sum with its
noise share (:mod:`fedsec.crypto.discretize`: the round's shared rotation, scale,
conditional rounding, Skellam share from the AES-CTR keystream, wrap into the ring).
The ring vectors are added modulo 2^m, which is exactly the sum SecAgg+ unmasks (the
masks cancel; the protocol itself is measured by ``fedsec bench secagg`` and
``fedsec simulate``); the model holder decodes it and takes one optimiser step with it.
Members drop out at random with ``--dropout``; noise is sized for the fewest survivors
the round may close with (``--min-survivors``), so the realised noise multiplier is
never below the target.

``centralized_dp_accuracy`` runs the *same code* with one member holding the pooled
records (a central curator adding all the noise), at the same ε, δ, q and steps;
``opacus_centralized_dp_accuracy`` is Opacus' own DP-SGD (``train_local``) on the pooled
records with batch q·N for the same number of steps, the project's local-DP code path.
The noise multiplier comes from the ledger's accountant (PRV capped by RDP), and the
ledger's ε of the run is reported.

``--unit member`` (DP-FedAvg, McMahan et al. 2018): the unit of privacy is a member.
Each round every member joins with probability ``--member-rate``, trains its local
epochs without noise from the current model, clips its update to ``--member-clip`` and
discretises it with its noise share (sensitivity = the clip); the model holder adds
the decoded sum divided by the expected number of participants to the model (server
learning rate ``--server-lr``).  The accountant's (q, σ, steps) are (member rate, z,
rounds).  No central comparison: there is no pooled equivalent of a member.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import click
import numpy as np
import torch

from fedsec.agent.ledger import epsilon_of, noise_for_budget
from fedsec.bench.common import with_environment
from fedsec.crypto.discretize import DdpSpec, decode_sum, encode, wrap_count
from fedsec.crypto.quantize import default_ring_bits
from fedsec.learning.distributed import apply_gradient_sum, clipped_gradient_sum, poisson_sample
from fedsec.learning.training import DPParams, train_local
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.tasks import TrainingParams, get_task, parse_partition
from fedsec.tasks.base import Dataset
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params

DELTA = DEFAULT_DELTA


@dataclass(frozen=True)
class DdpBench:
    task: str = "mnist1d"
    agents: int = 50
    rounds: int = 200
    epsilon: float = 8.0
    batch: int = 1000  # expected union batch q·N
    clip: float = 1.0  # C, per record
    lr: float = 0.01
    optimizer: Literal["adam", "sgd"] = "adam"
    quant_bits: int = 16
    min_survivors: float = 0.8  # fraction of the members the noise is sized for
    dropout: float = 0.0  # probability a member drops out of a round
    wrap_stddevs: float = 4.0
    seed: int = 0
    unit: Literal["record", "member"] = "record"
    member_rate: float = 1.0  # member level: each member's chance to join a round
    member_clip: float = 1.0  # member level: L2 clip of a member's update
    server_lr: float = 1.0  # member level
    local_epochs: int = 1  # member level
    local_batch: int = 20  # member level


def _optimizer(model: torch.nn.Module, b: DdpBench) -> torch.optim.Optimizer:
    if b.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=b.lr)
    return torch.optim.SGD(model.parameters(), lr=b.lr)


def _train(
    b: DdpBench, data: Dataset, parts: list[np.ndarray], noise: float, rate: float
) -> dict[str, Any]:
    """Run ``b.rounds`` distributed DP-SGD rounds over ``parts``; return the figures."""
    task = get_task(b.task)
    torch.manual_seed(b.seed)
    model = task.build_model(b.seed)
    dim = sum(p.numel() for p in model.parameters())
    n = len(parts)
    per_member = rate * max(len(p) for p in parts)
    spec = DdpSpec(
        dim=dim,
        ring_bits=default_ring_bits(b.quant_bits, n),
        # a member's sum of clipped gradients: its expected batch plus four standard
        # deviations, times C (clipping the sum keeps the per-record sensitivity C)
        clip=b.clip * max(1.0, per_member + 4 * math.sqrt(per_member)),
        sensitivity=b.clip,
        noise_multiplier=noise,
        min_survivors=max(1, math.ceil(b.min_survivors * n)),
        max_members=n,
        wrap_stddevs=b.wrap_stddevs,
    )
    optimizer = _optimizer(model, b)
    drop = np.random.default_rng(b.seed)  # which members drop: not a secret
    wraps = coords = clipped = 0
    survivors_seen: list[int] = []
    encode_s = 0.0
    for r in range(b.rounds):
        shared = hashlib.sha256(b"bench ddp round %d" % r).digest()
        alive = [i for i in range(n) if drop.random() >= b.dropout] or [0]
        alive = alive if len(alive) >= spec.min_survivors else list(range(spec.min_survivors))
        ring = np.zeros(spec.padded, dtype=np.uint64)
        ints = np.zeros(spec.padded, dtype=np.int64)
        records = 0
        for i in alive:
            part = parts[i]
            mask = poisson_sample(len(part), rate, b"%d/%d/%d" % (b.seed, r, i))
            total, _ = clipped_gradient_sum(
                model, data.x_train[part], data.y_train[part], mask, b.clip
            )
            started = time.perf_counter()
            share = encode(total, spec, shared, os.urandom(32), integers=True)
            encode_s += time.perf_counter() - started
            ring += share.ring.astype(np.uint64)
            assert share.integers is not None
            ints += share.integers
            clipped += share.clipped
            records += len(part)
        ring &= np.uint64((1 << spec.ring_bits) - 1)
        wraps += wrap_count(ints, spec.ring_bits)
        coords += spec.padded
        survivors_seen.append(len(alive))
        apply_gradient_sum(model, decode_sum(ring, spec, shared), rate * records, optimizer)
    accuracy, _ = evaluate(model, data.x_test, data.y_test)
    fewest = min(survivors_seen)
    return {
        "accuracy": accuracy,
        "dim": dim,
        "ring_bits": spec.ring_bits,
        "scale": round(spec.scale, 3),
        "inflation": round(spec.inflation, 5),
        "noise_sized_for_survivors": spec.min_survivors,
        "realised_survivors_min": fewest,
        "realised_survivors_mean": round(float(np.mean(survivors_seen)), 2),
        "realised_noise_multiplier_min": round(spec.effective_noise_multiplier(fewest), 4),
        "wrap_rate": wraps / coords,
        "wrap_bound": spec.wrap_bound(),
        "clipped_member_sums": clipped,
        "encode_s_per_member_round": encode_s / max(1, sum(survivors_seen)),
    }


def _train_members(
    b: DdpBench, data: Dataset, parts: list[np.ndarray], noise: float
) -> dict[str, Any]:
    """Member-level distributed DP (DP-FedAvg) for ``b.rounds`` rounds."""
    task = get_task(b.task)
    torch.manual_seed(b.seed)
    model = task.build_model(b.seed)
    dim = sum(p.numel() for p in model.parameters())
    n = len(parts)
    expected = b.member_rate * n
    spec = DdpSpec(
        dim=dim,
        ring_bits=default_ring_bits(b.quant_bits, n),
        clip=b.member_clip,
        sensitivity=b.member_clip,
        noise_multiplier=noise,
        min_survivors=max(1, math.ceil(b.min_survivors * expected)),
        max_members=n,
        wrap_stddevs=b.wrap_stddevs,
    )
    local = TrainingParams(
        lr=b.lr, batch_size=b.local_batch, local_epochs=b.local_epochs, optimizer=b.optimizer
    )
    server = torch.optim.SGD(model.parameters(), lr=b.server_lr)
    wraps = coords = clipped = 0
    joined: list[int] = []
    for r in range(b.rounds):
        shared = hashlib.sha256(b"bench ddp member round %d" % r).digest()
        members = np.flatnonzero(poisson_sample(n, b.member_rate, b"members %d/%d" % (b.seed, r)))
        ring = np.zeros(spec.padded, dtype=np.uint64)
        ints = np.zeros(spec.padded, dtype=np.int64)
        before = flatten_params(model).astype(np.float64)
        for i in members:
            trained = copy.deepcopy(model)
            part = parts[i]
            seed = b.seed * 1_000_003 + r * 1009 + int(i)
            train_local(trained, data.x_train[part], data.y_train[part], local, None, "cpu", seed)
            update = flatten_params(trained).astype(np.float64) - before
            share = encode(update, spec, shared, os.urandom(32), integers=True)
            ring += share.ring.astype(np.uint64)
            assert share.integers is not None
            ints += share.integers
            clipped += share.clipped
        ring &= np.uint64((1 << spec.ring_bits) - 1)
        wraps += wrap_count(ints, spec.ring_bits)
        coords += spec.padded
        joined.append(len(members))
        # θ ← θ + server_lr · Σ/(q·n): the optimiser's step on the negated mean update
        apply_gradient_sum(model, -decode_sum(ring, spec, shared), expected, server)
    accuracy, _ = evaluate(model, data.x_test, data.y_test)
    return {
        "accuracy": accuracy,
        "dim": dim,
        "ring_bits": spec.ring_bits,
        "inflation": round(spec.inflation, 5),
        "noise_sized_for_survivors": spec.min_survivors,
        "realised_survivors_min": min(joined),
        "realised_survivors_mean": round(float(np.mean(joined)), 2),
        "realised_noise_multiplier_min": round(
            spec.effective_noise_multiplier(max(1, min(joined))), 4
        ),
        "wrap_rate": wraps / coords,
        "wrap_bound": spec.wrap_bound(),
        "clipped_member_updates": clipped,
    }


def run_ddp(b: DdpBench) -> dict[str, Any]:
    """The distributed run, the same code centrally, and Opacus centrally."""
    task = get_task(b.task)
    data = task.load()
    torch.set_num_threads(1)
    if b.unit == "member":
        parts = parse_partition("iid").apply(data.y_train, b.agents, b.seed)
        noise = noise_for_budget(b.epsilon, DELTA, b.member_rate, 1, b.rounds)
        started = time.perf_counter()
        result = _train_members(b, data, parts, noise)
        return with_environment(
            {
                "bench": "ddp",
                **b.__dict__,
                "dp_mode": "distributed",
                "delta": DELTA,
                "sample_rate": b.member_rate,
                "steps": b.rounds,
                "noise_multiplier": noise,
                "epsilon_ledger": epsilon_of([(noise, b.member_rate, b.rounds)], DELTA),
                "final_accuracy": result.pop("accuracy"),
                **result,
                "federated_s": round(time.perf_counter() - started, 1),
            }
        )
    n_records = len(data.y_train)
    rate = b.batch / n_records
    noise = noise_for_budget(b.epsilon, DELTA, rate, 1, b.rounds)
    parts = parse_partition("iid").apply(data.y_train, b.agents, b.seed)
    started = time.perf_counter()
    federated = _train(b, data, parts, noise, rate)
    federated_s = time.perf_counter() - started
    central = _train(
        DdpBench(**{**b.__dict__, "agents": 1, "min_survivors": 1.0, "dropout": 0.0}),
        data,
        [np.arange(n_records)],
        noise,
        rate,
    )
    model = task.build_model(b.seed)
    params = TrainingParams(
        lr=b.lr,
        batch_size=b.batch,
        local_epochs=max(1, round(b.rounds * rate)),
        optimizer=b.optimizer,
    )
    train_local(
        model,
        data.x_train,
        data.y_train,
        params,
        DPParams(noise, b.clip, DELTA),
        "cpu",
        seed=b.seed,
    )
    opacus_acc, _ = evaluate(model, data.x_test, data.y_test)
    eps = epsilon_of([(noise, rate, b.rounds)], DELTA)
    return with_environment(
        {
            "bench": "ddp",
            **b.__dict__,
            "dp_mode": "distributed",
            "delta": DELTA,
            "sample_rate": rate,
            "steps": b.rounds,
            "noise_multiplier": noise,
            "epsilon_ledger": eps,
            "final_accuracy": federated.pop("accuracy"),
            "centralized_dp_accuracy": central["accuracy"],
            "opacus_centralized_dp_accuracy": opacus_acc,
            "opacus_steps": params.local_epochs * math.ceil(n_records / b.batch),
            **federated,
            "federated_s": round(federated_s, 1),
        }
    )


@click.command()
@click.option("--task", default="mnist1d", show_default=True)
@click.option("--agents", default=50, show_default=True)
@click.option("--rounds", default=200, show_default=True, help="rounds = DP-SGD steps")
@click.option("--dp-epsilon", "epsilon", default=8.0, show_default=True)
@click.option("--batch", default=1000, show_default=True, help="expected union batch q*N")
@click.option("--clip", default=1.0, show_default=True, help="per-record clip norm C")
@click.option("--lr", default=0.01, show_default=True)
@click.option("--optimizer", type=click.Choice(["adam", "sgd"]), default="adam")
@click.option("--quant-bits", default=16, show_default=True)
@click.option("--min-survivors", default=0.8, show_default=True, help="fraction of members")
@click.option("--dropout", default=0.0, show_default=True, help="per member and round")
@click.option("--seed", default=0, show_default=True)
@click.option("--unit", type=click.Choice(["record", "member"]), default="record")
@click.option("--member-rate", default=1.0, show_default=True, help="member level: q")
@click.option("--member-clip", default=1.0, show_default=True, help="member level: clip")
@click.option("--server-lr", default=1.0, show_default=True, help="member level")
@click.option("--local-epochs", default=1, show_default=True, help="member level")
@click.option("--local-batch", default=20, show_default=True, help="member level")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_ddp(as_json: bool, **options: Any) -> None:
    """Distributed DP (record level) vs central DP at the same epsilon."""
    del as_json
    click.echo(json.dumps(run_ddp(DdpBench(**options))))
