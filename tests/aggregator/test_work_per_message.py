"""The round engine's work per accepted message stays the same as the cohort grows.

Each accepted message asks whether its stage is complete, whether its sender is in the
cohort, and (a join) whether the cohort is ready; each advertisement's graph commitment is
looked up; each survivor fetches the unmask request.  Done by scanning, sorting or
copying the cohort, each was O(n) per message and O(n^2) a round (profiled at 1,000
members).  Timing is not a test, so the work is counted: member ids that count their own
hashes and comparisons (a sort or a scan of the cohort touches every one), the bytes a
call holds (a set or list of the cohort is O(n) of them), and the state database's
virtual-machine steps (a count or sort over the attempt's joins visits every row).
"""

from __future__ import annotations

import sqlite3
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.crypto.secagg import MaskedInput
from fedsec.protocol import codec, wire
from fedsec.summation.secagg import SecAggPlusSession
from tests.support.aggregator import Cohort, FakeClock, join_request, make_federation

SMALL, LARGE = 6, 24


class _Id(str):
    """A member id that counts the hashes and comparisons made of it."""

    touched = 0

    def __hash__(self) -> int:
        _Id.touched += 1
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        _Id.touched += 1
        return str.__eq__(self, other)

    def __lt__(self, other: str) -> bool:
        _Id.touched += 1
        return str.__lt__(self, other)


@contextmanager
def _touches() -> Iterator[list[int]]:
    """How many times member ids were hashed or compared inside the block, and the most
    bytes it held allocated at once (a set or list of the cohort is O(n) bytes, even where
    it is built from a dict's stored hashes without touching an id)."""
    out: list[int] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        before = _Id.touched
        yield out
        out.append(_Id.touched - before)
        out.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()


def _members(n: int) -> tuple[str, ...]:
    return tuple(f"a{i:02d}" for i in range(n))


def _fixed(tmp: Path, n: int) -> tuple[Coordinator, dict[str, object]]:
    fed = make_federation(tmp, _members(n), round={"min_agents": 3}, validation=False)
    coord = Coordinator(fed.ws, clock=FakeClock())
    for m in _members(n):
        coord.join(m, 1, 0, _join(m))
    coord.tick()
    assert coord.live.spec is not None
    return coord, dict(fed.identities)


def _join(member: str) -> wire.JoinRequest:
    return join_request(member, 1)


def _most_touched_per_message(tmp: Path, n: int) -> dict[str, int]:
    """Run a SecAgg+ session over ``n`` counting ids; per stage, the most ids touched by
    the completeness check after one accepted message, and by one survivor's unmask
    request."""
    coord, identities = _fixed(tmp, n)
    plain = coord.live.spec
    assert plain is not None
    spec = msgspec.structs.replace(plain, cohort=[_Id(m) for m in plain.cohort])
    keys = {m: identities[m].public_bytes for m in spec.cohort}  # type: ignore[attr-defined]
    session = SecAggPlusSession(spec, keys)
    cohort = Cohort(spec, identities)  # type: ignore[arg-type]
    most: dict[str, int] = {}

    def accept(stage: str, members: list[str], message: Callable[[str], object]) -> None:
        for m in members:
            if session.complete(stage):
                break  # the stage decided (unmask: the answers so far decide the sum)
            received = message(m)
            with _touches() as touched:
                session.receive(stage, received)  # type: ignore[arg-type]
            if stage == "advertise":  # the later stages' checks are O(k) (its neighbours)
                most["advertise receive"] = max(most.get("advertise receive", 0), touched[0])
            with _touches() as touched:
                session.complete(stage)
            most[stage] = max(most.get(stage, 0), touched[0])
            most[f"{stage} bytes"] = max(most.get(f"{stage} bytes", 0), touched[1])
        if stage != "unmask":
            session.close(stage)

    members = list(spec.cohort)
    accept("advertise", members, lambda m: codec.advertise_message(m, cohort.advertise(m)))
    keys_body = session.key_list(members[0])
    accept(
        "share_keys",
        members,
        lambda m: codec.share_keys_message(m, cohort.share_keys(m, keys_body)),
    )
    for m in members:
        cohort.receive_shares(m, session.share_relay(m))
    accept("masked_input", members, lambda m: _masked(cohort, m))
    requests = {}
    for token in (7, 8):  # a new state token: a new body, still not per member
        for m in members:
            with _touches() as touched:
                request = session.unmask_request(m, token)
            requests[m] = request
            if m != members[0]:  # the first of each token builds the one body
                most["unmask_request"] = max(most.get("unmask_request", 0), touched[0])
                most["unmask_request bytes"] = max(most.get("unmask_request bytes", 0), touched[1])
    accept(
        "consistency",
        members,
        lambda m: codec.consistency_message(m, cohort.sign(m, requests[m])),
    )
    accept(
        "unmask",
        members,
        lambda m: codec.unmask_message(m, cohort.unmask(m, session.consistency_proof(m, 9))),
    )
    assert session.finalize().survivors
    return most


