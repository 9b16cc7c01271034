"""``fedsec simulate``: a real aggregator on loopback HTTP and N agents.

The aggregator is a ``fedsec aggregator serve`` child process, as deployed (or, with
``aggregator_process=False``, an app in this process's event loop).  Each agent is
a full :class:`AgentRuntime` (signed requests, SecAgg+ or plain intake, DP-SGD when
asked) running as an asyncio task, in this process or spread over member processes
(:mod:`fedsec.simulated_members`); training runs in worker threads.  The same model
is also trained centrally on the union of the agents' data for the same number of
epochs, and the gap between the two is reported.

Why a separate aggregator process: with everything in one event loop, the
aggregator's request handling and the members' SecAgg+ client work serialise on one
core, so the timing would measure this harness rather than the protocol.  What remains
in this process is the members' own SecAgg+ work, which a deployed agent does once, on
its own machine; here it runs N times over on one interpreter lock.  Measurements of
these choices: bench/results/simulation-notes.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from fedsec.agent.ledger import noise_for_budget
from fedsec.aggregator.capacity import (
    CONNECTIONS_PER_IDENTITY,
    connection_limit,
    descriptors_needed,
    ensure_descriptors,
)
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.aio import cancel_and_wait
from fedsec.bench.common import (
    aggregator_alive,
    federation_status,
    free_port,
    with_environment,
)
from fedsec.config import FEDADAM_LR, ServerSection, server_defaults
from fedsec.crypto.discretize import DdpSpec
from fedsec.crypto.discretize import decode_sum as ddp_decode
from fedsec.crypto.discretize import encode as ddp_encode
from fedsec.crypto.quantize import default_ring_bits
from fedsec.errors import ConfigError
from fedsec.federation import LocalAgent, create_federation, enrol_agents, federation_toml
from fedsec.learning.distributed import clipped_gradient_sum, poisson_sample
from fedsec.learning.optimizers import ServerRule, server_rule, server_step
from fedsec.learning.training import plan_round, train_centralized
from fedsec.modelfile import decode_model
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import default_range_stddevs
from fedsec.protocol.limits import DEFAULT_DELTA, MAX_MODEL_BYTES
from fedsec.simulated_members import (
    MemberPlan,
    MemberTally,
    default_member_processes,
    frozen_heap,
    member_runtimes,
    parse_member_range,
    read_plan,
    run_member_processes,
    run_member_range,
    split,
    tally,
    usable_cores,
    write_plan,
)
from fedsec.summation import SummationMode, mode_named
from fedsec.tasks import TrainingParams, get_task, parse_partition
from fedsec.tasks.base import Dataset, Task
from fedsec.tasks.evaluation import evaluate
from fedsec.tasks.params import arrays_to_state, flatten_params, load_flat_params

# Per-task settings for federated runs where local data is small: a clip norm that
# leaves typical update norms unclipped, and for MNIST-1D two local epochs of Adam with
# plain FedAvg (server lr 1.0), the setting that rose steadily in a FedAvg sweep
# (bench/results/simulation-notes.md).
SIM_DEFAULTS: dict[str, dict[str, Any]] = {
    "mnist1d": {
        "local_epochs": 2,
        "batch_size": 20,
        "lr": 0.02,
        "optimizer": "adam",
        "clip": 8.0,
        "server_lr": 1.0,
    },
    "digits": {"local_epochs": 3, "batch_size": 16, "lr": 0.05, "optimizer": "sgd", "clip": 4.0},
    "breast_cancer": {
        "local_epochs": 2,
        "batch_size": 16,
        "lr": 0.1,
        "optimizer": "sgd",
        "clip": 2.0,
    },
}
DELTA = DEFAULT_DELTA
# Record-level distributed DP: the union's expected batch per round (DP-SGD favours
# large batches; 1,000 of MNIST-1D's 4,000 records is the central recipe the issue
# compares with), per-record clip, and bits (the ring must hold a noise share finely).
DDP_BATCH = 1000
DDP_RECORD_CLIP = 1.0
DDP_QUANT_BITS = 16
# Without DP the round spec still carries a noise multiplier, and agents project their
# (unlimited) budget with it before joining each round.  The accountant's cost depends on
# it: at 1.0 one projection takes ~80 ms of CPU on the event loop, per agent per round;
# above ~10 it takes ~8 ms.  The value is never used for training (dp.enabled = false).
NON_DP_NOISE_PLACEHOLDER = 1000.0


@dataclass(frozen=True)
class SimulationSpec:
    task: str = "mnist1d"
    agents: int = 50
    rounds: int = 20
    partition: str = "iid"
    secure_sum: str = "secagg"
    # he only: the model hidden from the aggregator (he.model_visible_to_aggregator =
    # false); the final accuracy is then scored on the version opened with the custodian's key
    hide_model: bool = False
    quant_bits: int = 0  # 0 = 8, or DDP_QUANT_BITS in distributed DP
    clip: float = 0.0
    dp_epsilon: float | None = None
    # "distributed": members add noise shares inside the SecAgg+ ring ([dp] mode); with
    # dp_unit "record" each round is one DP-SGD step over the union's records
    dp_mode: str = "local"
    dp_unit: str = "record"
    dp_sample_rate: float = 0.0  # distributed, record: 0 = DDP_BATCH records of the union
    dp_min_survivors: float = 0.8  # distributed: dp.min_survivors_fraction
    # the update codec ([codec]): rotation, fraction of coordinates kept, rounding range
    # (0 = a default with rotation), ring headroom (0 = none of a sum wraps), error feedback
    rotation: str = "none"
    sparsity: float = 1.0
    range_stddevs: float = 0.0
    headroom_bits: int = 0
    error_feedback: bool = False
    local_epochs: int = 0
    lr: float = 0.0
    batch_size: int = 0  # 0 = the task's simulation default
    server_optimizer: str = ""  # "" = fedadam in record-level distributed DP, else fedavg
    server_lr: float = 0.0  # 0 = the task's default (FedAvg), else config.server_defaults
    seed: int = 0
    # buffered asynchronous rounds (FedBuff) and slow members, for `fedsec bench async`
    mode: str = "sync"
    buffer_size: int = 10
    max_staleness: int = 4
    slow_fraction: float = 0.0  # the first ceil(fraction * agents) members train slowly
    slowdown: float = 1.0  # ... this many times slower
    target_accuracy: float = 0.0  # report the wall time at which the model first reaches it

    @property
    def summation(self) -> SummationMode:
        """The summation mode ``secure_sum`` names.

        Raises:
            ProtocolError: no such mode.
        """
        return mode_named(self.secure_sum)

    # members lost for good: this fraction of them, drawn at random, stops at a random
    # moment of round kill_round (its task is cancelled: no message, no goodbye)
    kill_fraction: float = 0.0
    kill_round: int = 2
    baseline: bool = True  # also train the centralized baseline
    # The aggregator as its own ``fedsec aggregator serve`` process, as deployed: its
    # request handling then runs beside the members instead of sharing their event loop.
    aggregator_process: bool = True
    # open live dashboards (server-sent event streams) during the run, to measure what
    # they cost the aggregator (`fedsec bench ops`)
    dashboard_viewers: int = 0
    # [storage] url: the aggregator's state in this (empty) PostgreSQL database instead
    # of the workspace's SQLite file (`fedsec bench store`)
    storage_url: str = ""
    # the members spread over this many `fedsec simulate --members-only` processes (0 =
    # simulated_members.default_member_processes; 1 = in this process, as before)
    member_processes: int = 0
    # only members A:B run here ("" = all); the others run elsewhere from the plan
    # (members.json) and their homes, e.g. on another machine (docs/simulation.md)
    local_members: str = ""
    # the aggregator's address: another machine's members need one they can reach
    listen: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    # fedsec.faults' unsafe deterministic seed for every member ("" = the OS CSPRNG): two
    # runs of the same spec give the same model, however the members are spread
    unsafe_seed: str = ""


# A RAM-backed directory for the throw-away workspace when there is one: the aggregator's
# SQLite commits and every agent's ledger, vault and receipt writes fsync, which on a
# disk costs more per round than the agents' training.
RAM_DIR = Path("/dev/shm")


@contextlib.contextmanager
def _quiet_fedsec_logs() -> Iterator[None]:
    """Only errors from fedsec's loggers: 50 agents repeat every warning each round.

    Also ignores Opacus' per-sample hook warning process-wide: train_local filters it
    with ``warnings.catch_warnings``, which is not thread-safe, so with agents training
    in parallel threads it leaks out once per agent and round.
    """
    logger = logging.getLogger("fedsec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        logger.setLevel(level)


#: Seconds a separate aggregator process may take to start serving (Python + torch).
AGGREGATOR_START_S = 120.0


@contextlib.asynccontextmanager
async def _child(args: list[str], log_path: Path) -> AsyncIterator[subprocess.Popen[bytes]]:
    """Run ``python -m fedsec ARGS`` as a child process logging to ``log_path``; stop it
    with SIGTERM (then SIGKILL after 30 s) when the block ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSEC_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedsec", *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


