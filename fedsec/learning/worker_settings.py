"""How a member splits its local training over processes: the settings of
:mod:`fedsec.learning.workers` and their limits, without torch, for the agent's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: Most processes on one node: a node has at most 8-16 accelerators, and CPU workers
#: beyond the cores only contend; 64 leaves room without letting a typo start 10,000.
MAX_WORKERS: Final = 64
#: Most nodes one member's job spans: the brief's largest member trains on 40; 1024
#: leaves room without letting a typo make every node wait for a million others.
MAX_NODES: Final = 1024
#: Restarts torchrun grants a round's job: a worker lost twice in one round points at a
#: broken node, not a transient fault, so the round fails and the next one starts fresh.
DEFAULT_MAX_RESTARTS: Final = 2
MAX_RESTARTS: Final = 100
#: Steps between checkpoints: a restart redoes at most this many steps; each checkpoint
#: is one atomic write of the model and optimiser state (milliseconds for the bundled
#: models, so 50 keeps that under 1 % of the steps' time).
DEFAULT_CHECKPOINT_STEPS: Final = 50
#: Seconds between checkpoints as well: a round's training has ``round.open_s`` (600 s by
#: default), so a rollback of at most a minute leaves a restarted job most of it.
DEFAULT_CHECKPOINT_INTERVAL_S: Final = 60.0
#: How long a worker may keep the others waiting at a step's all-reduce before the job
#: restarts from its checkpoint: far above a step's own imbalance (rank 0 alone adds the
#: DP noise and writes checkpoints, milliseconds to seconds), far below ``round.open_s``,
#: so a lagging node costs the round a minute, not its deadline.
DEFAULT_STRAGGLER_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class TrainingWorkers:
    """How a member splits its local training (``[training]`` of ``agent.toml``).

    ``workers``: processes; 0 = one per GPU when training on CUDA, else in-process;
    1 = in-process (no torchrun). ``checkpoint_steps`` and ``checkpoint_interval_s``: a
    checkpoint after every that many steps or seconds, whichever comes first; 0 turns
    either off (both 0: a restart starts the round's training over).
    ``straggler_timeout_s``: seconds a worker may hold a step's all-reduce.
    ``nodes``: machines the job spans, each running ``workers`` processes; node 0 is
    the agent's and holds rank 0, the others (``node_rank`` 1..nodes-1) run
    ``fedsec agent train-node`` and meet at ``rendezvous_endpoint`` (``host:port`` of
    node 0 inside the member's perimeter).
    """

    workers: int = 1
    max_restarts: int = DEFAULT_MAX_RESTARTS
    checkpoint_steps: int = DEFAULT_CHECKPOINT_STEPS
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    straggler_timeout_s: float = DEFAULT_STRAGGLER_TIMEOUT_S
    nodes: int = 1
    node_rank: int = 0
    rendezvous_endpoint: str = ""

    @property
    def uses_torchrun(self) -> bool:
        """Whether a round trains as a torchrun job (else in the agent's process)."""
        return self.workers != 1 or self.nodes > 1


def endpoint_parts(endpoint: str) -> tuple[str, int] | None:
    """``host:port`` as (host, port), or None where it is not one (an IPv6 host is
    written in brackets, ``[::1]:29400``)."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)
