"""The round coordinator, driven directly (no sockets) with real ClientSessions.

Covers stage transitions, cohort fixing, drop-outs at each stage, aborts and
retried attempts, idempotent intake, resuming after a restart at every stage,
plain (``secure_sum = "none"``) rounds, privacy reports, join checks and the
bounds on logging refused contributions.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fedsec.aggregator.coordinator import REFUSED_ENTRIES_PER_ATTEMPT, Coordinator
from fedsec.aggregator.workspace import Workspace
from fedsec.audit.report import read_entries, summarize
from fedsec.audit.verify import verify_log
from fedsec.crypto.quantize import QuantSpec, pack
from fedsec.errors import (
    BadVector,
    DuplicateMessage,
    FedsecError,
    PayloadError,
    SignatureError,
    TaskMismatch,
    UnknownMember,
    WrongStage,
)
from fedsec.modelfile import verify_manifest
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_ID
from tests.support.aggregator import (
    FAST_ROUND,
    FED,
    Cohort,
    FakeClock,
    Federation,
    expected_params,
    fix_cohort,
    float_mean,
    join_request,
    log_entries,
    make_federation,
    model_params,
    plain_input,
    plain_upload,
    privacy_report,
    quantized_input,
    snapshot,
    table_rows,
)
from tests.support.aggregator import (
    advertise_all as _advertise,
)
from tests.support.aggregator import (
    attempt_of as _ra,
)
from tests.support.aggregator import (
    fetch_shares as _fetch_shares,
)
from tests.support.aggregator import (
    mask_all as _masked,
)
from tests.support.aggregator import (
    share_all as _share,
)
from tests.support.aggregator import (
    sign_all as _sign,
)
from tests.support.aggregator import (
    unmask_all as _unmask,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
# Deadline of the advertise stage: members advertise while they train, so only the upload
# window (training time belongs to the masked-input stage).
ADVERTISE_DEADLINE = FAST_ROUND["advertise_s"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(tmp_path / "ws")


def _start(
    fed: Federation, clock: FakeClock, members: tuple[str, ...] = MEMBERS
) -> tuple[Coordinator, Cohort]:
    """A coordinator whose round 1 cohort is fixed with ``members``."""
    coord = Coordinator(fed.ws, clock=clock)
    return coord, fix_cohort(coord, fed.identities, members)


def _rounds(fed: Federation) -> list[tuple[int, int, str, int | None]]:
    return [(r.round, r.attempt, r.stage, r.model_version) for r in fed.ws.state.rounds.history()]


def _summary(fed: Federation, round_: int, attempt: int) -> wire.RoundSummary:
    row = fed.ws.state.rounds.get(round_, attempt)
    assert row is not None and row.summary is not None
    return msgspec.json.decode(row.summary, type=wire.RoundSummary)


def _check_aggregate(fed: Federation, cohort: Cohort, survivors: tuple[str, ...]) -> None:
    """Version 2 is version 1 plus the weighted mean of exactly the survivors' inputs."""
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    exact = expected_params(old, [cohort.quantized[m] for m in survivors], cohort.spec)
    np.testing.assert_array_equal(new, exact)
    # ...and that mean is the survivors' Σw·Δ/Σw within quantization error.
    quant = QuantSpec(cohort.spec.quant_bits, cohort.spec.clip_norm, cohort.spec.ring_bits)
    # Stochastic rounding moves each w·Δ coordinate by under one step (2C/L); the slack
    # covers the rounding of the weights themselves.
    weights = sum(float(cohort.quantized[m][-1]) / quant.levels for m in survivors)
    signal = float_mean(survivors, cohort.spec.dim)
    error = (new.astype(np.float64) - old) - signal
    assert np.abs(error).max() <= 1.5 * len(survivors) * quant.step() / weights
    assert np.linalg.norm(error) < 0.5 * np.linalg.norm(signal)


def _refused(
    fed: Federation, coord: Coordinator, exc: type[FedsecError], call: object, *args: object
) -> FedsecError:
    """``call(*args)`` raises ``exc`` and changes nothing."""
    before = snapshot(fed.ws, coord)
    with pytest.raises(exc) as info:
        call(*args)  # type: ignore[operator]
    assert type(info.value) is exc
    assert info.value.detail
    assert snapshot(fed.ws, coord) == before
    return info.value


# -- a whole round ---------------------------------------------------------------------------------


