"""The summation-session interface: every mode passes the same tests.

Each test drives a session only through :class:`SummationSession` (receive, complete,
close, finalize, replay, stage data), with real member-side messages: real SecAgg+
``ClientSession``s for ``secagg``, packed quantized updates for ``none``, real CKKS
ciphertexts, commitments and a custodian's signed decryption for ``he``.  A new mode
joins the parametrization (every mode of :data:`fedsec.summation.MODES`) with a driver
for its member side.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable

import numpy as np
import pytest

from fedsec.crypto import he
from fedsec.crypto.quantize import default_ring_bits, dequantize_one
from fedsec.crypto.secagg import MaskedInput, default_neighbors
from fedsec.errors import DuplicateMessage, ProtocolError, RoundAborted, UnknownMember
from fedsec.protocol import codec, wire
from fedsec.protocol.he_release import frame as frame_decryption
from fedsec.summation import (
    MODES,
    SessionInputs,
    StoredAttempt,
    StoredMessage,
    SummationResult,
    SummationSession,
    open_session,
    replay,
)
from fedsec.summation.he import HeSession, ciphertext_commitment
from fedsec.summation.plain import PlainSession
from fedsec.summation.secagg import SecAggPlusSession
from fedsec.summation.session import StageMessage, decode_decryption
from tests.support.aggregator import (
    Cohort,
    he_commit_body,
    identity_for,
    plain_input,
    quantized_input,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
DIM = 12
MIN_AGENTS = 3
CUSTODIAN = "kh"
HE_PARAMS = he.HeParams()  # [he]'s defaults
SESSIONS = {"secagg": SecAggPlusSession, "none": PlainSession, "he": HeSession}


@functools.cache
def _he_keys() -> tuple[bytes, bytes]:
    """(secret, public) context bytes of the custodian, made once."""
    return he.generate_keys(HE_PARAMS)


def _spec(secure_sum: str, cohort: tuple[str, ...] = MEMBERS) -> wire.RoundSpec:
    k, t = default_neighbors(len(cohort)) if secure_sum == "secagg" else (0, 0)
    decrypts = MODES[secure_sum].custodian_decrypts
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
        he_context_sha256=hashlib.sha256(_he_keys()[1]).hexdigest() if decrypts else "",
        custodian=CUSTODIAN if decrypts else "",
    )


class Members:
    """The member side of one attempt: each member's message for a stage, from the
    stage data the session relays (as the HTTP layer would hand it over)."""

    def __init__(self, spec: wire.RoundSpec) -> None:
        self.spec = spec
        self.identities = {m: identity_for(m) for m in (*spec.cohort, CUSTODIAN)}
        self.cohort = Cohort(spec, self.identities) if spec.secure_sum == "secagg" else None
        self.stored: list[StoredMessage] = []  # as accepted
        self.he = spec.secure_sum == "he"
        secret, public = _he_keys()
        self.public = he.load_public_context(public, HE_PARAMS, HE_PARAMS.context_max_bytes(False))
        self.secret = he.load_secret_context(secret, HE_PARAMS, HE_PARAMS.context_max_bytes(True))
        self.ciphertexts: dict[str, bytes] = {}

    def inputs(self) -> SessionInputs:
        keys = {m: i.public_bytes for m, i in self.identities.items()}
        sha = self.spec.he_context_sha256
        return SessionInputs(keys, MIN_AGENTS, self.public if self.he else None, sha)

    def session(self) -> SummationSession:
        return open_session(self.spec, self.inputs())

    def answering(self, stage: str, members: Iterable[str]) -> list[str]:
        """Who sends a message in ``stage``: the custodian alone decrypts."""
        return [CUSTODIAN] if stage == "decrypt" else list(members)

    def message(self, session: SummationSession, stage: str, member: str) -> StageMessage:
        """``member``'s message for ``stage``, recording what would be stored."""
        c = self.cohort
        if self.he and stage != "masked_input":
            return self._he_message(session, stage, member)
        if stage == "masked_input":
            if self.he:
                raw = self._ciphertext(member)
            elif c is None:
                raw = plain_input(member, self.spec)
            else:
                c.receive_shares(member, session.share_relay(member))
                raw = c.masked_input(member)
            self.stored.append(StoredMessage(stage, member, raw))
            return MaskedInput(member, raw)
        assert c is not None, f"a plain round has no {stage} stage"
        if stage == "advertise":
            adv = c.advertise(member)
            self.stored.append(StoredMessage(stage, member, wire.encode(adv)))
            return codec.advertise_message(member, adv)
        if stage == "share_keys":
            shares = c.share_keys(member, session.key_list(member))
            self.stored.append(StoredMessage(stage, member, wire.encode(shares)))
            return codec.share_keys_message(member, shares)
        if stage == "consistency":
            signed = c.sign(member, session.unmask_request(member, state_token=7))
            self.stored.append(StoredMessage(stage, member, wire.encode(signed)))
            return codec.consistency_message(member, signed)
        answer = c.unmask(member, session.consistency_proof(member, state_token=7))
        self.stored.append(StoredMessage(stage, member, wire.encode(answer)))
        return codec.unmask_message(member, answer)

    def _ciphertext(self, member: str) -> bytes:
        """``member``'s CKKS ciphertexts of its quantized update, encrypted once."""
        if member not in self.ciphertexts:
            q = quantized_input(member, self.spec).astype(np.float64)
            self.ciphertexts[member] = he.frame_chunks(he.encrypt(self.public, q))
        return self.ciphertexts[member]

    def _he_message(self, session: SummationSession, stage: str, member: str) -> StageMessage:
        """he: a member's commitment, or the custodian's decryption of the offered sum."""
        spec = self.spec
        if stage == "commit":
            body = he_commit_body(member, spec, self.identities[member], self._ciphertext(member))
            self.stored.append(StoredMessage(stage, member, wire.encode(body)))
            return ciphertext_commitment(spec, member, body)
        assert stage == "decrypt" and isinstance(session, HeSession)
        offer = session.offer(log_index=0)
        total = he.CiphertextSum(self.public, HE_PARAMS, spec.dim + 1)
        for m in offer.contributors:
            total.add(he.unframe_chunks(self.ciphertexts[m], HE_PARAMS, spec.dim + 1))
        values = he.decrypt_sum(self.secret, total.serialize(), spec.dim + 1)
        clear = np.rint(values).astype("<i8").tobytes()
        statement = wire.DecryptionStatement(
            federation_id=spec.federation_id,
            round=spec.round,
            attempt=spec.attempt,
            custodian=CUSTODIAN,
            contributors=offer.contributors,
            sum_sha256=offer.sum_sha256,
            plaintext_sha256=hashlib.sha256(clear).hexdigest(),
        ).sign(self.identities[CUSTODIAN])
        raw = frame_decryption(statement, clear)
        self.stored.append(StoredMessage(stage, member, raw))
        return decode_decryption(member, raw, 1 << 20)


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
        for member in members.answering(stage, send):
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
    assert isinstance(session, SESSIONS[mode])
    assert session.stages == MODES[mode].stages
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


