"""``fedsec agent``: set up a data owner's agent, run it, and show its privacy spending.

User errors (any :class:`~fedsec.errors.FedsecError`) print one sentence on stderr
and exit 1, without a traceback, whether this group runs under ``fedsec`` or alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from fedsec.config import (
    AgentConfig,
    AgentSection,
    DataSection,
    PrivacySection,
    dump_agent_config,
    load_agent_config,
    parse_agent_config,
    render_toml,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError, FedsecError
from fedsec.faults import Faults
from fedsec.keys import load_identity, save_identity, save_public_key

if TYPE_CHECKING:
    from fedsec.learning.worker_status import WorkersStatus

__all__ = ["agent"]

CONFIG_FILE = "agent.toml"
PUBLIC_KEY_FILE = "identity.pub"

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FedsecError as exc:
            click.echo(f"error: {exc.detail}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


class _KeyValueFormatter(logging.Formatter):
    """``time level logger event key=value ...``: the runtime's messages are already k=v."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s level=%(levelname)s logger=%(name)s event=%(message)s")


def _configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    root = logging.getLogger("fedsec")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


@click.group()
def agent() -> None:
    """Data owner's agent: trains locally under DP and contributes securely."""


@agent.command("init")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="directory for the key, agent.toml and the agent's state",
)
@click.option("--agent-id", required=True, help="this member's id, as the admin enrols it")
@click.option("--aggregator-url", required=True, help="https://host:port of the aggregator")
@click.option(
    "--aggregator-public-key", required=True, help="aggregator's Ed25519 key, 64 hex digits"
)
@click.option("--task", default="breast_cancer", show_default=True, help="bundled task name")
@click.option("--dataset-id", default="", help="ledger name of this dataset (default: derived)")
@click.option("--partition", default="iid", show_default=True, help="iid or dirichlet:ALPHA")
@click.option("--part-index", default=0, show_default=True, help="this member's part (0-based)")
@click.option("--parts", default=1, show_default=True, help="parts the bundled data is split in")
@click.option(
    "--epsilon",
    default=PrivacySection().epsilon,
    show_default=True,
    help="total privacy budget on this dataset",
)
@click.option(
    "--delta", default=PrivacySection().delta, show_default=True, help="DP delta of the budget"
)
@click.option(
    "--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N for training"
)
@_user_errors
def init_command(
    directory: Path,
    agent_id: str,
    aggregator_url: str,
    aggregator_public_key: str,
    task: str,
    dataset_id: str,
    partition: str,
    part_index: int,
    parts: int,
    epsilon: float,
    delta: float,
    device: str,
) -> None:
    """Create an identity key and agent.toml in DIR; print the public key to enrol."""
    config_path = directory / CONFIG_FILE
    key_path = directory / "identity.key"
    public_path = directory / PUBLIC_KEY_FILE
    for path in (config_path, key_path):
        if path.exists():
            raise ConfigError(f"{path} already exists; refusing to overwrite it")
    cfg = AgentConfig(
        agent=AgentSection(
            id=agent_id,
            aggregator_url=aggregator_url,
            aggregator_public_key=aggregator_public_key.lower(),
            state_dir=".",
            device=device,
        ),
        data=DataSection(
            task=task,
            dataset_id=dataset_id,
            partition=partition,
            part_index=part_index,
            parts=parts,
        ),
        privacy=PrivacySection(epsilon=epsilon, delta=delta),
    )
    # Validate exactly as `agent run` will read it, before anything is written.
    parse_agent_config(render_toml(cfg, f"fedsec agent {agent_id}"), str(config_path))
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    identity = SigningIdentity.generate()
    save_identity(identity, key_path)
    save_public_key(public_path, identity.public_bytes)
    dump_agent_config(cfg, config_path)
    click.echo(f"agent {agent_id} initialised in {directory}")
    click.echo(f"config:     {config_path}")
    click.echo(f"secret key: {key_path} (mode 0600; never share it)")
    click.echo(f"public key: {identity.public_bytes.hex()}")
    click.echo(f"key id:     {identity.key_id}")
    click.echo(f"hand {public_path} (or the public key above) to the consortium admin to enrol")


@agent.command("run")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="the agent's agent.toml",
)
@click.option("--rounds", type=int, default=None, help="stop after this many closed rounds")
@click.option("--verbose", is_flag=True, help="debug logging")
@_user_errors
def run_command(config_path: Path, rounds: int | None, verbose: bool) -> None:
    """Take part in the federation until it finishes (or --rounds are done)."""
    from fedsec.agent.runtime import IDENTITY_FILE, AgentRuntime

    _configure_logging(verbose)
    cfg = load_agent_config(config_path)
    if cfg.training.node_rank != 0:
        # refused before any round is charged: rank 0, which the agent reads, is node 0's
        raise ConfigError(
            f"training.node_rank = {cfg.training.node_rank}: this is not the agent's node; "
            "run fedsec agent train-node here, and fedsec agent run on node 0"
        )
    identity = load_identity(Path(cfg.agent.state_dir) / IDENTITY_FILE)
    # chaos tests and the demo hand a child agent its faults through the environment
    faults = Faults.from_environment("agent")
    runtime = AgentRuntime(cfg, identity, progress=sys.stderr.isatty(), faults=faults)

    async def main() -> list[Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return list(await runtime.run(max_rounds=rounds, stop=stop))
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    outcomes = asyncio.run(main())
    closed = sum(1 for o in outcomes if o.status == "closed")
    spent = runtime.ledger.spent(runtime.dataset_id)
    click.echo(
        f"agent {cfg.agent.id}: {closed} round(s) contributed of {len(outcomes)} in the cohort; "
        f"epsilon spent on '{runtime.dataset_id}': {spent:.3f} of {cfg.privacy.epsilon:g}"
    )
    for o in outcomes:
        if o.status == "refused":
            click.echo(f"round {o.round} (attempt {o.attempt}): update refused: {o.detail}")


@agent.command("train-node")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="this node's agent.toml: the agent's, with its own [training] node_rank",
)
@click.option("--verbose", is_flag=True, help="debug logging")
@_user_errors
def train_node_command(config_path: Path, verbose: bool) -> None:
    """On another node of the member's cluster: join each round's training job the agent
    starts (state_dir on shared storage), until interrupted."""
    from fedsec.learning.worker_nodes import follow_jobs

    _configure_logging(verbose)
    cfg = load_agent_config(config_path)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopping.append(number))
    joined = follow_jobs(Path(cfg.agent.state_dir), cfg.training.settings, lambda: bool(stopping))
    click.echo(f"node {cfg.training.node_rank}: joined {joined} training job(s)")