def test_round_walks_every_stage_and_publishes_a_signed_child_version(
    fed: Federation, clock: FakeClock
) -> None:
    coord = Coordinator(fed.ws, clock=clock)
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 0, "open")
    for m in MEMBERS[:-1]:
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    assert coord.live.stage == "open"  # a4 is enrolled and the join window is still open
    coord.join("a4", 1, 0, join_request("a4", 1))
    coord.tick()  # every active agent joined: no need to wait for the deadline
    assert coord.live.stage == "advertise"
    assert fed.ws.state.rounds.get(1, 0).stage == "advertise"  # type: ignore[union-attr]

    spec = coord.live.spec
    assert spec is not None
    spec.verify(fed.ws.signer.public_bytes)
    assert spec.cohort == list(MEMBERS)
    assert (spec.model_version, spec.model_sha256) == (1, fed.ws.models.get(1).sha256)
    cohort = Cohort(spec, fed.identities)

    _advertise(coord, cohort, MEMBERS)
    assert coord.live.stage == "share_keys"
    _share(coord, cohort, MEMBERS)
    assert coord.live.stage == "masked_input"
    _fetch_shares(coord, cohort, MEMBERS)
    receipts = _masked(coord, cohort, MEMBERS)
    assert coord.live.stage == "consistency"
    assert fed.ws.state.rounds.get(1, 0).stage == "consistency"  # type: ignore[union-attr]
    _sign(coord, cohort)
    assert coord.live.stage == "unmask"
    assert fed.ws.state.rounds.get(1, 0).stage == "unmask"  # type: ignore[union-attr]
    _unmask(coord, cohort, MEMBERS)

    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (2, 0, "open")
    assert _rounds(fed) == [(1, 0, "closed", 2), (2, 0, "open", None)]
    manifest = fed.ws.models.latest()
    assert (manifest.version, manifest.parent, manifest.round, manifest.kind) == (
        2,
        1,
        1,
        "aggregate",
    )
    verify_manifest(manifest, fed.ws.signer.public_bytes, fed.ws.models.read(2), federation_id=FED)
    # validation scores every metric of the task (breast_cancer: accuracy, cross-entropy)
    # and its loss
    assert set(manifest.metrics) == {"accuracy", "cross_entropy", "loss"}
    _check_aggregate(fed, cohort, MEMBERS)
    summary = _summary(fed, 1, 0)
    assert (summary.stage, summary.cohort, summary.survivors, summary.dropped) == (
        "closed",
        5,
        5,
        [],
    )
    for m, receipt in receipts.items():
        receipt.verify(fed.ws.signer.public_bytes)
        assert coord.receipt(m, 1) == receipt
    assert coord.round_state().model_version == 2
    # every accepted input is logged with the member's signed statement
    accepted = {
        e["body"]["member"]: e
        for e in log_entries(fed.ws)
        if e["kind"] == "accepted" and e["body"]["stage"] == "masked_input"
    }
    assert set(accepted) == set(MEMBERS)
    for m, entry in accepted.items():
        raw, commitment, signature = cohort.upload(m)
        assert entry["index"] == receipts[m].log_index
        assert (entry["body"]["commitment"], entry["body"]["signature"]) == (commitment, signature)
        assert entry["body"]["sha256"] == hashlib.sha256(raw).hexdigest()


def test_cohort_fixed_at_the_join_deadline_with_enough_members(
    fed: Federation, clock: FakeClock
) -> None:
    # before the deadline, enough members do not fix the cohort while enrolled agents may come
    early = Coordinator(make_federation(fed.root.parent / "early").ws, clock=clock)
    for m in ("a0", "a1", "a2"):
        early.join(m, 1, 0, join_request(m, 1))
    early.tick()
    assert early.live.stage == "open"

    coord = Coordinator(fed.ws, clock=clock)
    coord.join("a3", 1, 0, join_request("a3", 1))
    coord.join("a1", 1, 0, join_request("a1", 1))
    clock.advance(FAST_ROUND["advertise_s"] + 1)
    coord.tick()
    assert coord.live.stage == "open"  # deadline passed, but 2 < min_agents
    coord.join("a0", 1, 0, join_request("a0", 1))
    coord.tick()
    assert coord.live.stage == "open"  # the join window starts at the min_agents-th join
    clock.advance(FAST_ROUND["advertise_s"] + 1)
    coord.tick()
    assert coord.live.stage == "advertise"
    assert coord.live.spec is not None and coord.live.spec.cohort == ["a0", "a1", "a3"]
    # the join window is closed: a late member is refused and nothing is recorded
    _refused(fed, coord, WrongStage, coord.join, "a2", 1, 0, join_request("a2", 1))


def test_member_lost_at_advertise_is_left_out(fed: Federation, clock: FakeClock) -> None:
    coord, cohort = _start(fed, clock)
    alive = MEMBERS[:4]
    _advertise(coord, cohort, alive)
    assert coord.live.stage == "advertise"
    _refused(fed, coord, WrongStage, coord.key_list, "a0", 1, 0)
    clock.advance(ADVERTISE_DEADLINE - 1)
    coord.tick()
    assert coord.live.stage == "advertise"
    clock.advance(2)
    coord.tick()
    assert coord.live.stage == "share_keys"
    assert [e.member for e in coord.key_list("a0", 1, 0).entries] == list(alive)
    _refused(fed, coord, UnknownMember, coord.key_list, "a4", 1, 0)
    _refused(fed, coord, WrongStage, coord.advertise, "a4", 1, 0, cohort.advertise("a4"))

    _share(coord, cohort, alive)
    _fetch_shares(coord, cohort, alive)
    _masked(coord, cohort, alive)
    _unmask(coord, cohort, alive)
    assert _rounds(fed)[0] == (1, 0, "closed", 2)
    _check_aggregate(fed, cohort, alive)
    summary = _summary(fed, 1, 0)
    assert (summary.cohort, summary.participants, summary.survivors) == (5, 4, 4)


def test_member_lost_after_share_keys_is_unmasked_out_of_the_sum(
    fed: Federation, clock: FakeClock
) -> None:
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    survivors = MEMBERS[:4]
    _masked(coord, cohort, survivors)
    assert coord.live.stage == "masked_input"  # a4 may still send until the deadline
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])
    coord.tick()
    assert coord.live.stage == "consistency"
    request = coord.unmask_request("a0", 1, 0)
    assert (request.survivors, request.dropped) == (list(survivors), ["a4"])
    _refused(fed, coord, UnknownMember, coord.unmask_request, "a4", 1, 0)
    _refused(fed, coord, WrongStage, coord.masked_input, "a4", 1, 0, *cohort.upload("a4"))

    _unmask(coord, cohort, survivors)
    assert _rounds(fed)[0] == (1, 0, "closed", 2)
    _check_aggregate(fed, cohort, survivors)
    summary = _summary(fed, 1, 0)
    assert (summary.participants, summary.survivors, summary.dropped) == (5, 4, ["a4"])


# -- aborts ----------------------------------------------------------------------------------------


