"""Detection rates of the control-sample audit, measured on simulated FedAvg rounds.

In one process, without HTTP (the protocol is tested elsewhere): members train with
DP-SGD (``train_local``, noise from ``noise_for_budget`` for the target epsilon over
all rounds), a ``bad`` fraction of them attack, every update is quantized exactly as
agents do (``QuantSpec(8, clip, ring_bits)``), and the auditor checks *every*
(member, round) pair with :mod:`fedsec.audit.control` against a control sample that
no member trains on (the task's test split).  Attackers cycle through the attacks
round by round, so every attack is measured on several members and rounds; ``trials``
repeats the whole federation with fresh seeds for tighter rates.

Attacks: ``zero`` sends Δ = 0; ``noise`` Gaussian noise with the norm of this round's
median honest update; ``replay`` resends an earlier update (alternately its own
previous round's update re-quantized, or another member's earlier quantized vector
verbatim); ``signflip`` sends −Δ of its honest training; ``scale`` sends 10·Δ, which
quantization clips back to norm C, so only a too-large (but bounded) step survives.

The clip C is set the way an operator would: ``CLIP_HEADROOM`` times the norm of an
honest DP update (one pilot run on the control sample), so honest updates are never
clipped and a scaled update is clipped to a norm the magnitude test can see.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from fedsec.agent.ledger import noise_for_budget
from fedsec.audit.control import (
    DIRECTION_MIN_Z,
    LOSS_MAX_INCREASE,
    MAGNITUDE_BAND,
    REPLAY_MAX_COSINE,
    SIGNAL_MIN_Z,
    MemberClaim,
    RevealedUpdate,
    RoundTraining,
    Verdict,
    build_reference,
    check_update,
)
from fedsec.bench.common import with_environment
from fedsec.crypto.quantize import QuantSpec, default_ring_bits, quantize
from fedsec.errors import ConfigError
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.tasks import get_task
from fedsec.tasks.base import TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params
from fedsec.tasks.partition import partition_iid

ATTACKS: Final = ("zero", "noise", "replay", "signflip", "scale")
#: Plain SGD keeps the honest update "lr · Σ clipped gradients + noise", which the
#: auditor's expectations model exactly.  Full-batch steps (batch = a member's 200
#: records, 10 steps): at a fixed ε a larger batch buys more signal per unit of DP noise
#: (√T·B/σ is 140 at batch 200 against 110 at batch 20 for ε = 8 over 5 rounds), the
#: usual DP-SGD advice (De et al., 2022), and it is what makes one update auditable:
#: at batch 20 the weakest honest first-round updates scored z ≈ 0.4-2 (10 % below 2.1),
#: at batch 200 none below 4.7 (seed 1, rounds 0-1).
BENCH_TRAINING: Final = TrainingParams(lr=0.3, batch_size=200, local_epochs=10, optimizer="sgd")
MAX_GRAD_NORM: Final = 1.0
DELTA: Final = DEFAULT_DELTA
QUANT_BITS: Final = 8
SCALE_FACTOR: Final = 10.0
#: Clip C over the honest update norm: honest updates stay unclipped, a scaled one is
#: clipped to 2.5x the honest norm, well outside the magnitude band.
CLIP_HEADROOM: Final = 2.5


def _train(
    task_name: str,
    global_params: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    dp: DPParams,
    seed: int,
) -> npt.NDArray[np.float32]:
    task = get_task(task_name)
    model = task.build_model(0)
    load_flat_params(model, global_params)
    train_local(model, x, y, BENCH_TRAINING, dp, "cpu", seed)
    return (flatten_params(model) - global_params).astype(np.float32)


def _attack_for(bad_index: int, round: int, attacks: Sequence[str]) -> str:
    """Cycle attacks over bad members and rounds; replay needs an earlier round."""
    for shift in range(len(attacks)):
        attack = attacks[(bad_index + round + shift) % len(attacks)]
        if attack != "replay" or round > 0:
            return attack
    return "honest"  # only replay was asked for, and there is nothing to replay yet


def _one_federation(
    task_name: str,
    agents: int,
    rounds: int,
    bad: float,
    attacks: Sequence[str],
    dp_epsilon: float,
    seed: int,
) -> tuple[list[tuple[str, Verdict]], dict[str, float]]:
    task = get_task(task_name)
    data = task.load()
    control = (data.x_test, data.y_test)
    parts = partition_iid(len(data.y_train), agents, seed)
    max_samples = max(len(p) for p in parts)
    smallest = min(len(p) for p in parts)
    rate, steps = plan_round(smallest, BENCH_TRAINING)
    noise = noise_for_budget(dp_epsilon, DELTA, rate, steps, rounds)
    dp = DPParams(noise, MAX_GRAD_NORM, DELTA)
    rng = np.random.default_rng(seed)
    global_params = flatten_params(task.build_model(seed))

    pilot_idx = rng.choice(len(control[1]), size=smallest, replace=False)
    pilot = _train(task_name, global_params, control[0][pilot_idx], control[1][pilot_idx], dp, seed)
    clip = CLIP_HEADROOM * float(np.linalg.norm(pilot))
    spec = QuantSpec(QUANT_BITS, clip, default_ring_bits(QUANT_BITS, agents))
    training = RoundTraining(BENCH_TRAINING, dp, clip)

    members = [f"m{i:03d}" for i in range(agents)]
    n_bad = round(bad * agents)
    bad_members = {int(i): b for b, i in enumerate(rng.choice(agents, n_bad, replace=False))}
    history: list[RevealedUpdate] = []
    own_deltas: dict[int, npt.NDArray[np.float32]] = {}
    kept: list[tuple[int, npt.NDArray[np.unsignedinteger]]] = []  # (round, quantized)
    labelled: list[tuple[str, Verdict]] = []
    for rnd in range(rounds):
        reference = build_reference(
            task, global_params, training, control, smallest, rnd, seed * 1000 + rnd
        )
        honest = [
            _train(
                task_name,
                global_params,
                data.x_train[parts[i]],
                data.y_train[parts[i]],
                dp,
                seed * 100_000 + rnd * 1000 + i,
            )
            for i in range(agents)
        ]
        typical = statistics.median(float(np.linalg.norm(h)) for h in honest)
        round_vectors: list[npt.NDArray[np.unsignedinteger]] = []
        round_revealed: list[RevealedUpdate] = []
        for i, member in enumerate(members):
            weight = len(parts[i]) / max_samples
            label = "honest"
            if i in bad_members:
                label = _attack_for(bad_members[i], rnd, attacks)
            sent: npt.NDArray[np.floating[Any]] = honest[i]
            q: npt.NDArray[np.unsignedinteger] | None = None
            if label == "zero":
                sent = np.zeros_like(honest[i])
            elif label == "noise":
                z = rng.standard_normal(honest[i].size)
                sent = z * (typical / float(np.linalg.norm(z)))
            elif label == "signflip":
                sent = -honest[i]
            elif label == "scale":
                sent = honest[i] * SCALE_FACTOR
            elif label == "replay":
                if rnd % 2 == 1 and i in own_deltas:
                    sent = own_deltas[i]  # own previous update, freshly quantized
                else:
                    q = kept[int(rng.integers(len(kept)))][1].copy()  # someone's, verbatim
            if q is None:
                q = quantize(sent, weight, spec, os.urandom(32))
                own_deltas[i] = np.asarray(sent, dtype=np.float32)
            else:
                own_deltas[i] = RevealedUpdate.from_quantized(
                    member, rnd, q, spec
                ).weighted_delta.astype(np.float32)
            revealed = RevealedUpdate.from_quantized(member, rnd, q, spec)
            claim = MemberClaim(
                member, rnd, len(parts[i]), plan_round(len(parts[i]), BENCH_TRAINING)[1]
            )
            verdict = check_update(task, reference, training, claim, revealed, history, control)
            labelled.append((label, verdict))
            round_vectors.append(q)
            round_revealed.append(revealed)
        history.extend(round_revealed)
        kept.extend((rnd, v) for v in round_vectors)
        total = sum(r.weighted_delta for r in round_revealed)
        weights = sum(r.weight for r in round_revealed)
        global_params = (global_params + total / weights).astype(np.float32)
    info = {"noise_multiplier": noise, "clip": clip, "sample_rate": rate, "steps": float(steps)}
    return labelled, info


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {
        "min": float(arr.min()),
        "p01": float(np.quantile(arr, 0.01)),
        "median": float(np.median(arr)),
        "p99": float(np.quantile(arr, 0.99)),
        "max": float(arr.max()),
    }


def run_audit_bench(
    task: str = "mnist1d",
    agents: int = 20,
    rounds: int = 5,
    bad: float = 0.2,
    attacks: Sequence[str] = ATTACKS,
    dp_epsilon: float = 8.0,
    seed: int = 0,
    trials: int = 2,
) -> dict[str, Any]:
    """Simulate ``trials`` federations, audit every (member, round), report detection rates.

    Raises:
        ConfigError: unknown attack, or agents/rounds/bad/trials out of range.
    """
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        raise ConfigError(f"unknown attack(s) {unknown}; known: {list(ATTACKS)}")
    if not attacks or agents < 2 or rounds < 1 or trials < 1 or not 0.0 <= bad < 1.0:
        raise ConfigError("need attacks, agents >= 2, rounds >= 1, trials >= 1, 0 <= bad < 1")
    # One thread: the model is tiny, and on a shared machine a second torch thread spin-waits
    # (measured: one DP-SGD run 0.55 s with one thread, 21 s with two under load).
    torch.set_num_threads(1)
    started = time.perf_counter()
    labelled: list[tuple[str, Verdict]] = []
    infos: list[dict[str, float]] = []
    for trial in range(trials):
        rows, info = _one_federation(
            task, agents, rounds, bad, tuple(attacks), dp_epsilon, seed + trial
        )
        labelled.extend(rows)
        infos.append(info)
    by_label: dict[str, list[Verdict]] = defaultdict(list)
    for label, verdict in labelled:
        by_label[label].append(verdict)
    honest = by_label.get("honest", [])
    tpr = {
        a: sum(not v.passed for v in by_label[a]) / len(by_label[a]) for a in attacks if by_label[a]
    }
    fpr = sum(not v.passed for v in honest) / len(honest) if honest else 0.0
    failures: dict[str, dict[str, int]] = {}
    scores: dict[str, dict[str, dict[str, float]]] = {}
    for label, verdicts in by_label.items():
        counts: dict[str, int] = defaultdict(int)
        for v in verdicts:
            for test in v.failed:
                counts[test] += 1
        failures[label] = dict(counts)
        scores[label] = {
            key: _quantiles([v.scores[key] for v in verdicts if key in v.scores])
            for key in (
                "z_signal",
                "z_direction",
                "z_energy",
                "loss_change",
                "norm_ratio",
                "replay_cosine",
            )
        }
    return with_environment(
        {
            "bench": "audit",
            "task": task,
            "agents": agents,
            "rounds": rounds,
            "bad": bad,
            "attacks": list(attacks),
            "trials": trials,
            "seed": seed,
            "dp_epsilon": dp_epsilon,
            "noise_multiplier": infos[0]["noise_multiplier"],
            "clip": statistics.mean(i["clip"] for i in infos),
            "training": {
                "optimizer": BENCH_TRAINING.optimizer,
                "lr": BENCH_TRAINING.lr,
                "batch_size": BENCH_TRAINING.batch_size,
                "local_epochs": BENCH_TRAINING.local_epochs,
                "max_grad_norm": MAX_GRAD_NORM,
                "steps": infos[0]["steps"],
            },
            "tpr": tpr,
            "fpr": fpr,
            "n_honest": len(honest),
            "n_attacked": {a: len(by_label[a]) for a in attacks},
            "failed_tests": failures,
            "scores": scores,
            "thresholds": {
                "signal_min_z": SIGNAL_MIN_Z,
                "direction_min_z": DIRECTION_MIN_Z,
                "loss_max_increase": LOSS_MAX_INCREASE,
                "magnitude_band": list(MAGNITUDE_BAND),
                "replay_max_cosine": REPLAY_MAX_COSINE,
            },
            "wall_s": round(time.perf_counter() - started, 2),
        }
    )
