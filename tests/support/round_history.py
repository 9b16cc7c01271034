"""Round attempts written straight into a workspace's state store, for the views that
show round history (the dashboard's rounds table): a plain round and two distributed-DP
rounds, one of whose sums had coordinates at the ring's edge (likely wraps)."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from fedsec.aggregator.workspace import Workspace
from fedsec.protocol import wire

#: Coordinates a distributed-DP round summed (the codec's kept coordinates).
COORDINATES: Final = 5211
#: round -> (realised noise multiplier, coordinates, coordinates at the ring's edge).
DDP_ROUNDS: Final[dict[int, tuple[float, int, int]]] = {
    1: (0.0, 0, 0),  # not distributed DP: nothing summed on the ring's scale
    2: (0.873, COORDINATES, 0),
    3: (0.861, COORDINATES, 3),
}


def summary(round_: int, **changes: Any) -> wire.RoundSummary:
    """A closed attempt 0 of ``round_`` with its :data:`DDP_ROUNDS` values."""
    noise, coordinates, edge = DDP_ROUNDS[round_]
    base = wire.RoundSummary(
        round=round_,
        attempt=0,
        stage="closed",
        cohort=4,
        participants=4,
        survivors=4,
        dropped=[],
        model_version=round_,
        accuracy=0.9,
        loss=0.3,
        aggregation_s=0.05,
        duration_s=2.0,
        epsilon_max=1.0,
        detail="",
        noise_multiplier=noise,
        coordinates=coordinates,
        edge_count=edge,
    )
    return msgspec.structs.replace(base, **changes)


def seed_rounds(ws: Workspace, start: float = 1_700_000_000.0) -> list[wire.RoundSummary]:
    """Write the :data:`DDP_ROUNDS` as closed attempts into ``ws``'s state store (before
    a coordinator resumes from it, which then opens the round after them)."""
    out = []
    with ws.state.transaction():
        for round_ in sorted(DDP_ROUNDS):
            s = summary(round_)
            opened = start + 10 * round_
            ws.state.rounds.open(round_, 0, opened)
            ws.state.rounds.close(
                round_,
                0,
                "closed",
                opened + 2,
                model_version=s.model_version,
                summary=msgspec.json.encode(s),
                detail="",
            )
            out.append(s)
    return out
