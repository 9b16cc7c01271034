"""``fedsec bench robust``: aggregation rules against attacks, and audit quarantine.

In-process on purpose (the machine this runs on has two shared cores): no aggregator,
no HTTP, no SecAgg+ masks.  What decides the numbers is real: every member trains with
the members' training code (:func:`fedsec.learning.training.train_local`), every round
is combined by the aggregator's rule code (:func:`fedsec.learning.robust.aggregate`, with
FLTrust's reference from :mod:`fedsec.learning.reference`), and with ``--defence
audit-quarantine`` every challenged contribution is judged by the auditor's control-
sample code (:mod:`fedsec.audit.control`).  What is simplified: updates stay float64
(the 8-bit quantization the rules see in production adds noise far below these
effects), and every member is in every cohort.  The rule matrix trains without DP (the
rules are compared on their own); the quarantine runs train with DP-SGD (ε 8 by
default, ``fedsec bench audit``'s recipe), because the control checks are calibrated
under DP: without it, honest updates fail them (measured: at ``--challenge-rate 0.5``
every honest member of 40 was quarantined within 20 rounds).

The threat model of the attacks: an honest member's update is clipped to the round's L2
bound C by its own client; an attacker controls its client, so the only bound on its
vector is what the ring can express, each coordinate within [−C, C] (C is set to 2.5x
the median honest update norm of the first clean round, as in ``fedsec bench audit``).
The attacks (Baruch et al. 2019 for ``alie``; the others as in the FLTrust paper):

- ``signflip``: the attacker trains honestly and sends −4Δ (−1Δ only slows FedAvg
  down; from −4Δ the 20 % of attackers cancel the honest 80 %);
- ``scale``: 10Δ (model-replacement boosting);
- ``labelflip``: trains on labels 9 − y;
- ``gaussian``: white noise with 10x the mean honest update norm;
- ``alie``: every attacker sends μ − z·σ of the honest updates (coordinate-wise mean
  and std, omniscient), z = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f;
- ``zero``: a free rider, Δ = 0 at its full weight.

With ``--secure-sum secagg`` the aggregator sees only the sum, so the rule is FedAvg;
``--defence audit-quarantine`` adds the auditor: each round every contribution is
challenged with probability ``--challenge-rate``, the challenged ones are judged by
:func:`fedsec.audit.control.check_update` against a control sample from the task's test
split (disjoint from the one accuracy is measured on), a failed member is quarantined
(out of every later cohort), and once every attacker is out the model rolls back to the
version before the first failed round (what the ``member_quarantined`` alert offers)
and training continues to the run's last round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Final

import click
import numpy as np
import numpy.typing as npt
import torch

from fedsec.agent.ledger import epsilon_of, noise_for_budget
from fedsec.audit.control import (
    MemberClaim,
    RevealedUpdate,
    RoundTraining,
    build_reference,
    check_update,
)
from fedsec.bench.audit import BENCH_TRAINING, DELTA, MAX_GRAD_NORM
from fedsec.bench.common import with_environment
from fedsec.crypto.quantize import QuantSpec, quantize
from fedsec.errors import AggregationImpossible, ConfigError
from fedsec.learning import robust
from fedsec.learning.reference import reference_update, root_dataset
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.protocol import wire
from fedsec.tasks import get_task
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import flatten_params, load_flat_params
from fedsec.tasks.partition import parse_partition

Vector = npt.NDArray[np.float64]

ATTACKS: Final = ("none", "signflip", "scale", "labelflip", "gaussian", "alie", "zero")
RULES: Final = (
    "fedavg",
    "trimmed_mean",
    "median",
    "multi_krum",
    "centered_clipping",
    "dnc",
    "fltrust",
)
#: The attacks the quarantine run covers by default: the kinds the issue names.
QUARANTINE_ATTACKS: Final = ("signflip", "scale", "zero")
SIGNFLIP_FACTOR: Final = -4.0
SCALE_FACTOR: Final = 10.0
GAUSSIAN_FACTOR: Final = 10.0
#: C over the median honest update norm of the first clean round (fedsec bench audit's).
CLIP_OVER_HONEST: Final = 2.5
#: dnc refuses this many times the attackers each round: at f = the attackers, the
#: honest spread hid a few of them along the top direction every round
#: (docs/robustness.md, measured); over-estimating f is an operator's usual margin.
DNC_OVER_ATTACKERS: Final = 1.5
#: Control records the auditor holds, from the test split; the rest measures accuracy.
CONTROL_RECORDS: Final = 400
#: The rule matrix's member training: the task's optimiser (Adam, lr 0.01) at batch 20,
#: two local epochs.  Clean FedAvg of 50 members (80 records each) then reaches 80 %
#: at 60 rounds, 86.7 % at 80, 87.3 % at 100 and 89.8 % at 140 (seed 0, 600 test
#: records): past 80 rounds it gains under 1 pt per 10 rounds, so the matrix compares
#: rules on a model that has nearly converged rather than one still learning (at 20
#: rounds of one epoch clean FedAvg had 40.8 %).
MATRIX_TRAINING: Final = TrainingParams(lr=0.01, batch_size=20, local_epochs=2, optimizer="adam")
#: --rounds when not given: the rule matrix runs to convergence (above); the quarantine
#: runs spend ε over 15 rounds, each round's contributions challenged.
DEFAULT_ROUNDS: Final = {"none": 80, "secagg": 15}


@dataclass(frozen=True)
class Federation:
    """The task, its split among members, and the round settings of one run."""

    task: Task
    parts: list[tuple[np.ndarray, np.ndarray]]
    bad: frozenset[int]
    params: TrainingParams
    rounds: int
    x_eval: np.ndarray
    y_eval: np.ndarray
    control: tuple[np.ndarray, np.ndarray]
    root: tuple[np.ndarray, np.ndarray]
    seed: int
    clip: float = 0.0
    dp: DPParams | None = None  # members' DP-SGD (the quarantine runs: the audit needs it)

    @property
    def n(self) -> int:
        return len(self.parts)

    def weights(self, members: Sequence[int]) -> Vector:
        """Volume weights (what every member applies without a quality score)."""
        return np.array([float(len(self.parts[i][1])) for i in members])


def make_federation(
    task_name: str,
    agents: int,
    bad: float,
    partition: str,
    rounds: int,
    seed: int,
    dp_epsilon: float | None = None,
    local_epochs: int = MATRIX_TRAINING.local_epochs,
) -> Federation:
    """Split the task's training data among ``agents``; ⌊bad·agents⌋ of them attack.

    Without DP members train as :data:`MATRIX_TRAINING` with ``local_epochs``.  With
    ``dp_epsilon``, they train with DP-SGD as ``fedsec bench audit`` calibrated the
    control-sample checks: its recipe (full-batch SGD, 10 steps) and the noise that
    spends ``dp_epsilon`` over ``rounds``.

    Raises:
        ConfigError: an unknown task or partition, or too few records per member.
    """
    task = get_task(task_name)
    data = task.load()  # the common split: every run measures on the same test set
    spec = parse_partition(partition)
    parts = [
        (data.x_train[idx], data.y_train[idx])
        for idx in spec.apply(data.y_train, agents, seed, min_size=2)
    ]
    bad_count = math.floor(bad * agents + 1e-9)
    rng = np.random.default_rng(seed)
    chosen = frozenset(int(i) for i in rng.choice(agents, size=bad_count, replace=False))
    params = dataclasses.replace(MATRIX_TRAINING, local_epochs=local_epochs)
    dp = None
    if dp_epsilon is not None:
        params = BENCH_TRAINING
        smallest = min(len(y) for _, y in parts)
        rate, steps = plan_round(smallest, params)
        noise = noise_for_budget(dp_epsilon, DELTA, rate, steps, rounds)
        dp = DPParams(noise, MAX_GRAD_NORM, DELTA)
    control = (data.x_test[:CONTROL_RECORDS], data.y_test[:CONTROL_RECORDS])
    # Accuracy is measured on the test records the auditor does not hold; without the
    # audit (the rule matrix) on the whole test split, whose 1,000 records put one
    # accuracy near 85 % within ±1.1 pt (one standard error; ±1.5 pt on 600).
    held = 0 if dp_epsilon is None else CONTROL_RECORDS
    return Federation(
        task,
        parts,
        chosen,
        params,
        rounds,
        data.x_test[held:],
        data.y_test[held:],
        control,
        root_dataset(data, wire.AggregationSpec().root_records),
        seed,
        dp=dp,
    )


# -- one member's update -------------------------------------------------------------------------


def _train(fed: Federation, g: Vector, x: np.ndarray, y: np.ndarray, seed: int) -> Vector:
    model = fed.task.build_model(0)
    load_flat_params(model, g.astype(np.float32))
    train_local(model, x, y, fed.params, fed.dp, "cpu", seed)
    return flatten_params(model).astype(np.float64) - g


def _clip_l2(v: Vector, c: float) -> Vector:
    norm = float(np.linalg.norm(v))
    return v * (c / norm) if norm > c else v


def honest_updates(fed: Federation, g: Vector, members: Sequence[int], r: int) -> dict[int, Vector]:
    """Each member's honest update (clipped to C by its client), trained in-process."""
    out = {}
    for i in members:
        x, y = fed.parts[i]
        delta = _train(fed, g, x, y, fed.seed * 100_003 + r * 1_009 + i)
        out[i] = _clip_l2(delta, fed.clip) if fed.clip > 0 else delta
    return out


