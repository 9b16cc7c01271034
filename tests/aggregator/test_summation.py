"""The summation-session interface: every mode passes the same tests.

Each test drives a session only through :class:`SummationSession` (receive, complete,
close, finalize, replay, stage data), with real member-side messages: real SecAgg+
``ClientSession``s for ``secagg``, packed quantized updates for ``none``.  A new mode
joins the parametrization with a driver for its member side.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

import numpy as np
import pytest

from fedsec.aggregator.summation import (
    PlainSession,
    SecAggPlusSession,
    StageMessage,
    SummationResult,
    SummationSession,
    open_session,
)
from fedsec.crypto.quantize import default_ring_bits, dequantize_one
from fedsec.crypto.secagg import MaskedInput, default_neighbors
from fedsec.errors import DuplicateMessage, RoundAborted, UnknownMember
from fedsec.protocol import codec, wire
from tests.support.aggregator import Cohort, identity_for, plain_input, quantized_input

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
DIM = 12
MIN_AGENTS = 3
MODES = ("secagg", "none")


def _spec(secure_sum: str, cohort: tuple[str, ...] = MEMBERS) -> wire.RoundSpec:
    k, t = default_neighbors(len(cohort)) if secure_sum == "secagg" else (0, 0)
    return wire.RoundSpec(
        federation_id="fed-summation",
        round=3,
        attempt=1,
        secure_sum=secure_sum,  # type: ignore[arg-type]
        model_version=1,
        model_sha256="00" * 32,
        task="breast_cancer",
        task_version="1",
        schema_fingerprint="00" * 32,
        cohort=list(cohort),
        neighbors=k,
        threshold=t,
        quant_bits=8,
        ring_bits=default_ring_bits(8, len(cohort)),
        clip_norm=1.0,
        dim=DIM,
        seed=hashlib.sha256(b"summation-test").hexdigest(),
        max_weight_samples=100,
        weight_caps={},
        training=wire.TrainingSpec(local_epochs=1, batch_size=8, lr=0.1, optimizer="sgd"),
        dp=wire.DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5),
        deadlines={},
    )


class Members:
    """The member side of one attempt: each member's message for a stage, from the
    stage data the session relays (as the HTTP layer would hand it over)."""

    def __init__(self, spec: wire.RoundSpec) -> None:
        self.spec = spec
        self.identities = {m: identity_for(m) for m in spec.cohort}
        self.cohort = Cohort(spec, self.identities) if spec.secure_sum == "secagg" else None
        self.stored: list[tuple[str, str, bytes]] = []  # (stage, member, raw) as accepted

    def session(self) -> SummationSession:
        keys = {m: i.public_bytes for m, i in self.identities.items()}
        return open_session(self.spec, keys, MIN_AGENTS)

    def message(self, session: SummationSession, stage: str, member: str) -> StageMessage:
        """``member``'s message for ``stage``, recording what would be stored."""
        c = self.cohort
        if stage == "masked_input":
            if c is None:
                raw = plain_input(member, self.spec)
            else:
                c.receive_shares(member, session.share_relay(member))
                raw = c.masked_input(member)
            self.stored.append((stage, member, raw))
            return MaskedInput(member, raw)
        assert c is not None, f"a plain round has no {stage} stage"
        if stage == "advertise":
            adv = c.advertise(member)
            self.stored.append((stage, member, wire.encode(adv)))
            return codec.advertise_message(member, adv)
        if stage == "share_keys":
            shares = c.share_keys(member, session.key_list(member))
            self.stored.append((stage, member, wire.encode(shares)))
            return codec.share_keys_message(member, shares)
        if stage == "consistency":
            signed = c.sign(member, session.unmask_request(member, state_token=7))
            self.stored.append((stage, member, wire.encode(signed)))
            return codec.consistency_message(member, signed)
        answer = c.unmask(member, session.consistency_proof(member, state_token=7))
        self.stored.append((stage, member, wire.encode(answer)))
        return codec.unmask_message(member, answer)


def _run(
    session: SummationSession,
    members: Members,
    send: Iterable[str] = MEMBERS,
    *,
    lost_at: dict[str, str] | None = None,
) -> SummationResult:
    """Every stage: each member in ``send`` answers unless it was lost at that stage or
    before (``lost_at``: member -> stage); close each stage; finalize the last."""
    lost: set[str] = set()
    for stage in session.stages:
        lost |= {m for m, s in (lost_at or {}).items() if s == stage}
        for member in send:
            if member not in lost:
                session.receive(stage, members.message(session, stage, member))
        if session.next_stage(stage) is None:
            return session.finalize()
        session.close(stage)
    raise AssertionError("a session has at least one stage")


def _expected(spec: wire.RoundSpec, members: Iterable[str]) -> tuple[np.ndarray, float]:
    """Σ w·Δ and Σ w of those members' quantized updates, decoded one by one."""
    total, weight = np.zeros(DIM), 0.0
    for m in members:
        update, w = dequantize_one(quantized_input(m, spec), spec.quant_spec())
        total, weight = total + update, weight + w
    return total, weight


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_each_mode_has_its_session(mode: str) -> None:
    members = Members(_spec(mode))
    session = members.session()
    assert isinstance(session, SecAggPlusSession if mode == "secagg" else PlainSession)
    assert session.stages[-1] == ("masked_input" if mode == "none" else "unmask")
    assert session.next_stage(session.stages[-1]) is None
    for earlier, later in zip(session.stages, session.stages[1:], strict=False):
        assert session.next_stage(earlier) == later