def test_every_mode_sums_the_same_inputs_to_the_same_result() -> None:
    results = {}
    for mode in MODES:
        members = Members(_spec(mode))
        results[mode] = _run(members.session(), members)
    plain = results["none"]
    for mode, result in results.items():
        np.testing.assert_allclose(result.weighted_sum, plain.weighted_sum, rtol=0, atol=1e-9)
        assert result.weight_sum == pytest.approx(plain.weight_sum, abs=1e-9), mode
        assert (result.survivors, result.dropped) == (plain.survivors, plain.dropped), mode
    # the ring sum SecAgg+ unmasks and the one the custodian decrypts are the same bytes
    assert results["he"].sum_sha256 == results["secagg"].sum_sha256


def test_a_stage_is_complete_once_every_expected_member_answered(mode: str) -> None:
    members = Members(_spec(mode))
    session = members.session()
    for stage in session.stages:
        for member in members.answering(stage, MEMBERS):
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
        for member in members.answering(stage, MEMBERS):
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


def test_the_modes_replay_recomputes_the_sum_from_the_stored_messages(mode: str) -> None:
    """``replay``: what crash resume, ``fedsec audit verify`` and the custodian call."""
    spec = _spec(mode)
    members = Members(spec)
    result = _run(members.session(), members, lost_at={"a4": "masked_input"})
    again = replay(spec, StoredAttempt(members.inputs(), list(members.stored)))
    assert again.sum_sha256 == result.sum_sha256
    assert (again.survivors, again.dropped) == (result.survivors, result.dropped)
    np.testing.assert_array_equal(again.weighted_sum, result.weighted_sum)
    assert again.weight_sum == result.weight_sum


def test_replay_refuses_an_altered_stored_message_by_its_stage_and_member(mode: str) -> None:
    spec = _spec(mode)
    members = Members(spec)
    _run(members.session(), members)
    stored = list(members.stored)
    at = next(i for i, m in enumerate(stored) if m.stage == "masked_input" and m.member == "a1")
    stored[at] = stored[at]._replace(raw=stored[at].raw[:-8])  # truncated
    with pytest.raises(ProtocolError, match="stored masked_input message from a1 no longer"):
        replay(spec, StoredAttempt(members.inputs(), stored))


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


def test_replay_refuses_a_message_of_a_stage_already_closed(mode: str) -> None:
    """Stages never interleave in the log: a message after a later stage's is refused."""
    spec = _spec(mode)
    members = Members(spec)
    _run(members.session(), members)
    first, last = members.stored[0], members.stored[-1]
    if first.stage == last.stage:  # a one-stage mode: every order is its order
        return
    late = [*members.stored, first]  # the first stage's message again, after the last's
    with pytest.raises(ProtocolError, match=f"stored {first.stage} message from {first.member}"):
        replay(spec, StoredAttempt(members.inputs(), late))