def attack_updates(
    fed: Federation, attack: str, g: Vector, honest: dict[int, Vector], r: int
) -> dict[int, Vector]:
    """The attackers' vectors this round, each coordinate within the ring's [−C, C]."""
    bad = sorted(i for i in honest if i in fed.bad)
    good = np.stack([honest[i] for i in honest if i not in fed.bad] or [np.zeros_like(g)])
    rng = np.random.default_rng([fed.seed, r, 7])
    out: dict[int, Vector] = {}
    for i in bad:
        if attack == "none":
            v = honest[i]
        elif attack == "signflip":
            v = SIGNFLIP_FACTOR * honest[i]
        elif attack == "scale":
            v = SCALE_FACTOR * honest[i]
        elif attack == "labelflip":
            x, y = fed.parts[i]
            v = _clip_l2(_train(fed, g, x, 9 - y, fed.seed * 7 + r * 1_009 + i), fed.clip)
        elif attack == "gaussian":
            scale = GAUSSIAN_FACTOR * float(np.mean(np.linalg.norm(good, axis=1)))
            v = rng.standard_normal(g.size) * (scale / math.sqrt(g.size))
        elif attack == "alie":
            n, f = len(honest), len(bad)
            s = n // 2 + 1 - f
            z = NormalDist().inv_cdf((n - s) / n)
            v = good.mean(axis=0) - z * good.std(axis=0)
        elif attack == "zero":
            v = np.zeros_like(g)
        else:
            raise ConfigError(f"--attacks: unknown attack {attack!r}; one of {', '.join(ATTACKS)}")
        out[i] = np.clip(v, -fed.clip, fed.clip)
    return out


