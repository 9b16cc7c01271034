"""``fedsec agent status`` shows the last training workers job: workers, restarts (and
how many a straggler caused) and checkpoint ages, as text and as ``--json``; ``fedsec
agent run`` refuses a following node's file before it starts, and ``train-node`` the
agent's."""

from __future__ import annotations

import json
import time
from pathlib import Path

from click.testing import CliRunner

from fedsec.agent.cli import agent
from fedsec.learning.worker_status import WorkersStatus, write_status

_CONFIG = (
    '[agent]\nid = "a0"\naggregator_url = "http://127.0.0.1:1"\n'
    f'aggregator_public_key = "{"ab" * 32}"\nstate_dir = "state"\n'
)


def _status(home: Path, *args: str) -> str:
    result = CliRunner().invoke(agent, ["status", "--config", str(home / "agent.toml"), *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_status_shows_workers_restarts_and_checkpoint_ages(tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(_CONFIG)
    assert "training workers" not in _status(tmp_path)  # no job yet: no line
    assert json.loads(_status(tmp_path, "--json"))["training_workers"] is None
    now = time.time()
    write_status(
        tmp_path / "state",
        WorkersStatus(
            round=12,
            workers=4,
            state="running",
            started_at=now - 300,
            restarts=1,
            stragglers=1,
            checkpoint_step=150,
            checkpoint_at=now - 20,
            resumed_from_step=100,
            resumed_checkpoint_age_s=42.0,
        ),
    )
    text = _status(tmp_path)
    assert (
        "training workers: job of round 12 running, 4 worker(s), 1 restart(s) (1 for "
        "stragglers), last checkpoint at step 150, 20 s ago; last restart resumed from "
        "step 100, a checkpoint 42 s old"
    ) in text
    shown = json.loads(_status(tmp_path, "--json"))
    assert shown["agent"] == "a0" and shown["receipts"] == 0
    workers = shown["training_workers"]
    assert (workers["workers"], workers["restarts"], workers["stragglers"]) == (4, 1, 1)
    assert 19 <= workers["checkpoint_age_s"] < 60
    assert workers["resumed_checkpoint_age_s"] == 42.0


def test_agent_run_on_a_following_node_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    # node_rank > 0 is a train-node's file: run there would train as a rank-0 it is not
    (tmp_path / "agent.toml").write_text(
        _CONFIG + '[training]\nnodes = 2\nnode_rank = 1\nrendezvous_endpoint = "n0:29400"\n'
    )
    result = CliRunner().invoke(agent, ["run", "--config", str(tmp_path / "agent.toml")])
    assert result.exit_code == 1
    assert "training.node_rank = 1: this is not the agent's node" in result.output
    assert not (tmp_path / "state").exists()  # no ledger, no keys read, nothing written


def test_train_node_on_the_agents_node_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(_CONFIG)
    result = CliRunner().invoke(agent, ["train-node", "--config", str(tmp_path / "agent.toml")])
    assert result.exit_code == 1
    assert "train-node needs training.nodes > 1 and training.node_rank in 1..nodes-1" in (
        result.output
    )
    assert "Traceback" not in result.output
