"""Chaos: real processes killed with SIGKILL at every stage, federation still right.

(a) The aggregator dies once per stage (advertise, share keys, after the 2nd masked
    input, unmask, after writing the model but before recording the round) and is
    restarted on the same port each time: every round closes at its first attempt,
    the transparency log re-derives every model, and the final model is bit-identical
    to an uninterrupted run of the same agents, data and seeds.
(b) Two of six agents die at seeded random rounds and stages: every round closes,
    the log re-derives every model, and the dead agents are excluded where they died.

Plus one fast in-process case: the message whose acceptance moved the round on (and
crashed the aggregator before it answered) is retried after the restart, when the
round is already past that stage; the retry gets the original answer, not a refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.workspace import Workspace
from fedsec.bench.chaos import (
    SHORT_DEADLINES,
    ChaosPlan,
    agent_schedule,
    aggregator_schedule,
    audit_verify,
    run_concurrently,
    run_federation,
)
from fedsec.protocol import wire
from tests.support.aggregator import FakeClock, fix_cohort, make_federation

AGENTS = 6
ROUNDS = 6  # one round per aggregator crash point


def _log(workspace: Path) -> list[dict[str, object]]:
    lines = (workspace / "audit" / "log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_aggregator_killed_at_every_stage_gives_the_uninterrupted_model(tmp_path: Path) -> None:
    schedule = tuple(aggregator_schedule(ROUNDS))
    assert schedule == (
        "1:advertise",
        "2:share_keys",
        "3:masked_input:2",
        "4:consistency",
        "5:unmask",
        "6:model_write",
    )
    reference, crashed = run_concurrently(
        [
            # two federations at once, six restarts: room for a loaded 2-core machine
            (ChaosPlan(agents=AGENTS, rounds=ROUNDS, timeout_s=300.0), tmp_path / "reference"),
            (
                ChaosPlan(
                    agents=AGENTS, rounds=ROUNDS, aggregator_crashes=schedule, timeout_s=300.0
                ),
                tmp_path / "crashed",
            ),
        ]
    )

    # every crash point was really reached, each by its own incarnation
    assert crashed.kills == len(schedule)
    assert crashed.crashes_hit == list(schedule)
    assert len(crashed.recovery_s) == len(schedule)

    # no round lost: each closed at its first attempt with the whole cohort
    for run in (reference, crashed):
        assert [(s.round, s.attempt, s.stage) for s in run.history] == [
            (r, 0, "closed") for r in range(1, ROUNDS + 1)
        ]
        assert all(s.survivors == AGENTS and not s.dropped for s in run.history)
        assert all(code == 0 for code in run.agent_exit.values()), run.agent_exit

    # the right aggregate: bit-identical to the uninterrupted run
    assert crashed.final_version == reference.final_version == ROUNDS + 1
    assert crashed.final_sha256 == reference.final_sha256

    # each round's aggregate applies to the model its spec named (once, not twice)
    spec_version: dict[int, int] = {}
    for entry in _log(crashed.workspace):
        body = entry["body"]
        assert isinstance(body, dict)
        if entry["kind"] == "round_spec":
            spec_version[body["round"]] = body["model_version"]
        elif entry["kind"] == "aggregate":
            assert body["parent_version"] == spec_version[body["round"]] == body["round"]

    # the log survived the crashes intact and re-derives every model
    verified = audit_verify(crashed.workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"model versions re-derived {ROUNDS}" in verified.stdout


@pytest.mark.slow
def test_two_agents_killed_at_random_stages(tmp_path: Path) -> None:
    kills = agent_schedule(AGENTS, ROUNDS, kills=2, seed=20241)
    run = run_federation(
        ChaosPlan(agents=AGENTS, rounds=ROUNDS, agent_crashes=kills, deadlines=SHORT_DEADLINES),
        tmp_path / "agents",
    )
    dead = {f"agent-{n}": point for n, point in kills.items()}
    assert run.agent_crashes_hit == dead
    for name, code in run.agent_exit.items():
        assert code == (-9 if name in dead else 0), (name, code)

    closed = run.closed
    assert sorted(s.round for s in closed) == list(range(1, ROUNDS + 1))
    verified = audit_verify(run.workspace)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"model versions re-derived {ROUNDS}" in verified.stdout

    # who was in each closed round, from the log
    cohort: dict[int, list[str]] = {}
    survivors: dict[int, list[str]] = {}
    for entry in _log(run.workspace):
        body = entry["body"]
        assert isinstance(body, dict)
        if entry["kind"] == "round_spec":
            cohort[body["round"]] = body["cohort"]
        elif entry["kind"] == "aggregate":
            survivors[body["round"]] = body["survivors"]
    for summary in closed:
        assert summary.survivors == len(survivors[summary.round])
    for name, point in dead.items():
        died = int(point.split(":")[0])
        stage = point.split(":")[1]
        if stage in ("masked_input", "consistency"):
            # its input was accepted before it died: counted, then never seen again
            assert name in survivors[died]
        else:
            # in the cohort, but its input never arrived: excluded from the sum
            assert name in cohort[died] and name not in survivors[died]
            summary = next(s for s in closed if s.round == died)
            if stage == "share_keys":
                assert name in summary.dropped  # shared keys: its masks were removed
        for later in range(died + 1, ROUNDS + 1):
            assert name not in cohort[later]
            assert name not in survivors[later]


def test_retry_of_the_message_that_moved_the_round_on_gets_its_answer(tmp_path: Path) -> None:
    """After each stage's last message, a restarted coordinator takes that same message
    again (byte-identical retry) although the round has moved on."""
    fed = make_federation(tmp_path / "ws")
    members = ("a0", "a1", "a2", "a3", "a4")
    clock = FakeClock()

    def restart() -> Coordinator:
        fed.ws.close()
        fed.ws = Workspace.open(fed.root)
        return Coordinator(fed.ws, clock=clock)

    coord = Coordinator(fed.ws, clock=clock)
    cohort = fix_cohort(coord, fed.identities, members)
    for m in members:
        coord.advertise(m, 1, 0, cohort.advertise(m))
    coord = restart()
    assert coord.live.stage == "share_keys"
    coord.advertise("a4", 1, 0, cohort.advertise("a4"))  # the last one, retried
    for m in members:
        coord.share_keys(m, 1, 0, cohort.share_keys(m, coord.key_list(m, 1, 0)))
    coord = restart()
    assert coord.live.stage == "masked_input"
    coord.share_keys("a4", 1, 0, cohort.share_keys("a4", coord.key_list("a4", 1, 0)))
    for m in members:
        cohort.receive_shares(m, coord.share_relay(m, 1, 0))
    receipts = {m: coord.masked_input(m, 1, 0, *cohort.upload(m)) for m in members}
    coord = restart()
    assert coord.live.stage == "consistency"
    assert coord.masked_input("a4", 1, 0, *cohort.upload("a4")) == receipts["a4"]
    for m in members:
        coord.consistency(m, 1, 0, cohort.sign(m, coord.unmask_request(m, 1, 0)))
    coord = restart()
    assert coord.live.stage == "unmask"
    # the last signature, retried after the restart, gets the same answer
    coord.consistency("a4", 1, 0, cohort.sign("a4", coord.unmask_request("a4", 1, 0)))
    for m in members:
        coord.unmask(m, 1, 0, cohort.unmask(m, coord.consistency_proof(m, 1, 0)))
    coord = restart()
    assert coord.live.round == 2
    # the round closed; its last unmask answer, retried, is still taken
    coord.unmask("a4", 1, 0, cohort.unmask("a4", wire.ConsistencyProofBody([], [], [])))
    assert [(r.round, r.stage) for r in fed.ws.state.rounds.history()][-2:] == [
        (1, "closed"),
        (2, "open"),
    ]
    fed.ws.close()
