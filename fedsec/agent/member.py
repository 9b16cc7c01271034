"""Who this agent is and what it holds: the plain values its round machines decide with."""

from __future__ import annotations

from dataclasses import dataclass

from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.secagg.graph import DEFAULT_TOLERATED_CORRUPT
from fedsec.protocol.ddp import DEFAULT_MIN_SURVIVORS
from fedsec.protocol.wire import DataSummary
from fedsec.tasks import Task


@dataclass(frozen=True)
class Member:
    """Who this agent is and what it holds: what the round machines decide with."""

    id: str
    identity: SigningIdentity
    aggregator_public: bytes  # pinned in agent.toml: round specs must verify against it
    dataset_id: str
    task: Task
    samples: int
    dim: int  # parameters of the local model
    privacy_delta: float
    require_dp: bool
    privacy_epsilon: float = 0.0  # the budget for this dataset (privacy.epsilon); 0 = unsaid
    # privacy.allow_distributed: rounds where the noise is shared with the other members
    allow_distributed: bool = False
    # privacy.min_survivors: the fewest survivors a distributed round's noise may be sized for
    min_survivors: int = DEFAULT_MIN_SURVIVORS
    # privacy.tolerated_corrupt_neighbours: γ the SecAgg+ threshold must hold against
    tolerated_corrupt: int = DEFAULT_TOLERATED_CORRUPT
    # task "table": the unsigned data summary; signed for the federation at each join
    data_summary: DataSummary | None = None
    # epsilon of this dataset's pure releases (noised summary counts) in the ledger
    extra_epsilon: float = 0.0
