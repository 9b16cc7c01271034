"""Chaos harness: a real federation in processes, with the aggregator and agents killed.

One aggregator process and N agent processes on loopback (as ``fedsec demo`` runs
them), breast_cancer, IID split, DP-SGD on (noise 1.5, budget epsilon 100 so nobody
runs out), short deadlines (or, where the aggregator is killed, stage deadlines that
outlast a restart; stages close as soon as everyone answered, so they cost nothing
when nobody dies).  Agents run with
``FEDSEC_UNSAFE_DETERMINISTIC_SEED`` so two runs of the same federation produce
bit-identical models, which makes "the right aggregate" checkable by hash against
an uninterrupted reference run.

Faults (see :mod:`fedsec.faults`):

- ``aggregator_crashes``: one crash point per aggregator incarnation, in order
  (``"ROUND:STAGE"``, ``"ROUND:STAGE:N"`` or ``"ROUND:model_write"``).  When the
  aggregator dies of SIGKILL it is restarted at once, on the same port (agents keep
  their URL), with the next point, or none once the list is spent.
- ``agent_crashes``: agent number (1-based) -> ``"ROUND:STAGE"``; that agent kills
  itself after completing the stage and is not restarted.

Everything waits on conditions with deadlines (``GET /v1/status`` polled, signed by
the federation's observer, and process exit codes); nothing sleeps to synchronise.
Every process is terminated (then killed) on the way out, whatever happens.

``fedsec bench chaos`` (:func:`bench_chaos`) runs the aggregator-kill scenario and a
reference run and prints one JSON object (:func:`run_chaos`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import msgspec

from fedsec import faults
from fedsec.bench.common import federation_status, free_port
from fedsec.config import NetworkSection
from fedsec.errors import ConfigError
from fedsec.protocol import wire
from fedsec.protocol.stages import SECAGG_STAGES

TASK = "breast_cancer"
PARTITION = "iid"
DATA_SEED = 7
#: One aggregator crash per stage, in the order a round goes through them (masked_input
#: after its second accepted message, and after the model file is written).
_POINTS = [f"{s}:2" if s == "masked_input" else s for s in SECAGG_STAGES]
STAGE_POINTS = (*_POINTS, "model_write")
#: Agent crash points: right after each stage in which it sends before the unmask.
AGENT_STAGES = SECAGG_STAGES[:-1]
#: Stage deadlines.  "restart" deadlines outlast an aggregator restart (the clock keeps
#: running while it is down; a stage whose deadline passed would close without the
#: members that could not reach it); since stages close as soon as everyone answered,
#: they cost nothing when nobody dies.  "short" ones keep rounds with a dead agent quick.
RESTART_DEADLINES: Mapping[str, float] = {
    "open_s": 60.0,
    "advertise_s": 30.0,
    "share_s": 30.0,
    "masked_s": 30.0,
    "unmask_s": 30.0,
}
SHORT_DEADLINES: Mapping[str, float] = {
    "open_s": 60.0,
    "advertise_s": 2.0,
    "share_s": 4.0,
    "masked_s": 5.0,
    "unmask_s": 4.0,
}
#: Agents must outlast an aggregator restart (a Python + torch start and a resume on a
#: busy 2-core machine, longer than 25 s under the test suite): at least
#: 120 * 0.5 / 2 = 30 s of retries before an agent gives up.
AGENT_NETWORK = NetworkSection(
    retry_max=120, backoff_initial_s=0.1, backoff_max_s=0.5, timeout_s=20.0
)
STATUS_POLL_S = 0.1
_CREATE_LOCK = threading.Lock()
_FAULT_RE = re.compile(r"event=fault_injected crash_at=(\S+)")


def aggregator_schedule(rounds: int, points: Sequence[str] = STAGE_POINTS) -> list[str]:
    """One crash per point, point i in round i + 1 (the last round takes the rest, which
    still happen in order since the points follow a round's stages)."""
    return [f"{min(i + 1, rounds)}:{p}" for i, p in enumerate(points)]


def agent_schedule(agents: int, rounds: int, kills: int, seed: int) -> dict[int, str]:
    """``kills`` distinct agents, each with a seeded random round and stage to die at."""
    rng = random.Random(seed)
    chosen = rng.sample(range(1, agents + 1), kills)
    return {a: f"{rng.randint(1, rounds)}:{rng.choice(AGENT_STAGES)}" for a in sorted(chosen)}


@dataclass(frozen=True)
class ChaosPlan:
    agents: int = 6
    rounds: int = 5
    aggregator_crashes: tuple[str, ...] = ()
    agent_crashes: Mapping[int, str] = field(default_factory=dict)
    deadlines: Mapping[str, float] = field(default_factory=lambda: dict(RESTART_DEADLINES))
    seed: str = "fedsec-chaos"
    noise_multiplier: float = 1.5
    epsilon: float = 100.0
    timeout_s: float = 150.0
    federation_id: str = "chaos"
    dp: bool = True  # DP-SGD with noise_multiplier, or no DP at all
    storage_url: str = ""  # [storage] url: a PostgreSQL database replicas share
    # more [round] keys (secure_sum, mode, buffer_size, ...) and the [he] section
    round_settings: Mapping[str, Any] = field(default_factory=dict)
    he: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ChaosRun:
    """What one federation run did (read from the processes, logs and workspace)."""

    root: Path
    workspace: Path
    logs: Path
    kills: int = 0
    crashes_hit: list[str] = field(default_factory=list)  # aggregator fault_injected lines
    agent_crashes_hit: dict[str, str] = field(default_factory=dict)
    agent_exit: dict[str, int | None] = field(default_factory=dict)
    history: list[wire.RoundSummary] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    final_version: int = 0
    final_sha256: str = ""
    wall_s: float = 0.0

    @property
    def closed(self) -> list[wire.RoundSummary]:
        return [s for s in self.history if s.stage == "closed"]

    @property
    def aborted(self) -> list[wire.RoundSummary]:
        return [s for s in self.history if s.stage == "aborted"]


def _progress_key(s: wire.FederationStatus) -> tuple[int, int, str, int]:
    return (s.round, s.attempt, s.stage, s.rounds_completed)


def _federation_text(plan: ChaosPlan) -> str:
    from fedsec.federation import federation_toml

    text = federation_toml(
        plan.federation_id,
        TASK,
        round_={
            "min_agents": 3,
            "max_agents": plan.agents,
            "rounds": plan.rounds,
            "max_weight_samples": 200,
            **plan.deadlines,
            **plan.round_settings,
        },
        training={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        dp={"enabled": plan.dp, "noise_multiplier": plan.noise_multiplier, "max_grad_norm": 1.0},
        server={"port": 0},
        he=dict(plan.he),
    )
    if plan.storage_url:  # the rendered [storage] section holds url = "" once
        text = text.replace('\nurl = ""\n', f"\nurl = {json.dumps(plan.storage_url)}\n", 1)
    return text


class _Federation:
    """The processes of one run; :meth:`close` ends every one of them."""

    def __init__(self, plan: ChaosPlan, root: Path) -> None:
        self.plan = plan
        self.root = root
        self.logs = root / "logs"
        self.workspace = root / "aggregator"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.agent_crash: dict[str, str] = {}
        base = {k: v for k, v in os.environ.items() if not k.startswith("FEDSEC_")}
        # One thread per process: N agents share the machine's few cores.
        self.env = {**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.cmd = [sys.executable, "-m", "fedsec"]

    def create(self) -> None:
        with _CREATE_LOCK:  # building the initial model seeds torch's global RNG
            self._create()

    def _create(self) -> None:
        from fedsec.federation import (
            agent_config,
            create_federation,
            enrol_agents,
            load_observer,
            write_agent_config,
        )

        self.logs.mkdir(parents=True)
        ws = create_federation(
            self.root, self.plan.federation_id, TASK, _federation_text(self.plan)
        )
        try:
            local = enrol_agents(ws, self.root, self.plan.agents)
            public = ws.signer.public_bytes
        finally:
            ws.close()
        for i, a in enumerate(local):
            cfg = agent_config(
                a,
                url=self.url,
                aggregator_public=public,
                task=TASK,
                part_index=i,
                parts=self.plan.agents,
                partition=PARTITION,
                seed=DATA_SEED,
                epsilon=self.plan.epsilon,
                device="cpu",
            )
            write_agent_config(a, msgspec.structs.replace(cfg, network=AGENT_NETWORK))
        self.local = local
        self.observer = load_observer(self.root)

    def _spawn(self, name: str, args: list[str], extra: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as log:
            return subprocess.Popen(
                self.cmd + args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **extra},
                start_new_session=True,
            )

    def start_aggregator(self, crash_at: str | None) -> None:
        self.incarnation += 1
        (self.workspace / "serve.json").unlink(missing_ok=True)
        extra = {faults.AGGREGATOR_ENV: crash_at} if crash_at else {}
        self.aggregator = self._spawn(
            f"aggregator-{self.incarnation}",
            [
                "aggregator",
                "serve",
                "--workspace",
                str(self.workspace),
                "--port",
                str(self.port),
            ],
            extra,
        )

    def aggregator_log(self, incarnation: int) -> str:
        path = self.logs / f"aggregator-{incarnation}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def status(self) -> wire.FederationStatus | None:
        """Signed ``GET /v1/status``; None while the aggregator does not answer.

        Raises:
            AuthError: it answered but refused the observer (it serves another roster).
        """
        return federation_status(self.url, self.observer)

    def wait_serving(self, deadline: float) -> wire.FederationStatus:
        assert self.aggregator is not None
        while time.monotonic() < deadline:
            status = self.status()
            if status is not None:
                return status
            if self.aggregator.poll() is not None:
                raise ConfigError(
                    f"aggregator incarnation {self.incarnation} exited with code "
                    f"{self.aggregator.returncode} before serving; see {self.logs}"
                )
            time.sleep(STATUS_POLL_S)
        raise ConfigError(f"the aggregator did not serve {self.url} in time; see {self.logs}")

    def start_agents(self) -> None:
        for n, a in enumerate(self.local, start=1):
            extra = {faults.SEED_ENV: self.plan.seed}
            crash = self.plan.agent_crashes.get(n)
            if crash:
                extra[faults.AGENT_ENV] = crash
                self.agent_crash[a.agent_id] = crash
            self.agents[a.agent_id] = self._spawn(
                a.agent_id, ["agent", "run", "--config", str(a.config_path)], extra
            )

    def close(self) -> None:
        procs = [*self.agents.values(), *([self.aggregator] if self.aggregator else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def run_federation(plan: ChaosPlan, root: Path) -> ChaosRun:
    """Run one federation under ``plan`` in ``root`` (a new directory) until it finishes.

    Raises:
        ConfigError: the aggregator died other than by an injected crash, every agent
            exited early, or the run passed ``plan.timeout_s``.
    """
    start = time.monotonic()
    deadline = start + plan.timeout_s
    fed = _Federation(plan, root)
    run = ChaosRun(root=root, workspace=fed.workspace, logs=fed.logs)
    fed.create()
    schedule = list(plan.aggregator_crashes)
    try:
        fed.start_aggregator(schedule.pop(0) if schedule else None)
        fed.wait_serving(deadline)
        fed.start_agents()
        restarted_at: float | None = None
        resumed_from: tuple[int, int, str, int] | None = None
        last: wire.FederationStatus | None = None
        while True:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the federation did not finish within {plan.timeout_s:.0f} s "
                    f"(last status: {last and _progress_key(last)}); logs in {fed.logs}"
                )
            agg = fed.aggregator
            assert agg is not None
            code = agg.poll()
            if code is not None:
                if code != -signal.SIGKILL:
                    raise ConfigError(
                        f"aggregator incarnation {fed.incarnation} exited with code {code}; "
                        f"see {fed.logs}"
                    )
                run.kills += 1
                hits = _FAULT_RE.findall(fed.aggregator_log(fed.incarnation))
                run.crashes_hit.extend(hits)
                # Where the dead one left the state store: what the next one resumes from.
                resumed_from = _stored_position(fed.workspace)
                fed.start_aggregator(schedule.pop(0) if schedule else None)
                restarted_at = time.monotonic()
                continue
            status = fed.status()
            if status is not None:
                last = status
                if restarted_at is not None and _progress_key(status) != resumed_from:
                    run.recovery_s.append(time.monotonic() - restarted_at)
                    restarted_at = None
                if status.finished:
                    break
            if all(p.poll() is not None for p in fed.agents.values()) and not (
                status and status.finished
            ):
                raise ConfigError(f"every agent exited before the federation finished; {fed.logs}")
            time.sleep(STATUS_POLL_S)
        assert last is not None
        run.history = list(last.history)
        # Agents notice the end on their next poll and exit by themselves.
        for name, proc in fed.agents.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, min(20.0, deadline - time.monotonic())))
            run.agent_exit[name] = proc.poll()
    finally:
        fed.close()
    run.wall_s = time.monotonic() - start
    for name in fed.agent_crash:
        text = (fed.logs / f"{name}.log").read_text(errors="replace")
        hits = _FAULT_RE.findall(text)
        if hits:
            run.agent_crashes_hit[name] = hits[-1]
    from fedsec.aggregator.workspace import Workspace

    ws = Workspace.open(fed.workspace)
    try:
        latest = ws.models.latest()
        run.final_version, run.final_sha256 = latest.version, latest.sha256
    finally:
        ws.close()
    return run


def run_concurrently(runs: Sequence[tuple[ChaosPlan, Path]]) -> list[ChaosRun]:
    """Several independent federations at once (each on its own port and directory):
    most of a run's wall time is one process waiting for another, so two overlap well."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(run_federation, plan, root) for plan, root in runs]
        return [f.result() for f in futures]


def _stored_position(workspace: Path) -> tuple[int, int, str, int] | None:
    """(round, attempt, stage, rounds closed) as the state store holds them: what a
    restarted aggregator resumes from, in the terms of ``GET /v1/status``."""
    from fedsec.aggregator.workspace import Workspace

    ws = Workspace.open(workspace)
    try:
        rows = ws.state.rounds.history(100000)
        closed = sum(1 for r in rows if r.stage == "closed")
        row = ws.state.rounds.latest()
        if row is None:
            return None
        if row.stage in ("closed", "aborted"):
            return None  # the next incarnation opens a new attempt: already progress
        return (row.round, row.attempt, row.stage, closed)
    finally:
        ws.close()


def audit_verify(workspace: Path) -> subprocess.CompletedProcess[str]:
    """``fedsec audit verify --workspace`` in a subprocess (as an auditor runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "fedsec", "audit", "verify", "--workspace", str(workspace)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def run_chaos(
    agents: int = 6,
    rounds: int = 5,
    points: Sequence[str] = STAGE_POINTS,
    workdir: Path | None = None,
    timeout_s: float = 150.0,
) -> dict[str, Any]:
    """Aggregator killed once per stage and restarted, against an uninterrupted run.

    The two runs go one after the other, so ``wall_s`` and ``reference_wall_s`` compare.
    ``recovery_s``: for each restart, seconds from starting the new aggregator process
    to the first change of (round, attempt, stage, rounds closed) past what the dead
    one left in the state store, i.e. a stage moved on or the round closed.

    Returns the ``bench chaos`` JSON object; raises ConfigError if a run does not finish.
    """
    root = workdir or Path(tempfile.mkdtemp(prefix="fedsec-chaos-"))
    schedule = tuple(aggregator_schedule(rounds, points))
    reference = run_federation(
        ChaosPlan(agents=agents, rounds=rounds, timeout_s=timeout_s), root / "reference"
    )
    crashed = run_federation(
        ChaosPlan(agents=agents, rounds=rounds, aggregator_crashes=schedule, timeout_s=timeout_s),
        root / "crashed",
    )
    verified = audit_verify(crashed.workspace)
    recovery = crashed.recovery_s
    return {
        "bench": "chaos",
        "agents": agents,
        "kills": crashed.kills,
        "crash_points": list(schedule),
        "crash_points_hit": crashed.crashes_hit,
        "rounds": len(crashed.closed),
        "rounds_lost": len(crashed.aborted) + max(0, rounds - len(crashed.closed)),
        "hash_match": bool(crashed.final_sha256) and crashed.final_sha256 == reference.final_sha256,
        "final_sha256": crashed.final_sha256,
        "audit_ok": verified.returncode == 0,
        "recovery_s": {
            "median": round(statistics.median(recovery), 3) if recovery else None,
            "max": round(max(recovery), 3) if recovery else None,
        },
        "wall_s": round(crashed.wall_s, 2),
        "reference_wall_s": round(reference.wall_s, 2),
        "workdir": str(root),
    }


@click.command("chaos")
@click.option("--agents", default=6, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=None, help="default: a temp dir"
)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_chaos(agents: int, rounds: int, workdir: Path | None, as_json: bool) -> None:
    """Kill the aggregator at every stage in turn; compare with an uninterrupted run."""
    if workdir is not None and workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"{workdir} exists and is not empty; choose a new directory")
    click.echo(json.dumps(run_chaos(agents, rounds, workdir=workdir)))
