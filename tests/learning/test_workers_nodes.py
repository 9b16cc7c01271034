"""The torchrun command of a job on one node and on several (static rendezvous at node
0's endpoint, so node 0 holds rank 0), and a following node joining the agent's jobs.
The jobs themselves are not run here (a 2-node loopback job is in docs/agent.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from fedsec.config import parse_agent_config
from fedsec.errors import ConfigError
from fedsec.learning.worker_nodes import follow_jobs, torchrun_command
from fedsec.learning.worker_settings import TrainingWorkers

_TAIL = ["--max-restarts=2", "--monitor-interval=0.1", "-m", "fedsec.learning.workers"]


def test_one_node_runs_standalone() -> None:
    command = torchrun_command(Path("/s/training/job-1"), 4, TrainingWorkers(workers=4))
    assert command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        *_TAIL,
        "/s/training/job-1",
    ]


def test_several_nodes_meet_at_node_0s_endpoint_with_a_fixed_node_rank() -> None:
    settings = TrainingWorkers(
        workers=2, nodes=3, node_rank=2, rendezvous_endpoint="10.0.0.5:29400"
    )
    assert torchrun_command(Path("/s/j"), 2, settings)[3:8] == [
        "--nnodes=3",
        "--node-rank=2",
        "--master-addr=10.0.0.5",
        "--master-port=29400",
        "--nproc-per-node=2",
    ]
    ipv6 = TrainingWorkers(nodes=2, rendezvous_endpoint="[fd00::1]:29400")
    assert "--master-addr=fd00::1" in torchrun_command(Path("/s/j"), 1, ipv6)
    with pytest.raises(ConfigError, match="rendezvous_endpoint must be host:port"):
        torchrun_command(Path("/s/j"), 1, TrainingWorkers(nodes=2, rendezvous_endpoint="h"))


def test_a_following_node_joins_each_ready_job_once(tmp_path: Path) -> None:
    # a job is ready once its job.json is written (the agent writes it last); the node
    # runs its part with the job's workers per node and its own node rank, once
    jobs = tmp_path / "training"
    (jobs / "job-b").mkdir(parents=True)  # being written: no settings yet
    (jobs / "job-a").mkdir()
    (jobs / "job-a" / "job.json").write_text(json.dumps({"nproc_per_node": 3}))
    settings = TrainingWorkers(nodes=2, node_rank=1, rendezvous_endpoint="127.0.0.1:29400")
    ran: list[Sequence[str]] = []

    def run(command: Sequence[str]) -> int:
        ran.append(command)
        return 0

    polls = iter(range(4))
    joined = follow_jobs(tmp_path, settings, lambda: next(polls) == 3, run, poll_s=0.0)
    assert joined == 1 and len(ran) == 1
    assert ran[0][-1] == str(jobs / "job-a")
    assert "--node-rank=1" in ran[0] and "--nproc-per-node=3" in ran[0]


def test_the_agents_node_or_a_single_node_cannot_follow(tmp_path: Path) -> None:
    for settings in (TrainingWorkers(nodes=2, rendezvous_endpoint="h:1"), TrainingWorkers()):
        with pytest.raises(ConfigError, match=r"node_rank in 1\.\.nodes-1"):
            follow_jobs(tmp_path, settings, lambda: True)


def test_agent_toml_nodes_need_an_endpoint_and_a_rank_below_nodes() -> None:
    base = (
        '[agent]\nid = "a0"\naggregator_url = "http://127.0.0.1:1"\n'
        f'aggregator_public_key = "{"ab" * 32}"\n[training]\n'
    )
    ok = parse_agent_config(base + 'nodes = 2\nnode_rank = 1\nrendezvous_endpoint = "n0:29400"\n')
    assert ok.training.settings.uses_torchrun
    assert (ok.training.settings.nodes, ok.training.settings.node_rank) == (2, 1)
    with pytest.raises(ConfigError, match=r"training\.rendezvous_endpoint: expected host:port"):
        parse_agent_config(base + "nodes = 2\n")
    with pytest.raises(ConfigError, match=r"training\.node_rank: expected an integer in 0\.\.1"):
        parse_agent_config(base + 'nodes = 2\nnode_rank = 2\nrendezvous_endpoint = "n0:1"\n')
    with pytest.raises(ConfigError, match=r"training\.rendezvous_endpoint"):
        parse_agent_config(base + 'nodes = 2\nrendezvous_endpoint = "n0:99999"\n')