@agent.command("inventory")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="the agent's agent.toml",
)
@click.option("--json", "as_json", is_flag=True, help="print the data map as JSON")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="also write the data map as an HTML page to this file",
)
@click.option("--label", default="", help="the label column, before [data.schema] names it")
@_user_errors
def inventory_command(config_path: Path, as_json: bool, html_path: Path | None, label: str) -> None:
    """The data map: per source and column what it holds, what is sensitive, what trains."""
    import json

    from fedsec.agent.inventory import member_data_map
    from fedsec.data.inventory import render_html, render_text
    from fedsec.fsio import atomic_write

    data_map = member_data_map(load_agent_config(config_path), label)
    if html_path is not None:
        atomic_write(html_path, render_html(data_map).encode(), mode=0o600)
    if as_json:
        click.echo(json.dumps(data_map, indent=2))
    else:
        click.echo(render_text(data_map), nl=False)


@agent.command("status")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="the agent's agent.toml",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of text")
@_user_errors
def status_command(config_path: Path, as_json: bool) -> None:
    """Privacy spent per dataset, receipts held, and the last training workers job."""
    import json

    from fedsec.agent.ledger import PrivacyLedger
    from fedsec.agent.vault import Vault
    from fedsec.learning.worker_status import read_status

    cfg = load_agent_config(config_path)
    state_dir = Path(cfg.agent.state_dir)
    ledger = PrivacyLedger(state_dir)
    datasets = {
        dataset_id: {
            "epsilon_spent": ledger.spent(dataset_id),
            "epsilon_budget": ledger.budget(dataset_id).epsilon,
            "delta": ledger.budget(dataset_id).delta,
            "rounds": len(ledger.history(dataset_id)),
        }
        for dataset_id in ledger.datasets()
    }
    receipts = Vault(state_dir).receipts()
    workers = read_status(state_dir)
    if as_json:
        status = {
            "agent": cfg.agent.id,
            "state_dir": str(state_dir),
            "datasets": datasets,
            "receipts": len(receipts),
            "last_receipt_round": receipts[-1].round if receipts else None,
            "training_workers": None if workers is None else workers.to_json(),
        }
        click.echo(json.dumps(status, indent=2))
        return
    click.echo(f"agent {cfg.agent.id} (state in {state_dir})")
    if not datasets:
        click.echo("privacy ledger: no rounds trained yet")
    for dataset_id, d in datasets.items():
        click.echo(
            f"dataset {dataset_id}: epsilon spent {d['epsilon_spent']:.3f} of "
            f"{d['epsilon_budget']:g} (delta {d['delta']:g}) over {d['rounds']} round(s)"
        )
    click.echo(
        f"receipts: {len(receipts)}" + (f" (last round {receipts[-1].round})" if receipts else "")
    )
    if workers is not None:
        click.echo(_workers_line(workers))


def _workers_line(status: WorkersStatus) -> str:
    """``training workers: ...``: the last job's workers, restarts and checkpoint ages."""
    job = "" if status.round is None else f" of round {status.round}"
    line = (
        f"training workers: job{job} {status.state}, {status.workers} worker(s), "
        f"{status.restarts} restart(s) ({status.stragglers} for stragglers)"
    )
    age = status.checkpoint_age_s()
    if age is None:
        line += ", no checkpoint yet"
    else:
        line += f", last checkpoint at step {status.checkpoint_step}, {age:.0f} s ago"
    if status.resumed_checkpoint_age_s is not None:
        line += (
            f"; last restart resumed from step {status.resumed_from_step}, "
            f"a checkpoint {status.resumed_checkpoint_age_s:.0f} s old"
        )
    return line


@agent.command("answer-challenges")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="the agent's agent.toml",
)
@_user_errors
def answer_challenges_command(config_path: Path) -> None:
    """Answer pending audit challenges once (a running agent does this after every round)."""
    from fedsec.agent.runtime import IDENTITY_FILE, AgentRuntime

    _configure_logging(False)
    cfg = load_agent_config(config_path)
    identity = load_identity(Path(cfg.agent.state_dir) / IDENTITY_FILE)
    runtime = AgentRuntime(cfg, identity)

    async def main() -> int:
        client = runtime.make_client()
        try:
            state = await client.get_round(None, 0)
            return await runtime.answer_challenges(client, state.federation_id)
        finally:
            await client.close()

    click.echo(f"agent {cfg.agent.id}: answered {asyncio.run(main())} challenge(s)")
