"""The torchrun command of a round's training job on each node of a member's cluster,
and the loop by which a node other than the agent's joins the jobs the agent starts.

One node (``[training] nodes = 1``) runs ``torchrun --standalone``. Several run the same
job with torchrun's static rendezvous: ``--nnodes M --node-rank K --master-addr HOST
--master-port PORT``, where ``HOST:PORT`` is ``[training] rendezvous_endpoint`` on node
0, the agent's. Static, not c10d's dynamic rendezvous, so that node 0 always holds rank
0, the rank that writes the checkpoints and the trained weights the agent reads (as
NVIDIA FLARE keeps its server-facing rank fixed); no rank but the agent ever talks to
the aggregator. The job directory (``state_dir/training/job-*``) must be on storage
every node reads: the agent writes ``job.json`` into it last, so a node that sees that
file sees the whole job. Torch-free: the command line is data, tested without a job.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from fedsec.errors import ConfigError
from fedsec.learning.worker_settings import TrainingWorkers, endpoint_parts
from fedsec.learning.worker_status import JOBS_DIR

__all__ = ["JOB_FILE", "MONITOR_INTERVAL_S", "follow_jobs", "torchrun_command"]

log = logging.getLogger(__name__)

#: How often torchrun checks its workers: 0.1 s notices a dead worker at once and costs
#: nothing next to a training step.
MONITOR_INTERVAL_S: Final = 0.1
#: A job's settings, the file the agent writes last into a job directory.
JOB_FILE: Final = "job.json"
#: How often a following node looks for the agent's next job: a job waits at the
#: rendezvous for every node, so 0.5 s of polling costs the round at most that.
FOLLOW_POLL_S: Final = 0.5


def torchrun_command(job: Path, per_node: int, settings: TrainingWorkers) -> list[str]:
    """The command that runs this node's ``per_node`` workers of ``job``.

    Raises:
        ConfigError: several nodes without a ``host:port`` rendezvous endpoint.
    """
    if settings.nodes == 1:
        where = ["--standalone"]
    else:
        endpoint = endpoint_parts(settings.rendezvous_endpoint)
        if endpoint is None:
            raise ConfigError(
                "training.rendezvous_endpoint must be host:port when training.nodes > 1, "
                f"got {settings.rendezvous_endpoint!r}"
            )
        host, port = endpoint
        where = [
            f"--nnodes={settings.nodes}",
            f"--node-rank={settings.node_rank}",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={per_node}",
        f"--max-restarts={settings.max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        "-m",
        "fedsec.learning.workers",
        str(job),
    ]


def follow_jobs(
    state_dir: Path,
    settings: TrainingWorkers,
    stop: Callable[[], bool],
    run: Callable[[Sequence[str]], int] | None = None,
    poll_s: float = FOLLOW_POLL_S,
) -> int:
    """On a node other than the agent's: run this node's part of every job the agent
    starts in ``state_dir`` (shared storage), one after the other, until ``stop()``;
    returns how many jobs it joined. A job it finds already there when it starts is
    joined too (it waits at the rendezvous for this node).

    Args:
        run: runs a command to its end and returns its exit status (default: a
            subprocess whose output is this process's).

    Raises:
        ConfigError: ``settings`` are not those of a following node.
    """
    if settings.nodes < 2 or not 1 <= settings.node_rank < settings.nodes:
        raise ConfigError(
            "fedsec agent train-node needs training.nodes > 1 and training.node_rank in "
            f"1..nodes-1, got nodes = {settings.nodes}, node_rank = {settings.node_rank}"
        )
    execute = run or _run
    joined: set[str] = set()
    while not stop():
        job = _next_job(Path(state_dir) / JOBS_DIR, joined)
        if job is None:
            time.sleep(poll_s)
            continue
        joined.add(job.name)
        try:
            per_node = int(json.loads((job / JOB_FILE).read_text())["nproc_per_node"])
        except (OSError, ValueError, KeyError) as exc:  # ended, removed, or not a job
            log.warning("node_job_skipped job=%s reason=%s", job.name, type(exc).__name__)
            continue
        status = execute(torchrun_command(job, per_node, settings))
        log.info(
            "node_job_ended job=%s node_rank=%d workers=%d exit=%d",
            job.name,
            settings.node_rank,
            per_node,
            status,
        )
    return len(joined)


def _next_job(jobs: Path, joined: set[str]) -> Path | None:
    """The oldest job directory whose settings are written and that this node has not
    joined yet."""
    if not jobs.is_dir():
        return None
    ready = [
        job for job in jobs.glob("job-*") if job.name not in joined and (job / JOB_FILE).is_file()
    ]
    return min(ready, key=lambda job: (job / JOB_FILE).stat().st_mtime, default=None)


def _run(command: Sequence[str]) -> int:
    return subprocess.run(list(command), check=False).returncode