def test_too_few_members_abort_the_attempt_and_the_next_attempt_completes(
    fed: Federation, clock: FakeClock
) -> None:
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS[:3])
    clock.advance(ADVERTISE_DEADLINE)
    coord.tick()

    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None
    assert (row.stage, row.model_version) == ("aborted", None)
    assert "'a3'" in row.detail and "'a4'" in row.detail
    assert _summary(fed, 1, 0).stage == "aborted"
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")
    assert fed.ws.state.rounds.get(1, 1).stage == "open"  # type: ignore[union-attr]
    assert any("aborted" in alert for alert in coord.alerts)
    assert fed.ws.models.latest().version == 1
    # messages for the aborted attempt are refused
    _refused(fed, coord, WrongStage, coord.join, "a0", 1, 0, join_request("a0", 1))
    _refused(fed, coord, WrongStage, coord.advertise, "a3", 1, 0, cohort.advertise("a3"))

    for m in MEMBERS:
        coord.join(m, 1, 1, join_request(m, 1))
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and (spec.round, spec.attempt) == (1, 1)
    retry = Cohort(spec, fed.identities)
    _advertise(coord, retry, MEMBERS)
    _share(coord, retry, MEMBERS)
    _fetch_shares(coord, retry, MEMBERS)
    _masked(coord, retry, MEMBERS)
    _unmask(coord, retry, MEMBERS)
    assert _rounds(fed) == [
        (1, 0, "aborted", None),
        (1, 1, "closed", 2),
        (2, 0, "open", None),
    ]
    assert fed.ws.models.latest().round == 1
    _check_aggregate(fed, retry, MEMBERS)


def test_silent_survivors_at_unmask_abort_naming_them(fed: Federation, clock: FakeClock) -> None:
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS[:2])  # threshold is 3: seeds cannot be recovered
    clock.advance(FAST_ROUND["unmask_s"])
    coord.tick()
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "aborted"
    assert "silent holders" in row.detail and "a4" in row.detail
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")
    assert fed.ws.models.latest().version == 1


def test_unmask_closes_once_the_answers_decide_the_sum(tmp_path: Path, clock: FakeClock) -> None:
    members = tuple(f"a{i}" for i in range(9))
    fed = make_federation(tmp_path / "ws", agents=members)
    coord, cohort = _start(fed, clock, members)
    spec = cohort.spec
    assert (spec.neighbors, spec.threshold) == (8, 5)  # classic SecAgg for 9
    _advertise(coord, cohort, members)
    _share(coord, cohort, members)
    _fetch_shares(coord, cohort, members)
    _masked(coord, cohort, members[:8])  # a8 is lost after sharing its keys
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])
    coord.tick()
    r, a = _ra(coord)
    _sign(coord, cohort)
    assert coord.live.stage == "unmask"
    answers = {m: cohort.unmask(m, coord.consistency_proof(m, r, a)) for m in members[:8]}
    for m in members[:6]:
        assert coord.unmask(m, r, a, answers[m])
    # a0's seed: shares from a1..a5, 5 of the t + 1 = 6 wanted
    assert coord.live.stage == "unmask"
    assert coord.unmask("a6", r, a, answers["a6"])
    # every seed and a8's mask key now has 6 shares: closed without waiting for a7
    assert (coord.live.round, coord.live.stage) == (2, "open")
    _check_aggregate(fed, cohort, members[:8])
    assert _summary(fed, 1, 0).dropped == ["a8"]
    decided = [
        e["body"]["member"]
        for e in log_entries(fed.ws)
        if e["kind"] == "accepted" and e["body"]["stage"] == "unmask"
    ]
    assert decided == list(members[:7])

    # a7's answer, late, is not needed: taken, but nothing is stored or logged
    before, logged = snapshot(fed.ws, coord), len(log_entries(fed.ws))
    assert not coord.unmask("a7", r, a, answers["a7"])
    assert snapshot(fed.ws, coord) == before
    assert len(log_entries(fed.ws)) == logged
    # a member whose masked input was not summed gets no such pass
    _refused(fed, coord, WrongStage, coord.unmask, "a8", r, a, answers["a7"])


# -- idempotent intake -----------------------------------------------------------------------------


def test_retried_messages_are_idempotent_and_different_ones_refused(
    fed: Federation, clock: FakeClock
) -> None:
    coord, cohort = _start(fed, clock)
    coord.advertise("a0", 1, 0, cohort.advertise("a0"))
    coord.advertise("a0", 1, 0, cohort.advertise("a0"))  # same bytes: accepted again, no-op
    assert len(table_rows(fed.ws, "messages")) == 1
    other = Cohort(cohort.spec, fed.identities)  # fresh ephemeral keys for a0
    _refused(fed, coord, DuplicateMessage, coord.advertise, "a0", 1, 0, other.advertise("a0"))

    _advertise(coord, cohort, MEMBERS[1:])
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    raw, commitment, signature = cohort.upload("a0")
    receipt = coord.masked_input("a0", 1, 0, raw, commitment, signature)
    receipt.verify(fed.ws.signer.public_bytes)
    assert receipt.member == "a0" and (receipt.round, receipt.attempt) == (1, 0)
    assert receipt.contribution_sha256 == hashlib.sha256(raw).hexdigest()
    before = snapshot(fed.ws, coord)
    clock.advance(1)
    retry = cohort.upload("a0")
    assert retry == (raw, commitment, signature)  # fixed salt: a retry is byte-identical
    assert coord.masked_input("a0", 1, 0, *retry) == receipt  # the same signed receipt
    assert snapshot(fed.ws, coord) == before
    assert len(table_rows(fed.ws, "receipts")) == 1

    changed = bytearray(raw)
    changed[0] ^= 1
    changed_upload = cohort.upload("a0", bytes(changed))
    _refused(fed, coord, DuplicateMessage, coord.masked_input, "a0", 1, 0, *changed_upload)
    # the statement is signed over the short vector, so the vector itself is what is refused
    _refused(fed, coord, BadVector, coord.masked_input, "a1", 1, 0, *cohort.upload("a1", raw[:-1]))
    _refused(fed, coord, WrongStage, coord.masked_input, "a1", 2, 0, *cohort.upload("a1"))
    _refused(fed, coord, WrongStage, coord.masked_input, "a1", 1, 1, *cohort.upload("a1"))
    # the refusals left the round able to finish with the right sum
    _masked(coord, cohort, MEMBERS[1:])
    _unmask(coord, cohort, MEMBERS)
    _check_aggregate(fed, cohort, MEMBERS)


