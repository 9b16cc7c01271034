"""``fedsec demo`` (a local federation in separate processes) and ``fedsec simulate``.

The demo is what a newcomer runs first: a real aggregator process and five real
agent processes on loopback, ten SecAgg+ rounds with DP on a non-IID split of a
bundled dataset; one agent crashes right after sharing its keys in round 4 (the
round still closes, its masks are removed through its neighbours' shares) and
comes back in round 7, catching up on the newest signed model.

``fedsec simulate`` runs the same components in one process for measurements:
a real aggregator on loopback HTTP and N agents as asyncio tasks, plus the same
model trained centrally for comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import msgspec

from fedsec import faults
from fedsec.bench.common import federation_status
from fedsec.cli_options import codec_options
from fedsec.config import AgentConfig
from fedsec.errors import ConfigError, FedsecError
from fedsec.federation import (
    LocalAgent,
    agent_config,
    create_federation,
    enrol_agents,
    federation_toml,
    load_observer,
    table_agent_config,
    write_agent_config,
)
from fedsec.protocol import wire
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.summation import MODES

# The demo must finish in 3 minutes on 2 cores; give up (non-zero) well after that.
DEMO_TIMEOUT_S = 240.0


def _wait_for_serve(info: Path, proc: subprocess.Popen[bytes], deadline: float) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"the aggregator exited with code {proc.returncode}; see its log")
        if info.exists():
            return str(json.loads(info.read_text())["url"])
        time.sleep(0.1)
    raise ConfigError("the aggregator did not start within its deadline")


def _linger(url: str, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """On a terminal, keep the aggregator serving its dashboard after the last round
    until Enter or Ctrl-C, so a newcomer can look; without one (CI, a pipe), go on."""
    if not sys.stdin.isatty():
        return
    for name, proc in procs.items():
        if name != "aggregator" and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    click.echo("")
    click.echo(f"the federation finished; the aggregator keeps serving {url}/dashboard")
    click.echo("press Enter (or Ctrl-C) to stop it")
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.readline()


def _row(s: wire.RoundSummary, agents: int) -> str:
    acc = f"{100 * s.accuracy:6.2f}%" if s.accuracy is not None else "    -  "
    eps = f"{s.epsilon_max:6.2f}" if s.epsilon_max is not None else "    - "
    per = max(s.participants, 1)
    state = "ok" if s.stage == "closed" else f"ABORTED: {s.detail}"
    dropped = ",".join(d.split("-")[-1] for d in s.dropped) or "-"
    return (
        f"{s.round:>5} {s.attempt:>3} {s.cohort:>6} {s.survivors:>9} {dropped:>7} {acc:>8} "
        f"{eps:>7} {s.bytes_up / per / 1024:>9.1f} {s.bytes_down / per / 1024:>9.1f} "
        f"{(s.duration_s or 0):>7.2f}  {state}"
    )


HEADER = "round try cohort survivors dropped accuracy eps_max  KiB_up/a KiB_dn/a  time_s  result"


def noise_for_demo(
    task: str, partition: str, agents: int, rounds: int, epsilon: float, training: dict[str, Any]
) -> float:
    """Noise multiplier with which the smallest member's budget lasts all rounds.

    Members with more records sample a smaller fraction per step and so spend less.
    """
    from fedsec.tasks import get_task, parse_partition

    data = get_task(task).load()
    parts = parse_partition(partition).apply(data.y_train, agents, 7)
    return noise_for_records(min(len(p) for p in parts), rounds, epsilon, training)


def noise_for_records(records: int, rounds: int, epsilon: float, training: dict[str, Any]) -> float:
    """Noise multiplier with which a member of ``records`` training records can pay for
    ``rounds`` rounds out of ``epsilon``."""
    from fedsec.agent.ledger import noise_for_budget
    from fedsec.learning.training import plan_round
    from fedsec.tasks import TrainingParams

    rate, steps = plan_round(records, TrainingParams(**training))
    return round(noise_for_budget(epsilon, DEFAULT_DELTA, rate, steps, rounds) * 1.02, 4)


def _hospital_config(
    agent: LocalAgent,
    index: int,
    exports: dict[str, Path],
    url: str,
    aggregator_public: bytes,
    epsilon: float,
) -> AgentConfig:
    """The i-th demo hospital: its own export, its own rules, the federation's schema."""
    from fedsec.data.example import RULES, SCHEMA, hospital_source

    hospital = sorted(exports)[index]
    return table_agent_config(
        agent,
        url=url,
        aggregator_public=aggregator_public,
        sources=[hospital_source(exports[hospital])],
        rules=RULES[hospital],
        schema=SCHEMA,
        epsilon=epsilon,
    )