def _masked(cohort: Cohort, member: str) -> object:
    return MaskedInput(member, cohort.masked_input(member))


def test_stage_checks_and_unmask_requests_touch_no_more_ids_in_a_larger_cohort(
    tmp_path: Path,
) -> None:
    small = _most_touched_per_message(tmp_path / "small", SMALL)
    large = _most_touched_per_message(tmp_path / "large", LARGE)
    checks = ("advertise", "share_keys", "masked_input", "unmask_request", "consistency", "unmask")
    assert set(small) == {*checks, *(f"{check} bytes" for check in checks), "advertise receive"}
    # an advertisement's commitment looked up by the member's place, not found by a scan
    assert large["advertise receive"] == small["advertise receive"], (small, large)
    for check in checks:
        # a sort of the cohort or a scan of it touches ~n ids (4x as many here), a set
        # or list of it holds ~8n bytes; the allowance is for the allocator's rounding
        assert large[check] == small[check], (check, small, large)
        assert large[f"{check} bytes"] <= small[f"{check} bytes"] + 64, (check, small, large)


def test_the_cohort_check_looks_a_member_up_not_through_the_list(tmp_path: Path) -> None:
    def touched_per_check(n: int) -> int:
        coord, _ = _fixed(tmp_path / str(n), n)
        assert coord.live.spec is not None
        spec = msgspec.structs.replace(coord.live.spec, cohort=[_Id(m) for m in _members(n)])
        live = Attempt(1, 0, "advertise", 0.0, 0.0, spec)
        live.in_cohort(_Id(_members(n)[-1]))  # the set is built once per spec
        with _touches() as touched:
            live.in_cohort(_Id(_members(n)[-1]))
        return touched[0]

    assert touched_per_check(LARGE) == touched_per_check(SMALL) <= 2


def test_a_join_costs_the_store_the_same_work_in_a_larger_cohort(tmp_path: Path) -> None:
    def steps_of_the_last_but_one_join(n: int) -> int:
        fed = make_federation(tmp_path / str(n), _members(n), round={"min_agents": 3})
        coord = Coordinator(fed.ws, clock=FakeClock())
        for m in _members(n)[:-2]:
            coord.join(m, 1, 0, _join(m))
        db: sqlite3.Connection = fed.ws.state._conn.db  # type: ignore[attr-defined]
        steps = [0]

        def step() -> int:
            steps[0] += 1
            return 0  # go on

        # past min_agents, with n - 2 joins stored; the last join completes the cohort
        # and reads the joins once (O(n) once a round), so it is not the one counted
        db.set_progress_handler(step, 1)
        try:
            coord.join(_members(n)[-2], 1, 0, _join(_members(n)[-2]))
        finally:
            db.set_progress_handler(None, 1)
        assert coord.live.stage == "open"
        return steps[0]

    # a count of the joins, or a sort of them by time, visits every row stored so far
    small, large = steps_of_the_last_but_one_join(SMALL), steps_of_the_last_but_one_join(LARGE)
    assert large == small, (small, large)