def test_masked_input_needs_the_members_own_signed_statement(
    fed: Federation, clock: FakeClock
) -> None:
    """A statement signed by another key, or not covering what was sent, is refused;
    each refusal changes no state, and a cohort member's is logged (within bounds)."""
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    raw, commitment, signature = cohort.upload("a1")

    logged = len(log_entries(fed.ws))
    forged = cohort.upload("a1", signer="a2")  # a2's key signs a1's statement
    err = _refused(fed, coord, SignatureError, coord.masked_input, "a1", 1, 0, *forged)
    assert err.http_status == 401
    # the refusal appended exactly one "refused" entry to the transparency log, nothing else
    (entry,) = log_entries(fed.ws, logged)
    assert entry["kind"] == "refused"
    assert entry["body"] == {
        "round": 1,
        "attempt": 0,
        "stage": "masked_input",
        "member": "a1",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "code": "bad_signature",
        "detail": err.detail,
    }

    other = cohort.upload("a0")  # a genuine statement, but for a0's vector
    _refused(fed, coord, SignatureError, coord.masked_input, "a1", 1, 0, raw, *other[1:])
    _refused(
        fed, coord, SignatureError, coord.masked_input, "a1", 1, 0, other[0], commitment, signature
    )
    swapped = "00" * 32  # the commitment is covered by the signature
    _refused(fed, coord, SignatureError, coord.masked_input, "a1", 1, 0, raw, swapped, signature)
    _refused(fed, coord, SignatureError, coord.masked_input, "a1", 1, 0, raw, commitment, "00" * 64)
    _refused(fed, coord, PayloadError, coord.masked_input, "a1", 1, 0, raw, "ab" * 31, signature)
    _refused(fed, coord, PayloadError, coord.masked_input, "a1", 1, 0, raw, commitment, "zz")
    assert coord.live.session is not None and coord.live.session.contributed == []

    # the member's own statement is still accepted and the round finishes with every input
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS)
    _check_aggregate(fed, cohort, MEMBERS)


# -- resume ----------------------------------------------------------------------------------------


def _session_view(coord: Coordinator) -> tuple[object, ...]:
    live, s = coord.live, coord.live.session
    assert s is not None
    return (
        live.round,
        live.attempt,
        live.stage,
        live.stage_started_at,
        live.spec,
        s.stage,
        {m: (a.enc_public, a.mask_public) for m, a in s.advertised.items()},
        s.live,
        s.shared,
        s.participants,
        sorted(s.contributed),
        s.survivors,
        s.dropped,
        s.answered,
    )


RESTART_POINTS = [
    ("advertise", 2),
    ("share_keys", 0),
    ("share_keys", 3),
    ("masked_input", 0),
    ("masked_input", 2),
    ("consistency", 0),
    ("consistency", 3),
    ("unmask", 0),
    ("unmask", 2),
]


@pytest.mark.parametrize(("stage", "done"), RESTART_POINTS)
def test_restarted_coordinator_finishes_the_round_with_the_same_model(
    tmp_path: Path, clock: FakeClock, stage: str, done: int
) -> None:
    """Two copies of one workspace get the same messages; copy b restarts mid-round."""
    fed = make_federation(tmp_path / "a")
    _, cohort = _start(fed, clock)
    fed.ws.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    spaces = {k: Workspace.open(tmp_path / k) for k in "ab"}
    coords = {k: Coordinator(w, clock=clock) for k, w in spaces.items()}
    restarted = []

    def point(at: str, index: int) -> None:
        if (at, index) != (stage, done):
            return
        before = _session_view(coords["b"])
        spaces["b"].close()
        spaces["b"] = Workspace.open(tmp_path / "b")
        coords["b"] = Coordinator(spaces["b"], clock=clock)
        assert _session_view(coords["b"]) == before
        restarted.append(at)

    def both(method: str, *args: object) -> object:
        answers = [getattr(c, method)(*args) for c in coords.values()]
        if isinstance(answers[0], wire.UnmaskRequestBody | wire.ConsistencyProofBody):
            # the long-poll token is per process (random start), not round state
            answers = [msgspec.structs.replace(a, state_token=None) for a in answers]
        assert answers[0] == answers[1]
        return answers[0]

    for i, m in enumerate(MEMBERS):
        point("advertise", i)
        both("advertise", m, 1, 0, cohort.advertise(m))
    for i, m in enumerate(MEMBERS):
        point("share_keys", i)
        keys = both("key_list", m, 1, 0)
        both("share_keys", m, 1, 0, cohort.share_keys(m, keys))  # type: ignore[arg-type]
    survivors = MEMBERS[:4]
    receipts = {}
    for i, m in enumerate(survivors):
        point("masked_input", i)
        cohort.receive_shares(m, both("share_relay", m, 1, 0))  # type: ignore[arg-type]
        receipts[m] = both("masked_input", m, 1, 0, *cohort.upload(m))
    cohort.receive_shares("a4", both("share_relay", "a4", 1, 0))  # type: ignore[arg-type]
    clock.advance(FAST_ROUND["masked_s"] + FAST_ROUND["open_s"])  # a4 never sends its input
    for c in coords.values():
        c.tick()
    for i, m in enumerate(survivors):
        point("consistency", i)
        if i:  # a retry of an input accepted before the restart gets the same receipt
            last = survivors[i - 1]
            assert coords["b"].receipt(last, 1) == receipts[last]
        request = both("unmask_request", m, 1, 0)
        both("consistency", m, 1, 0, cohort.sign(m, request))  # type: ignore[arg-type]
    for i, m in enumerate(survivors):
        point("unmask", i)
        proof = both("consistency_proof", m, 1, 0)
        both("unmask", m, 1, 0, cohort.unmask(m, proof))  # type: ignore[arg-type]

    assert restarted == [stage]
    fed_b = Federation(spaces["b"], fed.identities)
    for w in spaces.values():
        assert [(r.round, r.attempt, r.stage) for r in w.state.rounds.history()] == [
            (1, 0, "closed"),
            (2, 0, "open"),
        ]
    assert spaces["a"].models.get(2).sha256 == spaces["b"].models.get(2).sha256
    assert spaces["a"].models.read(2) == spaces["b"].models.read(2)
    _check_aggregate(fed_b, cohort, survivors)
    summaries = [_summary(Federation(w, fed.identities), 1, 0) for w in spaces.values()]
    assert summaries[0].dropped == summaries[1].dropped == ["a4"]
    assert summaries[0].survivors == summaries[1].survivors == 4