@click.command()
@click.option(
    "--workspace",
    type=click.Path(path_type=Path),
    default=None,
    help="directory to create (default: a new temporary one, kept)",
)
@click.option("--agents", default=5, show_default=True)
@click.option("--rounds", default=10, show_default=True)
@click.option("--task", default="breast_cancer", show_default=True)
@click.option("--partition", default="dirichlet:0.5", show_default=True)
@click.option("--epsilon", default=8.0, show_default=True, help="each agent's privacy budget")
@click.option(
    "--crash/--no-crash",
    default=True,
    show_default=True,
    help="crash one agent after share keys in round 4, restart it in round 7",
)
@click.option(
    "--data",
    type=click.Choice(["bundled", "csv"]),
    default="bundled",
    show_default=True,
    help="csv: three hospitals' differing CSV exports, aligned by their column rules "
    "(docs/data.md); task table, 3 agents, no crash",
)
def demo(
    workspace: Path | None,
    agents: int,
    rounds: int,
    task: str,
    partition: str,
    epsilon: float,
    crash: bool,
    data: str,
) -> None:
    """Run a local federation: aggregator + agents as processes, SecAgg+ with DP."""
    root = workspace or Path(tempfile.mkdtemp(prefix="fedsec-demo-"))
    if workspace is not None and workspace.exists() and any(workspace.iterdir()):
        raise ConfigError(f"{workspace} exists and is not empty; choose a new directory")
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + DEMO_TIMEOUT_S
    training = {"local_epochs": 2, "batch_size": 16, "lr": 0.1}
    exports: dict[str, Path] = {}
    schema = None
    if data == "csv":
        from fedsec.data.example import EXPORT_ROWS, SCHEMA, write_hospital_exports

        # three members, all needed: SecAgg+ sums at least three, so none may crash
        task, agents, crash, schema = "table", 3, False, SCHEMA
        exports = write_hospital_exports(root / "exports")
        noise = noise_for_records(int(EXPORT_ROWS * 0.8), rounds, epsilon, training)
    else:
        noise = noise_for_demo(task, partition, agents, rounds, epsilon, training)
    text = federation_toml(
        "demo",
        task,
        round_={
            "min_agents": 3,
            "max_agents": agents,
            "rounds": rounds,
            "advertise_s": 4.0,
            "share_s": 5.0,
            "masked_s": 8.0,
            "unmask_s": 5.0,
            "open_s": 60.0,
            "max_weight_samples": 200,
        },
        training=training,
        dp={"enabled": True, "noise_multiplier": noise, "max_grad_norm": 1.0},
        server={"port": 0},
        schema=schema,
    )
    ws = create_federation(root, "demo", task, text)
    local = enrol_agents(ws, root, agents)
    aggregator_public = ws.signer.public_bytes
    ws.close()
    observer = load_observer(root)
    logs = root / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "fedsec"]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(name: str, args: list[str], extra: dict[str, str] | None = None) -> None:
        log = (logs / f"{name}.log").open("ab")
        procs[name] = subprocess.Popen(
            cmd + args, stdout=log, stderr=subprocess.STDOUT, env={**env, **(extra or {})}
        )

    click.echo(f"workspace: {root}")
    try:
        launch(
            "aggregator",
            ["aggregator", "serve", "--workspace", str(root / "aggregator"), "--port", "0"],
        )
        url = _wait_for_serve(root / "aggregator" / "serve.json", procs["aggregator"], deadline)
        click.echo(f"aggregator: {url} (log: {logs / 'aggregator.log'})")
        click.echo(f"dashboard: {url}/dashboard")
        click.echo(f"metrics: {url}/metrics")
        for i, a in enumerate(local):
            if exports:
                cfg = _hospital_config(a, i, exports, url, aggregator_public, epsilon)
            else:
                cfg = agent_config(
                    a,
                    url=url,
                    aggregator_public=aggregator_public,
                    task=task,
                    part_index=i,
                    parts=agents,
                    partition=partition,
                    seed=7,
                    epsilon=epsilon,
                )
            write_agent_config(a, cfg)
            fault = {faults.AGENT_ENV: "4:share_keys"} if crash and i == agents - 1 else None
            launch(a.agent_id, ["agent", "run", "--config", str(a.config_path)], fault)
        click.echo(
            f"agents: {', '.join(a.agent_id for a in local)}"
            + (f" ({local[-1].agent_id} will crash after share keys in round 4)" if crash else "")
        )
        click.echo("")
        click.echo(HEADER)
        shown: set[tuple[int, int]] = set()
        restarted = not crash
        status = None
        while time.monotonic() < deadline:
            status = federation_status(url, observer)
            if status is not None:
                for s in status.history:
                    if (s.round, s.attempt) not in shown:
                        shown.add((s.round, s.attempt))
                        click.echo(_row(s, agents))
                if not restarted and status.round >= 7:
                    last = local[-1]
                    launch(last.agent_id, ["agent", "run", "--config", str(last.config_path)])
                    click.echo(f"      ({last.agent_id} restarted: it rejoins and catches up)")
                    restarted = True
                if status.finished:
                    break
            if procs["aggregator"].poll() is not None:
                raise ConfigError("the aggregator exited unexpectedly; see its log")
            agents_alive = [n for n, p in procs.items() if n != "aggregator" and p.poll() is None]
            if not agents_alive and (status is None or not status.finished):
                raise ConfigError(
                    f"every agent exited before the federation finished; logs in {logs}"
                )
            time.sleep(0.3)
        else:
            raise ConfigError(
                f"the demo did not finish within {DEMO_TIMEOUT_S:.0f} s; logs in {logs}"
            )
        _linger(url, procs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert status is not None
    closed = [s for s in status.history if s.stage == "closed"]
    final = closed[-1] if closed else None
    click.echo("")
    click.echo(
        f"{len(closed)} rounds closed in {time.monotonic() - start:.1f} s; "
        f"model version {status.model_version}"
        + (f", held-out accuracy {100 * final.accuracy:.2f}%" if final and final.accuracy else "")
    )
    click.echo(f"state:  {root / 'aggregator' / 'state.db'}")
    click.echo(
        f"models: {root / 'aggregator' / 'models'} "
        f"(signed manifests in {root / 'aggregator' / 'manifests'})"
    )
    click.echo(f"agents: {root}/agent-*/ (identity, privacy ledger, receipts, vault)")
    click.echo(f"status: {root / 'operator'} (the observer key that signs GET /v1/status)")
    click.echo(f"logs:   {logs}")
    click.echo(f"audit:  fedsec audit verify --workspace {root}   (and: fedsec audit report)")


# -- simulate ------------------------------------------------------------------------------------


def _parse_dp(value: str) -> float | None:
    if value == "none":
        return None
    try:
        eps = float(value)
    except ValueError:
        raise click.BadParameter("--dp-epsilon takes a number or 'none'") from None
    if not (math.isfinite(eps) and eps > 0):
        raise click.BadParameter("--dp-epsilon must be positive")
    return eps


@click.command()
@click.option("--task", default="mnist1d", show_default=True)
@click.option("--agents", default=50, show_default=True)
@click.option("--rounds", default=20, show_default=True)
@click.option("--partition", default="iid", show_default=True)
@click.option(
    "--secure-sum",
    type=click.Choice(list(MODES)),
    default="secagg",
    show_default=True,
)
@click.option("--quant-bits", default=0, help="bits b; 0 = 8, or 16 with --dp-mode distributed")
@click.option("--clip", default=0.0, help="update clip norm; 0 = a task default")
@click.option("--dp-epsilon", default="none", show_default=True, help="per-agent budget or 'none'")
@click.option(
    "--dp-mode",
    type=click.Choice(["local", "distributed"]),
    default="local",
    show_default=True,
    help="distributed: noise shares summed in the SecAgg+ ring (docs/privacy.md)",
)
@click.option("--dp-unit", type=click.Choice(["record", "member"]), default="record")
@click.option(
    "--dp-sample-rate", default=0.0, help="distributed, record: q; 0 = 1,000 records per round"
)
@click.option(
    "--dp-min-survivors",
    default=0.8,
    show_default=True,
    help="distributed: share of the cohort the noise is sized for",
)
@codec_options
@click.option("--error-feedback", is_flag=True, help="carry what the codec drops to next round")
@click.option("--local-epochs", default=0, help="0 = task default for simulation")
@click.option("--lr", default=0.0, help="0 = task default")
@click.option(
    "--batch-size", default=0, help="local batch size; 0 = task default (DP favours large batches)"
)
@click.option(
    "--server-optimizer",
    type=click.Choice(["", "fedavg", "fedadam"]),
    default="",
    help="default: fedadam in record-level distributed DP, else fedavg",
)
@click.option(
    "--server-lr",
    default=0.0,
    help="0 = task default for FedAvg; FedAdam: 0.03 in record-level distributed DP, else 0.01",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--kill",
    "kill_fraction",
    default=0.0,
    show_default=True,
    help="fraction of members lost for good at random moments of round --kill-round",
)
@click.option("--kill-round", default=2, show_default=True)
@click.option(
    "--hide-model",
    is_flag=True,
    help="--secure-sum he: keep the model hidden from the aggregator "
    "(he.model_visible_to_aggregator = false)",
)
@click.option(
    "--topology",
    type=click.Choice(["aggregator", "gossip"]),
    default="aggregator",
    show_default=True,
    help="gossip: real peers on loopback with no aggregator (docs/decentralised.md); "
    "it reads --task, --agents, --rounds, --partition, --local-epochs, --seed and --degree",
)
@click.option("--degree", default=4, show_default=True, help="gossip: neighbours per peer")
@click.option(
    "--baseline/--no-baseline",
    default=True,
    show_default=True,
    help="also train the task centrally on the pooled records, for comparison",
)
@click.option(
    "--member-processes",
    default=0,
    show_default=True,
    help="processes the members run in; 0 = one per 100 members, at most cores - 1 "
    "(docs/simulation.md)",
)
@click.option(
    "--member-range",
    default="",
    help="A:B: only members A to B-1 (from 0) run here; the others run elsewhere with "
    "--members-only (default: all)",
)
@click.option(
    "--members-only",
    "plan",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="run members --member-range of the simulation whose plan (members.json) this "
    "is, beside their homes; reads no other option but --training-threads",
)
@click.option("--training-threads", default=0, help="--members-only: 0 = one per core")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="keep the federation (workspace, members' homes, plan) in this new directory",
)
@click.option(
    "--listen",
    default="127.0.0.1",
    show_default=True,
    help="the aggregator's address: one the machines running members reach",
)
@click.option("--port", default=0, help="the aggregator's port; 0 = a free one")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def simulate(
    task: str,
    agents: int,
    rounds: int,
    partition: str,
    secure_sum: str,
    quant_bits: int,
    clip: float,
    dp_epsilon: str,
    dp_mode: str,
    dp_unit: str,
    dp_sample_rate: float,
    dp_min_survivors: float,
    rotation: str,
    sparsity: float,
    range_stddevs: float,
    headroom_bits: int,
    error_feedback: bool,
    local_epochs: int,
    lr: float,
    batch_size: int,
    server_optimizer: str,
    server_lr: float,
    seed: int,
    kill_fraction: float,
    kill_round: int,
    hide_model: bool,
    topology: str,
    degree: int,
    baseline: bool,
    member_processes: int,
    member_range: str,
    plan: Path | None,
    training_threads: int,
    workdir: Path | None,
    listen: str,
    port: int,
    as_json: bool,
) -> None:
    """Federated vs centralized training of a bundled task, over loopback HTTP."""
    if plan is not None:
        _simulate_members_only(plan, member_range, training_threads)
        return
    if topology == "gossip":
        _simulate_gossip(task, agents, rounds, degree, partition, local_epochs, seed, as_json)
        return
    from fedsec.simulation import SimulationSpec, run_simulation

    try:
        result = asyncio.run(
            run_simulation(
                SimulationSpec(
                    task=task,
                    agents=agents,
                    rounds=rounds,
                    partition=partition,
                    secure_sum=secure_sum,
                    quant_bits=quant_bits,
                    clip=clip,
                    dp_epsilon=_parse_dp(dp_epsilon),
                    dp_mode=dp_mode,
                    dp_unit=dp_unit,
                    dp_sample_rate=dp_sample_rate,
                    dp_min_survivors=dp_min_survivors,
                    rotation=rotation,
                    sparsity=sparsity,
                    range_stddevs=range_stddevs,
                    headroom_bits=headroom_bits,
                    error_feedback=error_feedback,
                    local_epochs=local_epochs,
                    lr=lr,
                    batch_size=batch_size,
                    server_optimizer=server_optimizer,
                    server_lr=server_lr,
                    seed=seed,
                    kill_fraction=kill_fraction,
                    kill_round=kill_round,
                    hide_model=hide_model,
                    baseline=baseline,
                    member_processes=member_processes,
                    local_members=member_range,
                    listen=listen,
                    port=port,
                ),
                workdir,
            )
        )
    except FedsecError as exc:
        raise click.ClickException(str(exc)) from None
    except asyncio.CancelledError:
        raise click.ClickException(
            "simulation stopped (SIGTERM); its aggregator was stopped too"
        ) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        for key, value in result.items():
            click.echo(f"{key:>32}: {value}")


def _simulate_members_only(plan: Path, member_range: str, training_threads: int) -> None:
    """Run members of a simulation served elsewhere; print their tally as one JSON line."""
    from fedsec.simulation import run_members_only

    try:
        tally = asyncio.run(run_members_only(plan, member_range, training_threads))
    except FedsecError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(msgspec.json.encode(tally).decode())


def _simulate_gossip(
    task: str,
    agents: int,
    rounds: int,
    degree: int,
    partition: str,
    local_epochs: int,
    seed: int,
    as_json: bool,
) -> None:
    from fedsec.errors import FedsecError
    from fedsec.peer.simulation import GossipSimulation, run_gossip_simulation

    spec = GossipSimulation(task, agents, rounds, degree, partition, local_epochs, seed)
    try:
        result = asyncio.run(run_gossip_simulation(spec))
    except FedsecError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        for key, value in result.items():
            click.echo(f"{key:>32}: {value}")