# -- the rule matrix -------------------------------------------------------------------------------


def rule_spec(rule: str, fed: Federation) -> wire.AggregationSpec:
    """The rule with parameters sized for the run: β and f at the attackers' share (dnc's
    f at 1.5 times it), τ at the median honest norm (C / 2.5)."""
    f = max(len(fed.bad), 1)
    if rule == "dnc":
        f = min(math.ceil(DNC_OVER_ATTACKERS * f), (fed.n - 1) // 2)
    return wire.AggregationSpec(
        rule=rule,  # type: ignore[arg-type]
        trim_fraction=min(max(len(fed.bad) / fed.n, 0.1), 0.45),
        byzantine=f,
        clip_radius=fed.clip / CLIP_OVER_HONEST,
        clip_iterations=3,
    )


@dataclass
class RunResult:
    accuracy: float
    attacker_share: float  # of the accepted weight, summed over rounds / rounds
    rounds_impossible: int = 0
    history: list[float] = field(default_factory=list)


def _accuracy(fed: Federation, g: Vector) -> float:
    model = fed.task.build_model(0)
    load_flat_params(model, g.astype(np.float32))
    return float(evaluate(model, fed.x_eval, fed.y_eval)[0])


def run_rule(fed: Federation, g0: Vector, rule: str, attack: str) -> RunResult:
    """``rounds`` rounds of every member training, attackers attacking, the rule
    combining (the aggregator's :func:`fedsec.learning.robust.aggregate`)."""
    spec = rule_spec(rule, fed)
    g = g0.copy()
    members = list(range(fed.n))
    weights = fed.weights(members)
    shares, impossible = [], 0
    for r in range(1, fed.rounds + 1):
        updates = honest_updates(fed, g, members, r)
        updates.update(attack_updates(fed, attack, g, updates, r))
        rows = np.stack([updates[i] * weights[k] for k, i in enumerate(members)])
        reference = None
        if rule == "fltrust":
            model = fed.task.build_model(0)
            load_flat_params(model, g.astype(np.float32))
            reference = reference_update(model, *fed.root, fed.params, fed.clip, fed.seed + r)
        try:
            result = robust.aggregate(spec, rows, weights, reference)
        except AggregationImpossible:
            impossible += 1  # the round is retried in production; here it is skipped
            continue
        bad_share = sum(
            o.weight for k, o in enumerate(result.outcomes) if o.accepted and members[k] in fed.bad
        )
        shares.append(bad_share)
        g = g + result.update
    return RunResult(_accuracy(fed, g), float(np.mean(shares)) if shares else 0.0, impossible)


# -- SecAgg+ with audit quarantine -------------------------------------------------------------


@dataclass
class QuarantineResult:
    accuracy: float
    quarantined_at: dict[int, int]  # attacker -> the round it was quarantined in
    challenged_rounds: dict[int, int]  # attacker -> challenged rounds until quarantined
    false_quarantine_tests: dict[int, str]  # honest member -> "round R: the failed tests"
    rollback_to_round: int | None
    accuracy_before_rollback: float | None
    rounds_run: int  # the rounds trained, rolled-back ones included

    @property
    def false_quarantines(self) -> int:
        """Honest members quarantined."""
        return len(self.false_quarantine_tests)


def run_quarantine(
    fed: Federation, g0: Vector, attack: str, challenge_rate: float
) -> QuarantineResult:
    """SecAgg+ (the sum only, so FedAvg) with the auditor challenging contributions and
    quarantining the members the control-sample checks fail."""
    training = RoundTraining(fed.params, fed.dp, fed.clip)
    qspec = QuantSpec(8, fed.clip, 16)
    versions = [g0.copy()]  # versions[r - 1]: the model round r starts from
    g = g0.copy()
    out: set[int] = set()
    quarantined_at: dict[int, int] = {}
    failed_tests: dict[int, str] = {}
    challenged: dict[int, int] = {}
    first_failed: int | None = None
    rollback: int | None = None
    before_rollback: float | None = None
    rng = np.random.default_rng([fed.seed, 99])
    # the final model has fed.rounds applied rounds, as the clean run's does: a rollback
    # discards rounds, and the federation trains on for as many (accuracy after recovery,
    # not after fewer rounds)
    last = fed.rounds
    r = 0
    while r < last:
        r += 1
        members = [i for i in range(fed.n) if i not in out]
        if not members:
            break  # everyone quarantined: the federation has stopped
        updates = honest_updates(fed, g, members, r)
        updates.update(attack_updates(fed, attack, g, updates, r))
        weights = fed.weights(members)
        total = sum(updates[i] * w for i, w in zip(members, weights, strict=True))
        picked = [i for i in members if rng.random() < challenge_rate]
        references: dict[int, Any] = {}
        for i in picked:
            if i in fed.bad:
                challenged[i] = challenged.get(i, 0) + 1
            samples = len(fed.parts[i][1])
            if samples not in references:
                references[samples] = build_reference(
                    fed.task, g.astype(np.float32), training, fed.control, samples, r, fed.seed
                )
            w = float(weights[members.index(i)] / weights.max())
            seed = int(rng.integers(0, 2**62)).to_bytes(32, "big")
            q = quantize(updates[i].astype(np.float32), w, qspec, seed)
            revealed = RevealedUpdate.from_quantized(str(i), r, q, qspec)
            steps = plan_round(samples, fed.params)[1]
            verdict = check_update(
                fed.task,
                references[samples],
                training,
                MemberClaim(str(i), r, samples, steps),
                revealed,
                (),
                fed.control,
            )
            if not verdict.passed:
                out.add(i)
                quarantined_at[i] = r
                failed_tests[i] = f"round {r}: {', '.join(verdict.failed)}"
                first_failed = r if first_failed is None else min(first_failed, r)
        g = g + total / weights.sum()
        versions.append(g.copy())
        if rollback is None and first_failed is not None and fed.bad <= out:
            before_rollback = _accuracy(fed, g)
            rollback = first_failed
            g = versions[first_failed - 1].copy()  # the version before the first failed round
            last += r - first_failed + 1
    return QuarantineResult(
        _accuracy(fed, g),
        quarantined_at,
        {i: challenged.get(i, 0) for i in quarantined_at if i in fed.bad},
        {i: why for i, why in failed_tests.items() if i not in fed.bad},
        rollback,
        before_rollback,
        r,
    )


# -- the command ---------------------------------------------------------------------------------


def _epsilon_spent(fed: Federation, rounds: int) -> float | None:
    if fed.dp is None:
        return None
    rate, steps = plan_round(min(len(y) for _, y in fed.parts), fed.params)
    return round(epsilon_of([(fed.dp.noise_multiplier, rate, steps * rounds)], fed.dp.delta), 3)


def _initial(fed: Federation) -> Vector:
    return flatten_params(fed.task.build_model(fed.seed)).astype(np.float64)


def calibrate_clip(fed: Federation, g0: Vector) -> Federation:
    """C = 2.5x the median honest update norm of a first round from ``g0``."""
    norms = [float(np.linalg.norm(v)) for v in honest_updates(fed, g0, range(fed.n), 1).values()]
    return dataclasses.replace(fed, clip=CLIP_OVER_HONEST * float(np.median(norms)))


def _names(text: str, allowed: Sequence[str], option: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in allowed]
    if unknown or not names:
        raise ConfigError(
            f"{option}: unknown {unknown or 'empty list'}; one of {', '.join(allowed)}"
        )
    return names


def _emit(line: dict[str, Any], as_json: bool, show: Callable[[str], None]) -> None:
    if as_json:
        show(json.dumps(with_environment(line), sort_keys=True))
    else:
        show(" ".join(f"{k}={v}" for k, v in line.items()))


@click.command()
@click.option("--task", default="mnist1d", show_default=True)
@click.option("--agents", type=int, default=50, show_default=True)
@click.option("--bad", type=float, default=0.2, show_default=True, help="share of attackers")
@click.option("--attacks", default=",".join(ATTACKS), show_default=True)
@click.option("--rules", default=",".join(RULES), show_default=True)
@click.option(
    "--rounds",
    type=int,
    default=None,
    help=f"default {DEFAULT_ROUNDS['none']} for the rule matrix (clean FedAvg has converged), "
    f"{DEFAULT_ROUNDS['secagg']} with --secure-sum secagg",
)
@click.option(
    "--local-epochs",
    type=int,
    default=MATRIX_TRAINING.local_epochs,
    show_default=True,
    help="the rule matrix's local epochs (the quarantine runs use the audit's DP recipe)",
)
@click.option(
    "--cells",
    default=None,
    help="RULE:ATTACK,... instead of --rules x --attacks: only these cells, in this order "
    "(a run cut short has measured the first ones)",
)
@click.option("--partition", default="iid", show_default=True, help="iid or dirichlet:ALPHA")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--secure-sum",
    type=click.Choice(["none", "secagg"]),
    default="none",
    show_default=True,
    help="none: the rule matrix; secagg: the sum only (FedAvg), with --defence",
)
@click.option("--defence", type=click.Choice(["none", "audit-quarantine"]), default="none")
@click.option("--challenge-rate", type=float, default=0.3, show_default=True)
@click.option(
    "--dp-epsilon",
    type=float,
    default=None,
    help="members train with DP-SGD spending this over the run (default: none for the rule "
    "matrix, 8 with audit quarantine: the control checks are calibrated under DP)",
)
@click.option("--json", "as_json", is_flag=True)
def bench_robust(
    task: str,
    agents: int,
    bad: float,
    attacks: str,
    rules: str,
    cells: str | None,
    rounds: int | None,
    local_epochs: int,
    partition: str,
    seed: int,
    secure_sum: str,
    defence: str,
    challenge_rate: float,
    dp_epsilon: float | None,
    as_json: bool,
) -> None:
    """Aggregation rules against attacks (one line per rule and attack), or SecAgg+ with
    audit quarantine; in-process, with the real training, rule and audit code."""
    torch.set_num_threads(1)
    rounds = DEFAULT_ROUNDS[secure_sum] if rounds is None else rounds
    if (
        not 0 <= bad < 0.5
        or agents < 5
        or rounds < 1
        or local_epochs < 1
        or not 0 < challenge_rate <= 1
    ):
        raise ConfigError(
            "need --agents >= 5, 0 <= --bad < 0.5, --rounds >= 1, --local-epochs >= 1, "
            "0 < --challenge-rate <= 1"
        )
    attack_list = _names(attacks, ATTACKS, "--attacks")
    cell_list = [] if secure_sum == "secagg" else _cells(cells, rules, attack_list)
    quarantine = secure_sum == "secagg"
    if quarantine and defence != "audit-quarantine":
        raise ConfigError("--secure-sum secagg measures --defence audit-quarantine")
    if quarantine and dp_epsilon is None:
        dp_epsilon = 8.0
    fed = make_federation(task, agents, bad, partition, rounds, seed, dp_epsilon, local_epochs)
    g0 = _initial(fed)
    fed = calibrate_clip(fed, g0)
    # the clean reference: FedAvg without attackers, trained as the run's members train
    clean = None if quarantine else run_rule(fed, g0, "fedavg", "none")
    clean_accuracy = (
        run_quarantine(fed, g0, "none", 0.0).accuracy if clean is None else clean.accuracy
    )
    base = {
        "bench": "robust",
        "task": task,
        "agents": agents,
        "bad": len(fed.bad),
        "rounds": rounds,
        "local_epochs": None if quarantine else local_epochs,
        "partition": partition,
        "seed": seed,
        "clip": round(fed.clip, 5),
        "dp_epsilon": dp_epsilon,
        "clean_fedavg_accuracy": round(clean_accuracy, 4),
    }
    show = click.echo
    if quarantine:
        for attack in attack_list:
            t0 = time.perf_counter()
            q = run_quarantine(fed, g0, attack, challenge_rate)
            caught = {str(i): r for i, r in sorted(q.quarantined_at.items()) if i in fed.bad}
            _emit(
                {
                    **base,
                    "secure_sum": "secagg",
                    "defence": defence,
                    "attack": attack,
                    "challenge_rate": challenge_rate,
                    "quarantined_round": caught,
                    "challenged_rounds_to_quarantine": {
                        str(i): c for i, c in sorted(q.challenged_rounds.items())
                    },
                    "attackers_missed": sorted(str(i) for i in fed.bad - set(q.quarantined_at)),
                    "false_quarantines": q.false_quarantines,
                    "false_quarantine_tests": {
                        str(i): why for i, why in sorted(q.false_quarantine_tests.items())
                    },
                    "rollback_to_round": q.rollback_to_round,
                    "accuracy_before_rollback": q.accuracy_before_rollback,
                    "rounds_run": q.rounds_run,
                    # the rounds after a rollback cost budget too: ε of the smallest
                    # member over every round it trained in
                    "epsilon_spent": _epsilon_spent(fed, q.rounds_run),
                    "accuracy": round(q.accuracy, 4),
                    "seconds": round(time.perf_counter() - t0, 1),
                },
                as_json,
                show,
            )
        return
    for rule, attack in cell_list:
        t0 = time.perf_counter()
        same = (rule, attack) == ("fedavg", "none") and clean is not None
        res = clean if same and clean is not None else run_rule(fed, g0, rule, attack)
        _emit(
            {
                **base,
                "rule": describe_rule(rule, fed),
                "attack": attack,
                "accuracy": round(res.accuracy, 4),
                "loss_vs_clean_pt": round(100 * (clean_accuracy - res.accuracy), 2),
                "attacker_weight_share": round(res.attacker_share, 4),
                "rounds_impossible": res.rounds_impossible,
                "seconds": round(time.perf_counter() - t0, 1),
            },
            as_json,
            show,
        )


def _cells(cells: str | None, rules: str, attacks: list[str]) -> list[tuple[str, str]]:
    """The (rule, attack) cells to run: ``--cells`` as listed, else attack by attack with
    every rule under each (a run cut short still compares the rules on the first attacks).

    Raises:
        ConfigError: a cell that is not RULE:ATTACK with a known rule and attack.
    """
    if cells is None:
        rule_list = _names(rules, RULES, "--rules")
        return [(rule, attack) for attack in attacks for rule in rule_list]
    out = []
    for cell in (c.strip() for c in cells.split(",") if c.strip()):
        rule, _, attack = cell.partition(":")
        if rule not in RULES or attack not in ATTACKS:
            raise ConfigError(
                f"--cells: {cell!r} is not RULE:ATTACK with a rule of {', '.join(RULES)} "
                f"and an attack of {', '.join(ATTACKS)}"
            )
        out.append((rule, attack))
    if not out:
        raise ConfigError("--cells: empty list")
    return out


def describe_rule(rule: str, fed: Federation) -> str:
    """The rule with its parameters, as the log's refusals name it."""
    return robust.describe(rule_spec(rule, fed))