# -- secure_sum = "none" ---------------------------------------------------------------------------


def test_plain_round_without_secure_summation(tmp_path: Path, clock: FakeClock) -> None:
    fed = make_federation(
        tmp_path / "ws",
        agents=("a0", "a1", "a2"),
        round={"secure_sum": "none", "min_agents": 2, "rounds": 1},
    )
    coord = Coordinator(fed.ws, clock=clock)
    for m in ("a0", "a1", "a2"):
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    assert coord.live.stage == "masked_input"  # no key stages
    spec = coord.live.spec
    assert spec is not None and spec.secure_sum == "none" and spec.neighbors == 0

    quant = QuantSpec(spec.quant_bits, spec.clip_norm, spec.ring_bits)
    too_big = np.zeros(spec.dim + 1, dtype=quant.dtype)
    too_big[3] = quant.levels + 1
    ids = fed.identities
    bad = plain_upload("a0", spec, ids, pack(too_big, spec.ring_bits))
    _refused(fed, coord, BadVector, coord.masked_input, "a0", 1, 0, *bad)
    receipts = {m: coord.masked_input(m, 1, 0, *plain_upload(m, spec, ids)) for m in ("a0", "a1")}
    assert coord.masked_input("a0", 1, 0, *plain_upload("a0", spec, ids)) == receipts["a0"]
    other = plain_upload("a0", spec, ids, plain_input("a1", spec))
    _refused(fed, coord, DuplicateMessage, coord.masked_input, "a0", 1, 0, *other)
    # a restart rebuilds the running plain sum from the stored updates
    running = (coord.live.plain_sum.copy(), coord.live.plain_weight)  # type: ignore[union-attr]
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    assert coord.live.stage == "masked_input" and coord.live.plain_members == ["a0", "a1"]
    np.testing.assert_array_equal(coord.live.plain_sum, running[0])  # type: ignore[arg-type]
    assert coord.live.plain_weight == running[1]
    assert coord.masked_input("a1", 1, 0, *plain_upload("a1", spec, ids)) == receipts["a1"]
    coord.masked_input("a2", 1, 0, *plain_upload("a2", spec, ids))

    assert _rounds(fed) == [(1, 0, "closed", 2)]
    assert coord.finished and coord.live.stage == "closed"
    quantized = [quantized_input(m, spec) for m in ("a0", "a1", "a2")]
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    np.testing.assert_allclose(new, expected_params(old, quantized, spec), rtol=0, atol=1e-6)
    error = (new.astype(np.float64) - old) - float_mean(("a0", "a1", "a2"), spec.dim)
    signal = float_mean(("a0", "a1", "a2"), spec.dim)
    assert np.linalg.norm(error) < 0.5 * np.linalg.norm(signal)
    verify_manifest(fed.ws.models.get(2), fed.ws.signer.public_bytes, fed.ws.models.read(2))
    # the federation finished its one round: nothing more is accepted
    _refused(fed, coord, WrongStage, coord.join, "a0", 2, 0, join_request("a0", 2))


# -- privacy reports -------------------------------------------------------------------------------


_report = privacy_report


