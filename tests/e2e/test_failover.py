"""Failover: the chaos test's federation with a leader and a standby ``fedsec
aggregator serve`` on one PostgreSQL database instead of one aggregator restarted.

(a) The leader SIGKILLed twice, after the 2nd masked input of round 1 and on entering
    round 2's unmask, the standby stalled (SIGSTOP) past the lease at the first kill as a
    loaded machine can: the standby still takes the lease over and reaches its own
    crash point, no round is lost and the log verifies.  (A harness that started the
    killed replica again at once would let it win the expired lease from the stalled
    standby, whose point would then never be reached.)
(b) The leader SIGKILLed once per round at every stage (advertise, share keys, masked
    input, consistency, unmask, model write), the killed one started again as the
    next standby: every round closes at its first attempt, the log re-derives every
    model, and the final model is bit-identical to an uninterrupted replicated run.
    It takes 214 s, so it runs with FEDSEC_FAILOVER_FULL=1 and in `fedsec bench
    failover`.
(c) Homomorphic summation with the key custodian a process given both URLs, the leader
    SIGKILLed once on entering round 2's decrypt (every ciphertext in, no release yet),
    and buffered rounds (4 members, buffers of 3) with the leader SIGKILLed once after
    round 2's second masked update: the standby takes over, every round closes at its
    first attempt with no cohort member's update left out, and the log re-derives every
    model.  (Against an uninterrupted run's hash: `fedsec bench failover --mode he`.)
    Each takes 30 to 60 s on a loaded 2-core machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fedsec.aggregator.storage.postgres.lease import LEASE_S
from fedsec.bench.chaos import ChaosPlan, aggregator_schedule, audit_verify
from fedsec.bench.failover import run_replicated
from fedsec.bench.failover_modes import kill_schedule, mode_plan, run_problems
from tests.support.postgres import Postgres, fresh_database, postgres_server

AGENTS = 6
ROUNDS = 6  # one round per crash point


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


@pytest.mark.slow  # 87 s on a loaded 2-core machine: over the suite's budget for one case
def test_the_standby_takes_over_a_killed_leader_without_losing_the_round(
    tmp_path: Path, postgres: Postgres
) -> None:
    points = ("1:masked_input:2", "2:unmask")
    plan = ChaosPlan(
        agents=3,
        rounds=2,
        dp=False,
        aggregator_crashes=points,
        storage_url=fresh_database(postgres),
        timeout_s=200.0,
    )
    run = run_replicated(plan, tmp_path / "killed", stall_standby_s=2 * LEASE_S)
    assert [k.hit for k in run.kills] == list(points)
    assert all(k.takeover_s is not None for k in run.kills)
    assert [(s.round, s.attempt, s.stage) for s in run.history] == [
        (1, 0, "closed"),
        (2, 0, "closed"),
    ]
    assert run.rounds_lost(2) == 0
    verified = audit_verify(run.workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs of 6 rounds: 305 s under a CI run and two busy loops
@pytest.mark.skipif(
    os.environ.get("FEDSEC_FAILOVER_FULL") != "1",
    reason="214 s, over one case's share of the suite: run it with FEDSEC_FAILOVER_FULL=1, "
    "or `fedsec bench failover`",
)
def test_leader_killed_at_every_stage_gives_the_uninterrupted_model(
    tmp_path: Path, postgres: Postgres
) -> None:
    base = ChaosPlan(agents=AGENTS, rounds=ROUNDS, dp=False, timeout_s=400.0)
    reference = run_replicated(
        replace(base, storage_url=fresh_database(postgres)), tmp_path / "reference"
    )
    schedule = tuple(aggregator_schedule(ROUNDS))
    killed = run_replicated(
        replace(base, storage_url=fresh_database(postgres), aggregator_crashes=schedule),
        tmp_path / "killed",
    )
    assert [k.hit for k in killed.kills] == list(schedule)
    assert all(k.takeover_s is not None for k in killed.kills)
    # every round closed at its first attempt: nothing lost, nothing retried
    assert [(s.round, s.attempt, s.stage) for s in killed.history] == [
        (r, 0, "closed") for r in range(1, ROUNDS + 1)
    ]
    assert killed.final_sha256 == reference.final_sha256
    verified = audit_verify(killed.workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"model versions re-derived {ROUNDS}" in verified.stdout


def _killed_mid_round(postgres: Postgres, root: Path, mode: str, agents: int) -> None:
    """The leader of a 2-round ``mode`` run killed once mid-round 2: no round lost, no
    update left out, every model re-derived by the audit."""
    rounds = 2
    schedule = kill_schedule(mode, rounds)
    plan = replace(
        mode_plan(mode, agents, rounds, timeout_s=200.0),
        storage_url=fresh_database(postgres),
        aggregator_crashes=schedule,
    )
    run = run_replicated(plan, root)
    assert run_problems(run, rounds, schedule) == []
    assert run.rounds_lost(rounds) == 0
    verified = audit_verify(run.workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"model versions re-derived {rounds}" in verified.stdout


@pytest.mark.slow  # 29 s on a loaded 2-core machine (54 s under a heavier load)
def test_the_standby_takes_over_an_he_round_between_intake_and_release(
    tmp_path: Path, postgres: Postgres
) -> None:
    pytest.importorskip("tenseal")
    _killed_mid_round(postgres, tmp_path / "killed", "he", agents=3)


@pytest.mark.slow  # 34 s on a loaded 2-core machine (60 s under a heavier load)
def test_the_standby_takes_over_a_buffered_round_mid_buffer(
    tmp_path: Path, postgres: Postgres
) -> None:
    _killed_mid_round(postgres, tmp_path / "killed", "buffered", agents=4)
