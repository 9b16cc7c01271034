"""``fedsec bench failover --mode he|buffered``: the replicated federation of
:mod:`fedsec.bench.failover` in homomorphic-summation rounds (the key custodian a
process of its own, given both replicas' URLs as the agents are) or in buffered
(FedBuff) rounds, its leader SIGKILLed once mid-round, against an uninterrupted run.

Where the kill falls (:data:`MODES`), in round :data:`KILL_ROUND`:

- ``he``: ``decrypt``, right after the leader durably entered the decrypt stage: every
  ciphertext is in and the custodian has not released the sum yet.  The standby
  resumes the attempt (replaying the accepted ciphertexts) and the custodian, moving
  to it, releases the sum there.
- ``buffered``: ``masked_input:2``, two of the buffer's three masked updates accepted
  and the third still to come, which reaches the standby.

What must hold: 0 rounds lost (every round closed at its first attempt), the kill hit
where it was aimed, ``fedsec audit verify`` re-derives every version, and no cohort
member's update left out of its round (``dropped`` empty).  The final model's sha256
must equal the uninterrupted run's in HE rounds: the custodian releases the exact
integer sum (the CKKS error is far below one quantisation level and rounded away), so
the seeded members give bit-identical models as in SecAgg+ rounds.  A buffered run's
does not, killed or not: the buffer takes the first ``buffer_size`` members to join, by
arrival, and those left out train again on the next plan, so which updates make each
version, and their staleness, follow the machine's scheduler.  Its hash is reported
(``hash_match``) but is not a check (``hash_determined`` false); the audit's bit-for-bit
re-derivation from the logged updates is.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from fedsec.bench.chaos import ChaosPlan
from fedsec.bench.common import with_environment
from fedsec.bench.failover import FailoverRun, _verified, database_server, run_replicated

#: The round the leader is killed in: the second, so the standby resumes on top of a
#: version the dead leader wrote (the first round's).
KILL_ROUND: Final = 2
#: The custodian's roster id in an HE run.
CUSTODIAN: Final = "keyholder"


@dataclass(frozen=True)
class FailoverMode:
    """How a mode's federation differs from the SecAgg+ one, and where it is killed."""

    round_settings: Mapping[str, Any]
    he: Mapping[str, Any]
    point: str  # the crash point, mid-round (see the module doc)
    hash_determined: bool  # the seeded run's final model is fixed (see the module doc)


MODES: Final[Mapping[str, FailoverMode]] = {
    "he": FailoverMode(
        round_settings={"secure_sum": "he", "decrypt_s": 60.0},
        he={"custodian": CUSTODIAN},
        point="decrypt",
        hash_determined=True,
    ),
    # 3 of the members per aggregate: with more members than that, the buffer fills by
    # arrival and the rest carry their update, one version staler, into the next one
    "buffered": FailoverMode(
        round_settings={"mode": "buffered", "buffer_size": 3, "max_staleness": 2},
        he={},
        point="masked_input:2",
        hash_determined=False,
    ),
}


def mode_plan(mode: str, agents: int, rounds: int, *, timeout_s: float = 400.0) -> ChaosPlan:
    """The plan of an uninterrupted ``mode`` run; ``kill_schedule`` gives its kill.

    Raises:
        KeyError: not a mode of :data:`MODES`.
    """
    m = MODES[mode]
    return ChaosPlan(
        agents=agents,
        rounds=rounds,
        dp=False,
        timeout_s=timeout_s,
        round_settings=m.round_settings,
        he=m.he,
        federation_id=f"failover-{mode}",
    )


def kill_schedule(mode: str, rounds: int) -> tuple[str, ...]:
    """The one crash point of a killed ``mode`` run."""
    return (f"{min(KILL_ROUND, rounds)}:{MODES[mode].point}",)


def run_problems(run: FailoverRun, rounds: int, schedule: tuple[str, ...]) -> list[str]:
    """What a killed run did wrong, by its own record (empty: nothing): a kill that
    missed its point or whose take-over was not seen, a round not closed at its first
    attempt, a cohort member's update left out of its round."""
    problems = [
        f"kill aimed at {k.point} hit {k.hit or 'nothing'}" for k in run.kills if k.hit != k.point
    ]
    if [k.point for k in run.kills] != list(schedule):
        problems.append(f"kills {[k.point for k in run.kills]}, planned {list(schedule)}")
    problems += [f"no take-over seen after {k.point}" for k in run.kills if k.takeover_s is None]
    got = [(s.round, s.attempt, s.stage) for s in run.history]
    if got != [(r, 0, "closed") for r in range(1, rounds + 1)]:
        problems.append(f"rounds {got}")
    problems += [f"round {s.round} dropped {s.dropped}" for s in run.history if s.dropped]
    return problems


def run_mode_failover(
    mode: str,
    agents: int = 6,
    rounds: int = 5,
    *,
    database_url: str | None = None,
    workdir: Path | None = None,
    timeout_s: float = 400.0,
) -> list[dict[str, Any]]:
    """An uninterrupted ``mode`` run, then one with the leader killed once mid-round.

    Returns one ``bench failover`` JSON row per kill.

    Raises:
        KeyError: not a mode of :data:`MODES`.
        ConfigError: a run did not finish, or PostgreSQL is not installed.
    """
    root = workdir or Path(tempfile.mkdtemp(prefix=f"fedsec-failover-{mode}-"))
    base = mode_plan(mode, agents, rounds, timeout_s=timeout_s)
    schedule = kill_schedule(mode, rounds)
    with database_server(database_url) as server:
        reference = run_replicated(
            replace(base, storage_url=server.fresh_database()), root / "reference"
        )
        killed = run_replicated(
            replace(base, storage_url=server.fresh_database(), aggregator_crashes=schedule),
            root / "killed",
        )
        audit = _verified(killed.workspace)  # the log is in the database
    takeovers = [k.takeover_s for k in killed.kills if k.takeover_s is not None]
    run: dict[str, Any] = {
        "bench": "failover",
        "mode": mode,
        "task": "breast_cancer",
        "agents": agents,
        "rounds": rounds,
        "dp": False,
        **{k: v for k, v in base.round_settings.items()},
        "rounds_lost": killed.rounds_lost(rounds),
        "problems": run_problems(killed, rounds, schedule),
        "final_sha256": killed.final_sha256,
        "reference_sha256": reference.final_sha256,
        "hash_match": bool(killed.final_sha256) and killed.final_sha256 == reference.final_sha256,
        "hash_determined": MODES[mode].hash_determined,
        "audit_ok": audit == "ok",
        "audit": audit,
        "takeover_median_s": round(statistics.median(takeovers), 3) if takeovers else None,
        "wall_s": round(killed.wall_s, 2),
        "reference_wall_s": round(reference.wall_s, 2),
        "workdir": str(root),
    }
    return [with_environment({**run, "kill": k.__dict__}) for k in killed.kills]