def test_privacy_report_is_verified_and_stored_once(fed: Federation, clock: FakeClock) -> None:
    coord = Coordinator(fed.ws, clock=clock)
    ids = fed.identities
    _refused(fed, coord, WrongStage, coord.report, "a0", 1, 0, _report("a0").sign(ids["a0"]))
    for m in MEMBERS:
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()

    good = _report("a0").sign(ids["a0"])
    coord.report("a0", 1, 0, good)
    stored = fed.ws.state.reports.get(1, 0, "a0")
    assert stored is not None
    decoded = msgspec.json.decode(stored, type=wire.PrivacyReport)
    decoded.verify(ids["a0"].public_bytes)
    assert decoded.epsilon == 1.5
    coord.report("a0", 1, 0, good)  # retry: same report, nothing new
    assert len(table_rows(fed.ws, "reports")) == 1

    forged = _report("a1").sign(ids["a2"])
    _refused(fed, coord, SignatureError, coord.report, "a1", 1, 0, forged)
    tampered = msgspec.structs.replace(_report("a1").sign(ids["a1"]), epsilon=0.1)
    _refused(fed, coord, SignatureError, coord.report, "a1", 1, 0, tampered)
    unsigned = _report("a1")
    _refused(fed, coord, SignatureError, coord.report, "a1", 1, 0, unsigned)
    other = _report("a2").sign(ids["a2"])
    _refused(fed, coord, PayloadError, coord.report, "a1", 1, 0, other)
    negative = _report("a1", epsilon=-1.0).sign(ids["a1"])
    _refused(fed, coord, PayloadError, coord.report, "a1", 1, 0, negative)
    changed = _report("a0", epsilon=2.0).sign(ids["a0"])
    _refused(fed, coord, DuplicateMessage, coord.report, "a0", 1, 0, changed)
    earlier = wire.ChargeRecord(0, 1, 1.0, 0.1, 10)
    undeclared_own = _report("a1", unreported=[earlier]).sign(ids["a1"])
    _refused(fed, coord, PayloadError, coord.report, "a1", 1, 0, undeclared_own)
    not_earlier = _report("a1", charge=0, unreported=[earlier]).sign(ids["a1"])
    _refused(fed, coord, PayloadError, coord.report, "a1", 1, 0, not_earlier)
    twice = _report("a1", charge=2, unreported=[earlier, earlier]).sign(ids["a1"])
    _refused(fed, coord, PayloadError, coord.report, "a1", 1, 0, twice)
    declared = _report("a1", charge=1, unreported=[earlier]).sign(ids["a1"])
    coord.report("a1", 1, 0, declared)
    wrong_round = _report("a1", round=2).sign(ids["a1"])
    _refused(fed, coord, WrongStage, coord.report, "a1", 2, 0, wrong_round)
    assert fed.ws.state.reports.epsilons() == {"a0": 1.5, "a1": 1.5}


def test_shares_carry_the_privacy_report_checked_first_and_stored_apart(
    fed: Federation, clock: FakeClock
) -> None:
    coord, cohort = _start(fed, clock)
    ids = fed.identities
    _advertise(coord, cohort, MEMBERS)
    assert coord.live.stage == "share_keys"
    body = {m: cohort.share_keys(m, coord.key_list(m, 1, 0)) for m in MEMBERS}

    def with_report(member: str, report: wire.PrivacyReport) -> wire.ShareKeysBody:
        return msgspec.structs.replace(body[member], report=report)

    # a bad report refuses the whole message: neither the shares nor the report are kept
    forged = with_report("a0", _report("a0").sign(ids["a1"]))
    _refused(fed, coord, SignatureError, coord.share_keys, "a0", 1, 0, forged)
    misnamed = with_report("a0", _report("a1").sign(ids["a1"]))
    _refused(fed, coord, PayloadError, coord.share_keys, "a0", 1, 0, misnamed)

    good = with_report("a0", _report("a0").sign(ids["a0"]))
    coord.share_keys("a0", 1, 0, good)
    coord.share_keys("a0", 1, 0, good)  # an identical retry changes nothing
    # the shares are stored as they would be without the report (archive, resume, audit)
    stored = fed.ws.state.messages.get(1, 0, "share_keys", "a0")
    assert stored == wire.encode(body["a0"]) and b"report" not in stored
    report = fed.ws.state.reports.get(1, 0, "a0")
    assert report is not None
    assert msgspec.json.decode(report, type=wire.PrivacyReport).epsilon == 1.5
    kinds = [msgspec.json.decode(line).get("kind") for _, line in fed.ws.state.log.log_lines()]
    assert kinds.count("privacy_report") == 1

    # a report sent on its own first stands; the shares are not refused for a different one
    coord.report("a1", 1, 0, _report("a1").sign(ids["a1"]))
    coord.share_keys("a1", 1, 0, with_report("a1", _report("a1", epsilon=9.0).sign(ids["a1"])))
    assert fed.ws.state.messages.get(1, 0, "share_keys", "a1") is not None
    assert fed.ws.state.reports.epsilons() == {"a0": 1.5, "a1": 1.5}

    for m in MEMBERS[2:]:
        coord.share_keys(m, 1, 0, with_report(m, _report(m).sign(ids[m])))
    assert coord.live.stage == "masked_input"
    assert set(fed.ws.state.reports.epsilons()) == set(MEMBERS)
    # after the stage closed, the same message is still answered as before
    coord.share_keys("a4", 1, 0, with_report("a4", _report("a4").sign(ids["a4"])))


# -- join checks -----------------------------------------------------------------------------------


def test_join_refuses_another_task_version_or_schema(fed: Federation, clock: FakeClock) -> None:
    coord = Coordinator(fed.ws, clock=clock)
    good = join_request("a0")
    wrong_version = msgspec.structs.replace(good, task_version=good.task_version + ".x")
    wrong_schema = msgspec.structs.replace(good, dataset_schema="0" * 64)
    err = _refused(fed, coord, TaskMismatch, coord.join, "a0", 1, 0, wrong_version)
    assert err.http_status == 409 and "version" in err.detail
    err = _refused(fed, coord, TaskMismatch, coord.join, "a0", 1, 0, wrong_schema)
    assert "schema" in err.detail
    no_data = msgspec.structs.replace(good, samples=0)
    _refused(fed, coord, PayloadError, coord.join, "a0", 1, 0, no_data)
    # SecAgg+: no commitment to a graph nonce, no seat (the graph would be the aggregator's)
    uncommitted = msgspec.structs.replace(good, graph_commitment="")
    err = _refused(fed, coord, PayloadError, coord.join, "a0", 1, 0, uncommitted)
    assert "graph commitment" in err.detail
    _refused(fed, coord, WrongStage, coord.join, "a0", 1, 1, good)
    _refused(fed, coord, WrongStage, coord.join, "a0", 2, 0, good)

    assert coord.join("a0", 1, 0, good) == wire.JoinResponse(accepted=True, detail="joined")
    assert coord.join("a0", 1, 0, good).detail == "already joined"
    assert fed.ws.state.joins.samples(1, 0) == {"a0": 50}