@contextlib.asynccontextmanager
async def _serving(ws: Workspace, spec: SimulationSpec) -> AsyncIterator[str]:
    """Serve ``ws`` on ``spec.listen`` (port ``spec.port``, 0 = a free one); yield its URL.

    ``spec.aggregator_process``: run ``fedsec aggregator serve`` as a child process
    (logging to ``serve.log`` in the workspace), stopped with SIGTERM afterwards;
    otherwise serve in this process's event loop.
    """
    if not spec.aggregator_process:
        identities = len(ws.roster.entries())
        server = await start_server(
            make_app(ws), spec.listen, spec.port, None, ws.config.server, identities=identities
        )
        try:
            yield server.url
        finally:
            await server.close()
        return
    port = spec.port or free_port()
    url = f"http://{spec.listen}:{port}"
    args = ["aggregator", "serve", "--workspace", str(ws.root), "--port", str(port)]
    args += ["--host", spec.listen]
    # A simulation stopped with SIGTERM (kill, a CI or shell timeout) would die at once and
    # leave its children serving: cancel the run instead, so the cleanups stop them.
    loop = asyncio.get_running_loop()
    main = threading.current_thread() is threading.main_thread()  # signals need it
    run = asyncio.current_task() if main else None
    if run is not None:
        loop.add_signal_handler(signal.SIGTERM, run.cancel)
    try:
        async with _child(args, ws.root / "serve.log") as proc:
            deadline = time.monotonic() + AGGREGATOR_START_S
            while not await asyncio.to_thread(aggregator_alive, url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ConfigError(
                        f"the simulation's aggregator did not start serving {url} "
                        f"(exit code {proc.poll()}); see {ws.root / 'serve.log'}"
                    )
                await asyncio.sleep(0.1)
            yield url
    finally:
        if run is not None:
            loop.remove_signal_handler(signal.SIGTERM)  # a second SIGTERM ends us at once


async def run_simulation(spec: SimulationSpec, workdir: Path | None = None) -> dict[str, Any]:
    """Run the federation and the centralized baseline; return the result record.

    Without ``workdir`` the federation lives in a temporary directory (in RAM where
    there is one), removed however the run ends: a simulation stopped by SIGTERM or an
    error must not leave its workspace filling /dev/shm."""
    with _quiet_fedsec_logs():
        if workdir is not None:
            return await _run_simulation(spec, workdir, temporary=False)
        ram = RAM_DIR if RAM_DIR.is_dir() else None
        root = Path(tempfile.mkdtemp(prefix="fedsec-sim-", dir=ram))
        try:
            return await _run_simulation(spec, root, temporary=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


async def run_members_only(
    plan_path: Path, member_range: str, training_threads: int = 0
) -> MemberTally:
    """Run members ``member_range`` (``A:B``; "" = all) of a simulation started elsewhere,
    from its plan (``members.json``) and the members' homes beside it, until the
    federation finishes (``fedsec simulate --members-only``).

    Raises:
        ConfigError: no such plan or range, or too few descriptors for the members.
        KeyFileError: a member's home lacks its identity key.
        FedsecError: a member's fatal error (see :meth:`AgentRuntime.run`).
    """
    members = parse_member_range(member_range, read_plan(plan_path).members)
    with _quiet_fedsec_logs():
        return await run_member_range(plan_path, members, training_threads)


async def _run_simulation(spec: SimulationSpec, root: Path, temporary: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # agents train in parallel threads; avoid oversubscription
    _secure_descriptors(spec)
    defaults = SIM_DEFAULTS.get(spec.task, SIM_DEFAULTS["breast_cancer"])
    task = get_task(spec.task)
    data = task.load()
    parts = parse_partition(spec.partition).apply(data.y_train, spec.agents, spec.seed)
    smallest = min(len(p) for p in parts)
    training = {
        "local_epochs": spec.local_epochs or defaults["local_epochs"],
        "batch_size": spec.batch_size or defaults["batch_size"],
        "lr": spec.lr or defaults["lr"],
        "optimizer": defaults["optimizer"],
    }
    params = TrainingParams(**training)
    clip = spec.clip or defaults["clip"]
    distributed = spec.dp_mode == "distributed" and spec.dp_epsilon is not None
    record_level = distributed and spec.dp_unit == "record"
    derived, derived_lr = server_defaults(distributed, spec.dp_mode, spec.dp_unit)
    optimizer = spec.server_optimizer or derived
    server_lr = spec.server_lr or (
        defaults.get("server_lr", 1.0)
        if optimizer == "fedavg"
        else (derived_lr if optimizer == derived else FEDADAM_LR)
    )
    quant_bits = spec.quant_bits or (DDP_QUANT_BITS if distributed else 8)
    noise = 0.0
    rate = 0.0
    dp_extra: dict[str, Any] = {}
    if record_level:
        assert spec.dp_epsilon is not None
        rate = spec.dp_sample_rate or min(1.0, DDP_BATCH / sum(len(p) for p in parts))
        noise = noise_for_budget(spec.dp_epsilon, DELTA, rate, 1, spec.rounds)
        # a member's sum of clipped gradients: its expected batch plus four standard
        # deviations, times C (clipping the sum keeps the per-record sensitivity C)
        batch = rate * max(len(p) for p in parts)
        clip = spec.clip or DDP_RECORD_CLIP * (batch + 4 * math.sqrt(batch))
        dp_extra = {"max_grad_norm": DDP_RECORD_CLIP, "sample_rate": rate}
    elif spec.dp_epsilon is not None:
        if distributed:  # member level: every member joins every round, no amplification
            noise = noise_for_budget(spec.dp_epsilon, DELTA, 1.0, 1, spec.rounds)
        else:
            rate, steps = plan_round(smallest, params)
            noise = noise_for_budget(spec.dp_epsilon, DELTA, rate, steps, spec.rounds)
    if distributed:
        dp_extra.update(
            {
                "mode": "distributed",
                "unit": spec.dp_unit,
                "min_survivors_fraction": spec.dp_min_survivors,
            }
        )
    codec = {
        "rotation": spec.rotation,
        "keep": spec.sparsity,
        "range_stddevs": spec.range_stddevs or default_range_stddevs(spec.rotation),
        "error_feedback": spec.error_feedback,
        "headroom_bits": spec.headroom_bits,
    }
    text = federation_toml(
        "sim",
        spec.task,
        round_={
            "min_agents": min(3, spec.agents),
            "max_agents": spec.agents,
            "rounds": spec.rounds,
            "secure_sum": spec.secure_sum,
            "quant_bits": quant_bits,
            "clip_norm": clip,
            # with members lost on purpose, deadlines a lost member costs are short (the
            # survivors train in seconds); otherwise generous, as deployed
            "advertise_s": 5.0 if spec.kill_fraction else _stage_s(spec, 60.0),
            "share_s": 5.0 if spec.kill_fraction else _stage_s(spec, 30.0),
            "open_s": 20.0 if spec.kill_fraction else _stage_s(spec, 600.0),
            "masked_s": 10.0 if spec.kill_fraction else _stage_s(spec, 60.0),
            "unmask_s": 5.0 if spec.kill_fraction else _stage_s(spec, 30.0),
            "max_weight_samples": max(len(p) for p in parts),
            "mode": spec.mode,
            "buffer_size": spec.buffer_size,
            "max_staleness": spec.max_staleness,
        },
        training=training,
        dp={
            "enabled": spec.dp_epsilon is not None,
            "noise_multiplier": noise if spec.dp_epsilon is not None else NON_DP_NOISE_PLACEHOLDER,
            **dp_extra,
        },
        codec=codec,
        server={
            "optimizer": optimizer,
            "server_lr": server_lr,
            "port": 0,
            # every simulated member connects from 127.0.0.1 at the same instant (the
            # members-behind-one-NAT case), so one peer's unauthenticated share is the roster's
            "max_connections_per_peer": max(64, spec.agents * CONNECTIONS_PER_IDENTITY),
        },
        he=(
            {"custodian": CUSTODIAN_ID, "model_visible_to_aggregator": not spec.hide_model}
            if spec.summation.custodian_decrypts
            else None
        ),
        validation={"enabled": False} if spec.hide_model else None,
    )
    if spec.storage_url:  # the rendered [storage] section holds url = "" once
        text = text.replace('\nurl = ""\n', f"\nurl = {json.dumps(spec.storage_url)}\n", 1)
    ws = create_federation(root, "sim", spec.task, text)
    local = enrol_agents(ws, root, spec.agents)
    if spec.summation.custodian_decrypts:
        _enrol_custodian(ws, root / CUSTODIAN_ID)
    aggregator_public = ws.signer.public_bytes
    if spec.aggregator_process:
        ws.close()  # the serving process owns the workspace until it exits
    extra: dict[str, Any] = {}
    wall = await _run_agents(spec, ws, local, aggregator_public, extra)
    if spec.aggregator_process:
        ws = Workspace.open(ws.root)
    rows = ws.state.rounds.history(100000)
    # the newest model's hash: runs of one spec under spec.unsafe_seed compare by it
    extra["model_sha256"] = ws.models.latest().sha256
    summaries = [msgspec.json.decode(r.summary, type=wire.RoundSummary) for r in rows if r.summary]
    reached = [
        r.closed_at
        for r, s in zip([r for r in rows if r.summary], summaries, strict=True)
        if s.score is not None and _reaches(task, s.score, spec.target_accuracy) and r.closed_at
    ]
    time_to_target = (
        round(min(reached) - rows[0].opened_at, 2) if spec.target_accuracy and reached else None
    )
    closed = [s for s in summaries if s.stage == "closed"]
    final = closed[-1] if closed else None
    hidden_acc = _hidden_accuracy(ws, root / CUSTODIAN_ID, task, data) if spec.hide_model else None
    ws.close()
    if temporary:  # free the RAM before the centralized baseline trains
        shutil.rmtree(root, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The baseline is the task's own centralized recipe (for MNIST-1D the paper's: Adam
    # 0.01, batch 100) over the same number of epochs each member trains in total; the
    # members' local settings suit ~80 records per member, not 4,000 in one place.
    central_acc = (
        train_centralized(
            task, data, epochs=spec.rounds * params.local_epochs, device=device, seed=spec.seed
        )[0]
        if spec.baseline
        else float("nan")
    )
    if record_level:
        server = ServerSection()  # [server]'s default FedAdam moments
        rule = server_rule(
            optimizer, server_lr, server.adam_beta1, server.adam_beta2, server.adam_tau
        )
        extra["centralized_dp_accuracy"] = (
            central_dp_accuracy(
                task,
                data,
                spec.rounds,
                rate,
                noise,
                default_ring_bits(quant_bits, spec.agents),
                rule,
            )
            if spec.baseline
            else None
        )
    if distributed or spec.headroom_bits:
        # the sums' coordinates at the ring's edge (likely wraps), of those that could wrap
        coords = sum(s.coordinates for s in closed)
        extra["wrap_rate"] = sum(s.edge_count for s in closed) / coords if coords else None
    if distributed:
        extra["realised_noise_multiplier_min"] = min(
            (s.noise_multiplier for s in closed), default=None
        )
        extra["survivors_min"] = min((s.survivors for s in closed), default=None)
    dim = sum(p.numel() for p in task.build_model(0).parameters())
    up = [s.bytes_up / max(s.participants, 1) for s in closed]
    # everything a member sends (request heads and bodies), to compare with float32
    bytes_up = sum(up) / len(up) if up else 0.0
    member_rounds = max(sum(s.participants for s in closed), 1)
    extra["bytes_up_by_request"] = {
        name: {k: round(v / member_rounds, 2) for k, v in counts.items()}
        for name, counts in extra.pop("wire_up").items()
    }
    float32 = 4 * dim
    vector = extra["bytes_up_by_request"].get("masked_input", {})
    payload = vector.get("body", 0.0) / vector["requests"] if vector.get("requests") else None
    # the task's primary metric (RoundSummary.score: what the dashboard and alerts show)
    final_score = final.score if final and final.score is not None else float("nan")
    if hidden_acc is not None:
        final_score = hidden_acc
    final_acc = final.accuracy if final and final.accuracy is not None else float("nan")
    if task.primary_metric == "accuracy":
        final_acc = final_score
    # train_centralized's first value is the accuracy of integer labels, else the task's
    # primary metric
    central_score, central_acc = _centralized_scores(task, data, central_acc)
    metric = task.primary_metric
    eps = [s.epsilon_max for s in summaries if s.epsilon_max is not None]
    return with_environment(
        {
            "bench": "simulate",
            "task": spec.task,
            "agents": spec.agents,
            "partition": spec.partition,
            "secure_sum": spec.secure_sum,
            "quant_bits": quant_bits,
            "dp_epsilon": spec.dp_epsilon,
            "noise_multiplier": noise if spec.dp_epsilon is not None else None,
            "local_epochs": params.local_epochs,
            "batch_size": params.batch_size,
            "lr": params.lr,
            "optimizer": params.optimizer,
            "clip": clip,
            "server_optimizer": optimizer,
            "server_lr": server_lr,
            "seed": spec.seed,
            "primary_metric": metric,
            "higher_is_better": task.higher_is_better,
            f"final_{metric}": final_score,
            f"centralized_{metric}": central_score,
            # accuracy where the task has it (nan for a regression): read by older benches
            "final_accuracy": final_acc,
            "centralized_accuracy": central_acc,
            "centralized_epochs": spec.rounds * params.local_epochs,
            # in points of the primary metric, positive where the federation did worse
            "gap_pt": round(
                100 * (central_score - final_score) * (1 if task.higher_is_better else -1), 2
            ),
            "rounds": len(closed),
            "aborted_rounds": sum(1 for s in summaries if s.stage == "aborted"),
            "dim": dim,
            "bytes_up_per_agent_round": round(bytes_up, 1),
            "bytes_float32_per_agent_round": float32,
            "compression_ratio": round(float32 / bytes_up, 3) if bytes_up else None,
            "payload_bytes_per_agent_round": round(payload, 1) if payload else None,
            "payload_compression_ratio": round(float32 / payload, 3) if payload else None,
            "dp_mode": spec.dp_mode if spec.dp_epsilon is not None else None,
            "rotation": spec.rotation,
            "sparsity": spec.sparsity,
            "range_stddevs": codec["range_stddevs"],
            "headroom_bits": spec.headroom_bits,
            "error_feedback": spec.error_feedback,
            "epsilon_max": max(eps) if eps else None,
            "wall_s": round(wall, 2),
            "mode": spec.mode,
            "buffer_size": spec.buffer_size if spec.mode == "buffered" else None,
            "slow_fraction": spec.slow_fraction,
            "slowdown": spec.slowdown,
            "target_accuracy": spec.target_accuracy or None,
            "time_to_target_s": time_to_target,
            "round_s_mean": round(wall / len(closed), 2) if closed else None,
            "dashboard_viewers": spec.dashboard_viewers,
            **extra,
        }
    )


def _reaches(task: Task, score: float, target: float) -> bool:
    """Whether ``score`` of the task's primary metric is at ``target`` or better."""
    return score >= target if task.higher_is_better else score <= target


def _centralized_scores(task: Task, data: Dataset, first: float) -> tuple[float, float]:
    """(primary metric, accuracy) of the centralized baseline from
    :func:`train_centralized`'s first value: the accuracy for integer labels, the
    primary metric for floating ones; nan for what it does not give."""
    floating = np.issubdtype(np.asarray(data.y_test).dtype, np.floating)
    accuracy = float("nan") if floating else first
    if floating or task.primary_metric == "accuracy":
        return first, accuracy
    return float("nan"), accuracy


def central_dp_accuracy(
    task: Task,
    data: Dataset,
    steps: int,
    rate: float,
    noise: float,
    ring_bits: int,
    rule: ServerRule,
) -> float:
    """DP-SGD on the pooled records at the same (q, σ, steps) and δ, trained by the
    federation's own code: the pooled Poisson sample's clipped gradient sum
    (:func:`fedsec.learning.distributed.clipped_gradient_sum`), discretised with the whole
    noise by one "member" (:mod:`fedsec.crypto.discretize`), decoded, divided by the
    expected batch q·N and stepped by the federation's server rule from the same initial
    model."""
    model = task.build_model(seed=0)
    flat = flatten_params(model)
    n = len(data.y_train)
    batch = rate * n
    spec = DdpSpec(
        dim=flat.size,
        ring_bits=ring_bits,  # the federation's ring, so both discretise alike
        clip=DDP_RECORD_CLIP * (batch + 4 * math.sqrt(batch)),
        sensitivity=DDP_RECORD_CLIP,
        noise_multiplier=noise,
        min_survivors=1,
        max_members=1,
    )
    state = None
    for _ in range(steps):
        include = poisson_sample(n, rate)
        total, _ = clipped_gradient_sum(model, data.x_train, data.y_train, include, DDP_RECORD_CLIP)
        shared = os.urandom(32)
        ring = ddp_encode(-total, spec, shared, os.urandom(32)).ring
        mean = (ddp_decode(ring, spec, shared) / batch).astype(np.float32)
        flat, state = server_step(rule, flat, mean, state)
        load_flat_params(model, flat)
    accuracy, _ = evaluate(model, data.x_test, data.y_test, task=task)
    return float(accuracy)


#: A stage's work per simulated member, at worst, on a shared 2-core machine.  Every
#: member's SecAgg+ stage reads the whole cohort's key list (O(n) each), and here all n
#: run in one process: 1,000 members took 187 s to advertise and 74 s to share keys on 2
#: cores with a load of 11 (the 30 s and 60 s defaults aborted every attempt), where a
#: deployed member takes well under a second on its own machine.
STAGE_S_PER_MEMBER = 0.5


def _stage_s(spec: SimulationSpec, deployed_s: float) -> float:
    """A stage deadline for the simulation: the deployed default, or longer when the
    members' combined work in this process needs it.  A stage closes as soon as every
    member answered, so a generous deadline costs nothing unless someone is lost."""
    return max(deployed_s, spec.agents * STAGE_S_PER_MEMBER)


def _secure_descriptors(spec: SimulationSpec) -> None:
    """Raise this process's descriptor limit for the run before anything is spent on it:
    its members' connections (two each) and, inherited by a separate one, the
    aggregator's (sized from the roster: the members, a custodian and an observer).

    Raises:
        ConfigError: the hard limit is too low; the message names the numbers and the fix.
    """
    aggregator = descriptors_needed(connection_limit(0, spec.agents + 2))
    needed = aggregator if spec.aggregator_process else 2 * aggregator
    ensure_descriptors(needed, f"a simulation of {spec.agents} members")


#: The key custodian of a simulated homomorphic-summation federation (its own task here;
#: a separate organisation in a deployment).
CUSTODIAN_ID = "custodian"


def _enrol_custodian(ws: Workspace, home: Path) -> None:
    """Make the custodian's keys in ``home`` and enrol it (role custodian)."""
    from fedsec.crypto.he import HeParams
    from fedsec.custodian.store import create_custodian
    from fedsec.protocol.roster import sign_roster_entry

    he = ws.config.he
    params = HeParams(he.poly_modulus_degree, tuple(he.coeff_mod_bit_sizes), he.scale_bits)
    manifest = create_custodian(home, ws.federation_id, params)
    ws.roster.add(
        sign_roster_entry(
            federation_id=ws.federation_id,
            agent_id=CUSTODIAN_ID,
            public_key=bytes.fromhex(manifest.public_key),
            role="custodian",
            admin=ws.admin(),
        )
    )


def _hidden_accuracy(ws: Workspace, custodian_home: Path, task: Task, data: Dataset) -> float:
    """Test accuracy of the newest hidden version, opened with the custodian's key (the
    aggregator's store holds only the sealed release)."""
    from fedsec.custodian.store import open_custodian
    from fedsec.protocol.he_release import open_release

    manifest = ws.models.latest()
    while manifest.kind == "rollback" and manifest.parent is not None:
        manifest = ws.models.get(manifest.parent)
    model_file = ws.models.read(manifest.version)
    if manifest.kind == "sealed":
        custodian = open_custodian(custodian_home).identity
        dim = sum(p.numel() for p in task.build_model(0).parameters())
        model_file = open_release(
            model_file, custodian.public_bytes, CUSTODIAN_ID, custodian.x25519_secret(), dim + 1
        ).model
    model = task.build_model(0)
    arrays_to_state(model, decode_model(model_file, max_bytes=MAX_MODEL_BYTES))
    # the primary metric for floating labels (a regression), the accuracy otherwise
    return evaluate(model, data.x_test, data.y_test, task=task)[0]


async def _custodian(spec: SimulationSpec, root: Path, url: str, aggregator: bytes) -> None:
    """The key custodian, serving until the federation finishes (he rounds only): its own
    ``fedsec custodian serve`` process beside a separate aggregator, as deployed (its sum
    checks re-add every contribution; in this process they would stall the members'
    event loop), else a task in this process.

    Raises:
        ConfigError: the custodian's process failed (its log says why).
    """
    if not spec.summation.custodian_decrypts:
        return
    home = root / CUSTODIAN_ID
    if not spec.aggregator_process:
        from fedsec.custodian.service import serve_directory

        await serve_directory(home, CUSTODIAN_ID, url, aggregator)
        return
    args = ["custodian", "serve", "--dir", str(home), "--id", CUSTODIAN_ID]
    args += ["--aggregator-url", url, "--aggregator-public-key", aggregator.hex()]
    async with _child(args, root / "custodian.log") as proc:
        code = await asyncio.to_thread(proc.wait)
    if code == 0:  # the federation finished
        return
    raise ConfigError(
        f"the simulation's key custodian exited with code {code}; see {root / 'custodian.log'}"
    )


async def _run_agents(
    spec: SimulationSpec,
    ws: Workspace,
    local: list[LocalAgent],
    aggregator_public: bytes,
    extra: dict[str, Any],
) -> float:
    """Serve ``ws`` and run this machine's members (``spec.local_members``), in this
    process or in member processes, until the federation finishes; return the wall time
    from the members' start.  With ``spec.dashboard_viewers``, that many live dashboards
    watch the run and ``extra`` receives what they cost the aggregator.

    Raises:
        ConfigError: a bad member range or process count, the aggregator or a member
            process failed.
        FedsecError: a member's fatal error (in this process).
    """
    here = parse_member_range(spec.local_members, spec.agents)
    processes = _member_processes(spec, here)
    extra["member_processes"] = processes
    async with _serving(ws, spec) as url:
        plan = MemberPlan(
            url=url,
            aggregator_public_key=aggregator_public.hex(),
            task=spec.task,
            members=spec.agents,
            partition=spec.partition,
            seed=spec.seed,
            dp_epsilon=spec.dp_epsilon,
            distributed_dp=spec.dp_mode == "distributed",
            slow_members=math.ceil(spec.slow_fraction * spec.agents),
            slowdown=spec.slowdown,
            unsafe_seed=spec.unsafe_seed,
        )
        # members elsewhere start from it (docs/simulation.md); it holds no secret
        plan_path = write_plan(plan, ws.root.parent)
        start = time.perf_counter()
        members = [(i, local[i]) for i in here]
        # the serving process's own pid (serve.json): its CPU and memory over the run
        serving = _serving_pid(ws) if spec.aggregator_process else None
        before = _process_usage(serving)
        viewers = [asyncio.create_task(_watch(url)) for _ in range(spec.dashboard_viewers)]
        custodian = asyncio.create_task(_custodian(spec, ws.root.parent, url, aggregator_public))
        try:
            if processes == 1:
                members_tally = await _members_in_process(spec, plan, members, extra)
            else:
                threads = max(1, usable_cores() // processes)
                ranges = split(here, processes)
                members_tally = await run_member_processes(plan_path, ranges, threads)
            rounded = members_tally.rounded
            extra["saturation_rate"] = members_tally.saturated / rounded if rounded else None
        finally:
            await cancel_and_wait(*viewers, custodian)
            if not custodian.cancelled():
                custodian.result()  # a custodian that failed says why
        wall = time.perf_counter() - start
        after = _process_usage(serving)
        if before is not None and after is not None:
            extra["aggregator_cpu_s"] = round(after[0] - before[0], 3)
            extra["aggregator_peak_rss_mb"] = round(after[1], 1)
        extra["connections_refused"] = _connections_refused(ws.root / "serve.log")
        extra.update(await _dashboard_cost(url))
        extra["wire_up"] = await _wire_up(url)
        return wall


def _member_processes(spec: SimulationSpec, here: range) -> int:
    """How many processes run this machine's members: ``spec.member_processes``, or by
    default one per MEMBERS_PER_PROCESS members on the cores the aggregator leaves (one
    where members are lost on purpose: ``--kill`` cancels their tasks in this process).

    Raises:
        ConfigError: a negative count, or several processes with ``kill_fraction``.
    """
    if spec.member_processes < 0:
        raise ConfigError(
            f"member processes must be 0 (automatic) or more, not {spec.member_processes}"
        )
    if spec.kill_fraction > 0 and spec.member_processes > 1:
        raise ConfigError(
            "losing members on purpose (--kill) cancels their tasks in this process: "
            "run them in one (--member-processes 1)"
        )
    chosen = spec.member_processes or (
        1 if spec.kill_fraction > 0 else default_member_processes(len(here), usable_cores())
    )
    return min(chosen, len(here))


async def _members_in_process(
    spec: SimulationSpec,
    plan: MemberPlan,
    members: list[tuple[int, LocalAgent]],
    extra: dict[str, Any],
) -> MemberTally:
    """Run ``members`` as tasks of this process until the federation finishes, losing
    ``spec.kill_fraction`` of them on purpose.

    Raises:
        FedsecError: the first member's fatal error.
    """
    # One training thread per core: the default pool (cores + 4 threads) made the 50
    # agents' event loop wait for the GIL behind up to six training threads.
    with concurrent.futures.ThreadPoolExecutor(usable_cores(), "fedsec-train") as trainers:
        runtimes = member_runtimes(plan, members, trainers)
        await asyncio.gather(*(asyncio.to_thread(rt.prepare) for rt in runtimes))
        with frozen_heap():
            tasks = [asyncio.create_task(rt.run()) for rt in runtimes]
            root = members[0][1].root.parent
            killer = asyncio.create_task(_kill_some(spec, root, plan.url, tasks, extra))
            try:
                return tally(await asyncio.gather(*tasks, return_exceptions=True))
            finally:
                await cancel_and_wait(killer)


def _serving_pid(ws: Workspace) -> int | None:
    """The pid a separate aggregator wrote to serve.json once it served (None: none)."""
    try:
        return int(json.loads((ws.root / "serve.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _process_usage(pid: int | None) -> tuple[float, float] | None:
    """CPU seconds (user + system) and peak RSS in MB of process ``pid``, from /proc;
    None where there is no such process or no /proc."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    # fields after the parenthesised command: utime and stime are the 12th and 13th
    fields = stat.rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    peak_kb = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0
    )
    return cpu_s, peak_kb / 1024.0


def _connections_refused(log_path: Path) -> int:
    """Connections the aggregator closed on accept (capacity or per-peer share), from its
    log: each logged refusal plus the ones its throttle counted as ``suppressed=N``."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    refused = 0
    for line in text.splitlines():
        if "event=connection_refused" in line:
            suppressed = re.search(r"suppressed=(\d+)", line)
            refused += 1 + (int(suppressed.group(1)) if suppressed else 0)
    return refused


async def _kill_some(
    spec: SimulationSpec,
    root: Path,
    url: str,
    tasks: list[asyncio.Task[Any]],
    extra: dict[str, Any],
) -> None:
    """Lose ``spec.kill_fraction`` of the members at random moments of round
    ``spec.kill_round`` (from its opening to about one round's time later)."""
    if spec.kill_fraction <= 0:
        return
    import secrets

    from fedsec.federation import load_observer

    observer = load_observer(root)
    rng = secrets.SystemRandom()
    victims = rng.sample(range(len(tasks)), math.ceil(spec.kill_fraction * len(tasks)))
    opened = None
    while opened is None:
        status = await asyncio.to_thread(federation_status, url, observer)
        if status is not None and status.round >= spec.kill_round:
            previous = [s.duration_s or 0.0 for s in status.history if s.stage == "closed"]
            opened = max(previous[-1:] or [1.0])
        else:
            await asyncio.sleep(0.05)
    start = time.monotonic()
    for victim, delay in sorted(((v, rng.uniform(0, opened)) for v in victims), key=lambda x: x[1]):
        await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
        tasks[victim].cancel()
    extra["killed"] = len(victims)
    extra["kill_round"] = spec.kill_round


async def _watch(url: str) -> int:
    """One open dashboard: read its live event stream (reconnecting, as a browser's
    EventSource does) until cancelled; return the snapshots received."""
    received = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                async with session.get(f"{url}/dashboard/api/events") as answer:
                    async for line in answer.content:
                        received += line.startswith(b"event: snapshot")
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.5)


async def _wire_up(url: str) -> dict[str, dict[str, float]]:
    """Requests, head bytes and body bytes sent to the aggregator over the whole run, by
    endpoint, from its own /metrics."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as answer:
        text = await answer.text()
    names = {
        "fedsec_http_requests": "requests",
        "fedsec_http_request_head_bytes": "head",
        "fedsec_http_request_bytes": "body",
    }
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = names.get(sample.name.removesuffix("_total"))
            if kind is not None and sample.name.endswith("_total"):
                row = totals.setdefault(
                    sample.labels["endpoint"], dict.fromkeys(names.values(), 0.0)
                )
                row[kind] += sample.value
    return totals


async def _dashboard_cost(url: str) -> dict[str, Any]:
    """What the open dashboards cost the aggregator, from its own /metrics."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as answer:
        text = await answer.text()
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("fedsec_dashboard_pushes", "fedsec_dashboard_push_seconds"):
            values[family.name] = sum(sample.value for sample in family.samples)
    return {
        "dashboard_pushes": int(values.get("fedsec_dashboard_pushes", 0)),
        "dashboard_push_s": round(values.get("fedsec_dashboard_push_seconds", 0.0), 4),
    }