def test_the_sum_of_every_member_is_exact(mode: str) -> None:
    spec = _spec(mode)
    members = Members(spec)
    result = _run(members.session(), members)
    total, weight = _expected(spec, MEMBERS)
    assert result.survivors == sorted(MEMBERS) and result.dropped == []
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)
    assert result.weight_sum == pytest.approx(weight, abs=1e-9)
    assert len(result.sum_sha256) == 64


def test_both_modes_sum_the_same_inputs_to_the_same_result() -> None:
    results = {}
    for mode in MODES:
        members = Members(_spec(mode))
        results[mode] = _run(members.session(), members)
    secure, plain = results["secagg"], results["none"]
    np.testing.assert_allclose(secure.weighted_sum, plain.weighted_sum, rtol=0, atol=1e-9)
    assert secure.weight_sum == pytest.approx(plain.weight_sum, abs=1e-9)
    assert secure.survivors == plain.survivors and secure.dropped == plain.dropped


def test_a_stage_is_complete_once_every_expected_member_answered(mode: str) -> None:
    members = Members(_spec(mode))
    session = members.session()
    for stage in session.stages:
        for member in MEMBERS:
            assert not session.complete(stage)
            session.receive(stage, members.message(session, stage, member))
        assert session.complete(stage)
        if session.next_stage(stage) is not None:
            session.close(stage)
    assert session.participant_count() == len(MEMBERS)


def test_a_member_lost_before_its_contribution_is_left_out_of_the_sum(mode: str) -> None:
    spec = _spec(mode)
    members = Members(spec)
    result = _run(members.session(), members, lost_at={"a2": "masked_input"})
    kept = [m for m in MEMBERS if m != "a2"]
    total, weight = _expected(spec, kept)
    assert result.survivors == kept and result.dropped == ["a2"]
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)
    assert result.weight_sum == pytest.approx(weight, abs=1e-9)


def test_too_few_contributions_abort_instead_of_summing(mode: str) -> None:
    members = Members(_spec(mode))
    lost = dict.fromkeys(("a1", "a2", "a3", "a4"), "masked_input")
    with pytest.raises(RoundAborted):
        _run(members.session(), members, lost_at=lost)


def test_a_second_contribution_is_refused_and_changes_nothing(mode: str) -> None:
    spec = _spec(mode)
    members = Members(spec)
    session = members.session()
    again = MaskedInput("a0", plain_input("a1", spec) if mode == "none" else os.urandom(8))
    result = None
    for stage in session.stages:
        for member in MEMBERS:
            session.receive(stage, members.message(session, stage, member))
            if (stage, member) == ("masked_input", "a1"):
                with pytest.raises(DuplicateMessage):
                    session.receive(stage, again)
                assert not session.complete(stage)
        if session.next_stage(stage) is None:
            result = session.finalize()
        else:
            session.close(stage)
    assert result is not None and result.survivors == sorted(MEMBERS)
    total, weight = _expected(spec, MEMBERS)  # a0 counted once
    np.testing.assert_allclose(result.weighted_sum, total, rtol=0, atol=1e-9)
    assert result.weight_sum == pytest.approx(weight, abs=1e-9)


def test_replaying_the_stored_messages_rebuilds_the_same_sum(mode: str) -> None:
    """What crash resume relies on: stored bytes fed back give the same session."""
    members = Members(_spec(mode))
    result = _run(members.session(), members, lost_at={"a4": "masked_input"})
    rebuilt = members.session()
    for stage in rebuilt.stages:
        for s, member, raw in members.stored:
            if s == stage:
                rebuilt.replay(stage, member, raw)
        assert rebuilt.complete(stage) or stage == "masked_input"
        if rebuilt.next_stage(stage) is None:
            break
        rebuilt.close(stage)
    again = rebuilt.finalize()
    assert again.sum_sha256 == result.sum_sha256
    assert (again.survivors, again.dropped) == (result.survivors, result.dropped)
    np.testing.assert_array_equal(again.weighted_sum, result.weighted_sum)
    assert again.weight_sum == result.weight_sum


def test_stage_data_is_refused_to_a_member_outside_the_stage(mode: str) -> None:
    members = Members(_spec(mode))
    session = members.session()
    with pytest.raises(UnknownMember, match="not a live member of round 3"):
        session.key_list("a0")  # nobody is live before advertise closes
    with pytest.raises(UnknownMember, match="not a participant of round 3"):
        session.share_relay("a0")
    with pytest.raises(UnknownMember, match="not a survivor of round 3"):
        session.unmask_request("a0", state_token=1)
    with pytest.raises(UnknownMember, match="did not sign the survivor sets of round 3"):
        session.consistency_proof("a0", state_token=1)
    _run(session, members)
    with pytest.raises(UnknownMember):
        session.share_relay("outsider")
    with pytest.raises(UnknownMember):
        session.unmask_request("outsider", state_token=1)