def test_forged_unmask_share_aborts_instead_of_wedging_the_round(
    fed: Federation, clock: FakeClock
) -> None:
    """A survivor answering unmask with a share off the polynomial must not stall rounds."""
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS[:4])
    honest = cohort.unmask("a4", coord.consistency_proof("a4", 1, 0))
    owner, share = sorted(honest.seed_shares.items())[0]
    forged_share = share[:-2] + format(int(share[-2:], 16) ^ 1, "02x")
    forged = wire.UnmaskResponseBody(
        seed_shares={**honest.seed_shares, owner: forged_share}, key_shares=honest.key_shares
    )
    coord.unmask("a4", 1, 0, forged)  # accepted (it is well formed); the sum cannot be formed

    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "aborted"
    assert "inconsistent" in row.detail
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")
    assert fed.ws.models.latest().version == 1
    clock.advance(FAST_ROUND["unmask_s"])
    coord.tick()  # and the clock keeps driving the federation
    assert (coord.live.round, coord.live.attempt) == (1, 1)


# -- refusals in the transparency log --------------------------------------------------------------


def _log_head(fed: Federation) -> tuple[int, str]:
    """(entries, hash of the last one) of the transparency log, the same in the database
    and in the file verifiers read."""
    tail = fed.ws.state.log.log_tail()
    lines = (fed.root / "audit" / "log.jsonl").read_bytes().splitlines()
    assert tail is not None and len(lines) == tail[0] + 1 and lines[-1] == tail[1]
    return len(lines), hashlib.sha256(tail[1]).hexdigest()


def _refused_unlogged(
    fed: Federation, coord: Coordinator, exc: type[FedsecError], *args: object
) -> FedsecError:
    """``masked_input(*args)`` raises ``exc``, changes nothing and writes no log entry."""
    before = _log_head(fed)
    err = _refused(fed, coord, exc, coord.masked_input, *args)
    assert _log_head(fed) == before
    return err


def _refused_logged(
    fed: Federation, coord: Coordinator, exc: type[FedsecError], *args: object
) -> dict[str, object]:
    """``masked_input(*args)`` raises ``exc``, changes nothing but one ``refused`` entry."""
    logged = _log_head(fed)[0]
    err = _refused(fed, coord, exc, coord.masked_input, *args)
    (entry,) = log_entries(fed.ws, logged)
    assert entry["kind"] == "refused" and entry["body"]["code"] == err.code
    assert entry["body"]["detail"] == err.detail and "suppressed" not in entry["body"]
    return dict(entry["body"])


def _verifies(fed: Federation) -> None:
    audit = fed.root / "audit"
    result = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert result.ok, result.problem


def _refused_bodies(fed: Federation, member: str) -> list[dict[str, object]]:
    return [
        e["body"]
        for e in log_entries(fed.ws)
        if e["kind"] == "refused" and e["body"]["member"] == member
    ]


def _unlogged_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().rsplit("reason=", 1)[1]
        for r in caplog.records
        if r.getMessage().startswith("event=refusal_not_logged")
    ]


def test_refusals_for_made_up_rounds_or_from_outside_the_cohort_are_not_logged(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    fed = make_federation(tmp_path / "ws", agents=(*MEMBERS, "a5"), round={"max_agents": 5})
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.coordinator")
    coord = Coordinator(fed.ws, clock=clock)
    junk = (b"\x00" * 16, "00" * 32, "00" * 64)
    # attempt 1/0 exists but has no cohort yet
    _refused_unlogged(fed, coord, WrongStage, "a1", 1, 0, *junk)
    for m in MEMBERS:  # the fifth join fills the cohort: a5 is left out
        coord.join(m, 1, 0, join_request(m, 1))
    assert coord.live.spec is not None and coord.live.spec.cohort == list(MEMBERS)
    cohort = Cohort(coord.live.spec, fed.identities)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    upload = cohort.upload("a1")

    # made-up rounds and attempts, out-of-range numbers included: the same answer, no entry
    made_up = [(2, 0), (99, 0), (1, 1), (1, 7), (0, 0), (-1, 0), (1, -1), (MAX_ID,) * 2]
    for r, a in made_up:
        err = _refused_unlogged(fed, coord, WrongStage, "a1", r, a, *upload)
        assert f"round {r} attempt {a}" in err.detail
    # a5 is enrolled but not in the cohort: refused as before, with or without its own bytes
    err = _refused_unlogged(fed, coord, UnknownMember, "a5", 1, 0, *upload)
    assert err.http_status == 403 and "a5 is not in the cohort" in err.detail
    _refused_unlogged(fed, coord, UnknownMember, "a5", 1, 0, *junk)
    assert _unlogged_reasons(caplog) == [
        "no_cohort",
        *["no_such_attempt"] * 8,
        "not_in_cohort",
        "not_in_cohort",
    ]

    # the round finishes with every input and no refused entry, aggregate or other
    _masked(coord, cohort, MEMBERS)
    _unmask(coord, cohort, MEMBERS)
    _check_aggregate(fed, cohort, MEMBERS)
    # a5 stays outside the closed attempt too
    _refused_unlogged(fed, coord, WrongStage, "a5", 1, 0, *upload)
    assert [e for e in log_entries(fed.ws) if e["kind"] == "refused"] == []
    _verifies(fed)


def test_a_members_repeated_refusals_are_capped_then_aggregated_at_close(
    fed: Federation, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedsec.aggregator.coordinator")
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS)
    _share(coord, cohort, MEMBERS)
    _fetch_shares(coord, cohort, MEMBERS)
    raw, commitment, signature = cohort.upload("a1")

    def tampered(i: int) -> tuple[bytes, str, str]:
        """a1's genuine statement over bytes it did not sign: one distinct refusal each."""
        changed = bytearray(raw)
        changed[i] ^= 1
        return bytes(changed), commitment, signature

    assert REFUSED_ENTRIES_PER_ATTEMPT == 4
    logged = [
        _refused_logged(fed, coord, SignatureError, "a1", 1, 0, *tampered(i)) for i in range(4)
    ]
    assert [b["sha256"] for b in logged] == [
        hashlib.sha256(tampered(i)[0]).hexdigest() for i in range(4)
    ]
    # an identical retry is not logged again, before or after the cap is reached
    _refused_unlogged(fed, coord, SignatureError, "a1", 1, 0, *tampered(0))
    for i in range(4, 7):  # over the cap: counted, not logged
        _refused_unlogged(fed, coord, SignatureError, "a1", 1, 0, *tampered(i))
    last = _refused_unlogged(fed, coord, PayloadError, "a1", 1, 0, raw, commitment, "zz")
    assert _unlogged_reasons(caplog) == ["repeat", "over_cap", "over_cap", "over_cap", "over_cap"]
    # another member's budget is its own
    _refused_logged(fed, coord, SignatureError, "a2", 1, 0, *cohort.upload("a2", signer="a3"))
    assert len(_refused_bodies(fed, "a1")) == 4

    _masked(coord, cohort, MEMBERS)  # the refusals left a1 free to contribute
    _unmask(coord, cohort, MEMBERS)
    _check_aggregate(fed, cohort, MEMBERS)

    # at the close, one entry aggregates a1's five unlogged refusals, signed by the close's head
    entries = log_entries(fed.ws)
    refused = [e for e in entries if e["kind"] == "refused" and e["body"]["member"] == "a1"]
    assert [e["body"] for e in refused[:4]] == logged
    aggregate = refused[4]
    assert aggregate["body"] == {
        "round": 1,
        "attempt": 0,
        "stage": "masked_input",
        "member": "a1",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "code": last.code,
        "detail": last.detail,
        "suppressed": 5,
        "codes": {"bad_request": 1, "bad_signature": 4},
    }
    closing = next(e for e in entries if e["kind"] == "aggregate")
    head = next(e for e in entries if e["kind"] == "head" and e["index"] > closing["index"])
    assert aggregate["index"] < closing["index"] < head["index"]
    assert len(_refused_bodies(fed, "a2")) == 1  # nothing suppressed: no aggregate entry

    # after its aggregate entry, the member's refusals for that attempt are not logged
    _refused_unlogged(fed, coord, WrongStage, "a1", 1, 0, *tampered(9))
    assert _unlogged_reasons(caplog)[-1] == "aggregated"
    _verifies(fed)
    # the report counts every refusal the log records: a1's 4 + 5, a2's 1
    (row,) = summarize(read_entries(fed.root / "audit" / "log.jsonl")[0]).rounds.values()
    assert (row.round, row.attempt, row.refused, row.accepted) == (1, 0, 10, 5)


def test_refusals_for_an_aborted_attempt_stay_bounded_across_a_restart(
    fed: Federation, clock: FakeClock
) -> None:
    coord, cohort = _start(fed, clock)
    _advertise(coord, cohort, MEMBERS[:3])
    clock.advance(ADVERTISE_DEADLINE)
    coord.tick()
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")

    def upload(i: int) -> tuple[bytes, str, str]:
        return bytes([i]) * 16, "00" * 32, "00" * 64

    # a0 was in the cohort of the aborted attempt 1/0: its late inputs are logged, up to the cap
    for i in range(4):
        body = _refused_logged(fed, coord, WrongStage, "a0", 1, 0, *upload(i))
        assert (body["round"], body["attempt"], body["member"]) == (1, 0, "a0")
    _refused_unlogged(fed, coord, WrongStage, "a0", 1, 0, *upload(4))

    # a restart rebuilds the budget from the log: no fresh entries for a0 in 1/0
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    _refused_unlogged(fed, coord, WrongStage, "a0", 1, 0, *upload(0))
    _refused_unlogged(fed, coord, WrongStage, "a0", 1, 0, *upload(5))
    assert len(_refused_bodies(fed, "a0")) == 4

    # the next abort (of attempt 1/1) aggregates what was counted since the restart
    for m in MEMBERS:
        coord.join(m, 1, 1, join_request(m, 1))
    assert coord.live.stage == "advertise"
    clock.advance(ADVERTISE_DEADLINE)
    coord.tick()
    assert (coord.live.round, coord.live.attempt) == (1, 2)
    entries = log_entries(fed.ws)
    aggregate = next(e for e in entries if "suppressed" in e["body"])
    assert aggregate["kind"] == "refused"
    assert (aggregate["body"]["round"], aggregate["body"]["attempt"]) == (1, 0)
    assert aggregate["body"]["suppressed"] == 2
    assert aggregate["body"]["codes"] == {"wrong_stage": 2}
    aborted = [e for e in entries if e["kind"] == "round_aborted"]
    assert [e["body"]["attempt"] for e in aborted] == [0, 1]
    assert aborted[0]["index"] < aggregate["index"] < aborted[1]["index"]
    _refused_unlogged(fed, coord, WrongStage, "a0", 1, 0, *upload(6))
    _verifies(fed)
