"""Homomorphic summation (``secure_sum = "he"``) on the aggregator, with real TenSEAL.

The coordinator is driven directly with a fake clock: the key custodian publishes the
public CKKS context, members upload CKKS ciphertexts of exactly the quantized vectors a
plain round uploads, the aggregator adds them unopened, and the custodian's decryption
of the sum closes the round with the model SecAgg+ would produce from the same vectors,
bit for bit.  Every refused request is checked for its error and for changing nothing.
The six endpoints of the mode are then called over HTTP with their roles enforced.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.workspace import Workspace
from fedsec.audit.verify import verify_log
from fedsec.crypto import he
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    BadVector,
    CryptoError,
    DuplicateMessage,
    FedsecError,
    ForbiddenError,
    IntegrityError,
    NotFound,
    PayloadError,
    ProtocolError,
    SignatureError,
    UnknownMember,
    WrongStage,
)
from fedsec.protocol import wire
from fedsec.protocol.he_release import frame as frame_decryption
from fedsec.summation.he import HeSession
from tests.support.aggregator import (
    FAST_ROUND,
    FED,
    FakeClock,
    Federation,
    Upload,
    expected_params,
    he_commit_body,
    join_request,
    log_entries,
    make_federation,
    model_params,
    plain_upload,
    quantized_input,
    snapshot,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
CUSTODIAN = "kh"
PARAMS = he.HeParams()  # [he]'s defaults: N = 8192, moduli [60, 60], scale 2^40
MASKED_DEADLINE = FAST_ROUND["masked_s"] + FAST_ROUND["open_s"]
DECRYPT_S = 5.0


@pytest.fixture(scope="module")
def keys() -> tuple[bytes, bytes]:
    """(secret, public) context bytes of the custodian, made once for the module."""
    return he.generate_keys(PARAMS)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def he_federation(
    root: Path, *, custodians: tuple[str, ...] = (CUSTODIAN,), readers: bool = False, **extra: Any
) -> Federation:
    """Five agents, the custodian ``kh`` (and ``custodians``), min_agents 3; ``readers``
    also enrols the observer ``obs`` and the auditor ``aud``."""
    return make_federation(
        root,
        MEMBERS,
        custodians=custodians,
        observers=("obs",) if readers else (),
        auditors=("aud",) if readers else (),
        round={"secure_sum": "he", "min_agents": 3, "decrypt_s": DECRYPT_S, **extra},
        sections={"he": {"custodian": CUSTODIAN}},
    )


def context_message(
    public: bytes, signer: SigningIdentity, *, context: bytes | None = None, **changes: Any
) -> wire.HeContext:
    """The custodian's publication of ``public`` (``context`` replaces the bytes sent)."""
    fields: dict[str, Any] = {
        "federation_id": FED,
        "custodian": CUSTODIAN,
        "poly_modulus_degree": PARAMS.poly_modulus_degree,
        "coeff_mod_bit_sizes": list(PARAMS.coeff_mod_bit_sizes),
        "scale_bits": PARAMS.scale_bits,
        "context_sha256": hashlib.sha256(public).hexdigest(),
        **changes,
    }
    statement = wire.HeContextStatement(**fields).sign(signer)
    sent = public if context is None else context
    return wire.HeContext(statement=statement, context=base64.b64encode(sent).decode())


class HeMembers:
    """The members' and the custodian's side of one he attempt: each member's upload is
    encrypted once (CKKS encryption is randomised), so a retry is byte-identical."""

    def __init__(
        self,
        spec: wire.RoundSpec,
        identities: Mapping[str, SigningIdentity],
        keys: tuple[bytes, bytes],
    ) -> None:
        self.spec = spec
        self.identities = identities
        self.public = he.load_public_context(keys[1], PARAMS, PARAMS.context_max_bytes(False))
        self.secret = he.load_secret_context(keys[0], PARAMS, PARAMS.context_max_bytes(True))
        self.raw: dict[str, bytes] = {}
        self.bound = ""  # the commitment set's digest the statements bind

    def commit(self, coord: Coordinator, who: tuple[str, ...] = MEMBERS) -> None:
        """Each of ``who`` commits to its ciphertext; once commit closed, the set's
        digest is read as a member reads it."""
        r, a = self.spec.round, self.spec.attempt
        for m in who:
            coord.commit(m, r, a, self.commit_body(m))
        if coord.live.stage == "masked_input":
            shown = coord.commitment_set(who[0], r, a)
            self.bound = wire.commitments_digest(
                (c.member, c.vector_sha256) for c in shown.commitments
            )

    def commit_body(self, member: str, raw: bytes | None = None) -> wire.CommitBody:
        return he_commit_body(member, self.spec, self.identities[member], raw or self.body(member))

    def body(self, member: str) -> bytes:
        if member not in self.raw:
            q = quantized_input(member, self.spec)
            self.raw[member] = he.frame_chunks(he.encrypt(self.public, q.astype(np.float64)))
        return self.raw[member]

    def upload(self, member: str, raw: bytes | None = None) -> Upload:
        """(raw, commitment, signature): the statement over sha256(raw), the commitment
        over the quantized vector, as the member's agent makes them."""
        return plain_upload(
            member,
            self.spec,
            self.identities,
            raw or self.body(member),
            commitments_sha256=self.bound,
        )

    def sum_of(self, members: list[str]) -> list[bytes]:
        total = he.CiphertextSum(self.public, PARAMS, self.spec.dim + 1)
        for m in members:
            total.add(he.unframe_chunks(self.raw[m], PARAMS, self.spec.dim + 1))
        return total.serialize()

    def plaintext(self, members: list[str]) -> bytes:
        values = he.decrypt_sum(self.secret, self.sum_of(members), self.spec.dim + 1)
        ints = np.rint(values)
        assert np.abs(values - ints).max() < 0.25
        return ints.astype("<i8").tobytes()

    def decryption(
        self,
        offer: wire.HeSumOffer,
        *,
        plaintext: bytes | None = None,
        signer: str = CUSTODIAN,
        **changes: Any,
    ) -> bytes:
        """The custodian's framed decryption of ``offer`` (``changes`` alter the statement
        after the plaintext is computed; ``plaintext`` replaces the bytes sent)."""
        clear = self.plaintext(offer.contributors)
        fields: dict[str, Any] = {
            "federation_id": offer.federation_id,
            "round": offer.round,
            "attempt": offer.attempt,
            "custodian": CUSTODIAN,
            "contributors": offer.contributors,
            "sum_sha256": offer.sum_sha256,
            "plaintext_sha256": hashlib.sha256(clear).hexdigest(),
            **changes,
        }
        statement = wire.DecryptionStatement(**fields).sign(self.identities[signer])
        return frame_decryption(statement, clear if plaintext is None else plaintext)


def _publish(fed: Federation, coord: Coordinator, keys: tuple[bytes, bytes]) -> None:
    assert coord.publish_he_context(CUSTODIAN, context_message(keys[1], fed.identities[CUSTODIAN]))


def _start(
    fed: Federation, clock: FakeClock, keys: tuple[bytes, bytes], members: tuple[str, ...] = MEMBERS
) -> tuple[Coordinator, HeMembers]:
    """A coordinator with the context published, round 1's cohort fixed and every
    member's commitment taken (the attempt in masked_input)."""
    coord = Coordinator(fed.ws, clock=clock)
    _publish(fed, coord, keys)
    for m in members:
        assert coord.join(m, 1, 0, join_request()).accepted
    coord.tick()
    assert coord.live.stage == "commit" and coord.live.spec is not None
    he_members = HeMembers(coord.live.spec, fed.identities, keys)
    he_members.commit(coord, members)
    assert coord.live.stage == "masked_input"
    return coord, he_members


def _upload_all(coord: Coordinator, members: HeMembers, who: tuple[str, ...]) -> None:
    r, a = coord.live.round, coord.live.attempt
    for m in who:
        coord.masked_input(m, r, a, *members.upload(m))


def _he_view(coord: Coordinator) -> tuple[Any, ...]:
    s = coord.live.summation
    assert isinstance(s, HeSession)
    return tuple(s.members), s.contributors, s.sum_sha256, s.decryption


def _refused(
    fed: Federation, coord: Coordinator, exc: type[FedsecError], call: Any, *args: Any
) -> FedsecError:
    """``call(*args)`` raises ``exc`` (a 4xx) and changes neither the store, the log nor
    the homomorphic sum."""
    before = (snapshot(fed.ws, coord), _he_view(coord), len(log_entries(fed.ws)))
    with pytest.raises(exc) as info:
        call(*args)
    assert type(info.value) is exc and info.value.detail
    assert 400 <= info.value.http_status < 500
    after_log = [e["kind"] for e in log_entries(fed.ws, before[2])]
    assert after_log in ([], ["refused"])  # a refused upload is logged, nothing else
    assert (snapshot(fed.ws, coord), _he_view(coord)) == before[:2]
    return info.value


def _kinds(fed: Federation) -> list[str]:
    return [e["kind"] for e in log_entries(fed.ws)]


# -- a whole round ---------------------------------------------------------------------------------


def test_he_round_closes_with_the_exact_model_of_the_same_quantized_vectors(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    fed = he_federation(tmp_path / "ws")
    coord = Coordinator(fed.ws, clock=clock)
    with pytest.raises(NotFound):
        coord.he_context()
    with caplog.at_level(logging.INFO, logger="fedsec.aggregator.coordinator"):
        for m in MEMBERS:
            coord.join(m, 1, 0, join_request())
        for _ in range(3):
            coord.tick()
            clock.advance(FAST_ROUND["advertise_s"])
    assert coord.live.stage == "open"  # no context: no cohort
    assert caplog.text.count("event=waiting_for_he_context") == 1

    _publish(fed, coord, keys)
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and coord.live.stage == "commit"
    assert spec.secure_sum == "he" and spec.custodian == CUSTODIAN
    assert spec.he_context_sha256 == hashlib.sha256(keys[1]).hexdigest()
    assert spec.deadlines["decrypt_s"] == DECRYPT_S
    members = HeMembers(spec, fed.identities, keys)
    members.commit(coord)
    assert coord.live.stage == "masked_input"  # every member committed
    receipts = {m: coord.masked_input(m, 1, 0, *members.upload(m)) for m in MEMBERS}
    # a retry gets the same receipt
    assert coord.masked_input("a0", 1, 0, *members.upload("a0")) == receipts["a0"]
    assert coord.live.stage == "decrypt"  # every member uploaded: masked_input closed

    offer = coord.he_sum(CUSTODIAN, 1, 0)
    assert offer.contributors == sorted(MEMBERS)
    assert offer.sum_sha256 == he.sum_digest(members.sum_of(sorted(MEMBERS)))
    assert offer.log_index == len(log_entries(fed.ws))
    body = members.decryption(offer)
    coord.decryption(CUSTODIAN, 1, 0, body)
    coord.decryption(CUSTODIAN, 1, 0, body)  # a retry after the close is answered alike

    assert [(r.round, r.attempt, r.stage) for r in fed.ws.state.rounds.history()] == [
        (1, 0, "closed"),
        (2, 0, "open"),
    ]
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    quantized = [quantized_input(m, spec) for m in MEMBERS]
    # bit for bit the model the same vectors' exact ring sum gives (SecAgg+'s, and a
    # plain round's up to its per-member float sums)
    np.testing.assert_array_equal(new, expected_params(old, quantized, spec))
    entries = log_entries(fed.ws)
    kinds = [e["kind"] for e in entries]
    assert kinds.count("he_context") == 1 and kinds.count("he_decryption") == 1
    decryption = next(e for e in entries if e["kind"] == "he_decryption")["body"]
    assert decryption["contributors"] == sorted(MEMBERS)
    plaintext = members.plaintext(sorted(MEMBERS))
    assert fed.ws.state.messages.get(1, 0, "decrypt", CUSTODIAN) == body
    assert coord.archived(CUSTODIAN, hashlib.sha256(plaintext).hexdigest()) == plaintext
    aggregate = next(e for e in entries if e["kind"] == "aggregate")["body"]
    assert aggregate["survivors"] == sorted(MEMBERS) and aggregate["dropped"] == []


def test_a_member_that_never_uploads_is_dropped_above_min_agents(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws")
    coord, members = _start(fed, clock, keys)
    survivors = ("a0", "a2", "a3", "a4")
    _upload_all(coord, members, survivors)
    assert coord.live.stage == "masked_input"
    clock.advance(MASKED_DEADLINE)
    coord.tick()
    assert coord.live.stage == "decrypt"
    offer = coord.he_sum(CUSTODIAN, 1, 0)
    assert offer.contributors == sorted(survivors)
    coord.decryption(CUSTODIAN, 1, 0, members.decryption(offer))
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    quantized = [quantized_input(m, members.spec) for m in survivors]
    np.testing.assert_array_equal(new, expected_params(old, quantized, members.spec))
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "closed"
    summary = msgspec.json.decode(row.summary or b"", type=wire.RoundSummary)
    assert summary.dropped == ["a1"] and summary.survivors == 4
    # the log holds what an auditor needs to re-add, re-derive and check it all
    audit = fed.root / "audit"
    result = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert result.ok and result.rounds_verified == 1, result.problem


def test_fewer_ciphertexts_than_min_agents_abort_and_retry(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws")
    coord, members = _start(fed, clock, keys)
    _upload_all(coord, members, ("a0", "a1"))
    clock.advance(MASKED_DEADLINE)
    coord.tick()
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "aborted"
    assert "2 encrypted updates arrived, need 3" in row.detail
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")


def test_an_open_attempts_ciphertexts_are_withheld_until_it_ends(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    """A colluding member handed the honest ciphertexts of an open attempt could upload
    Enc(0) - Σ of them (tests/custodian/test_cancellation_live.py): the archive serves
    them to nobody before the attempt ends, except the custodian in decrypt."""
    fed = he_federation(tmp_path / "ws", readers=True)
    coord, members = _start(fed, clock, keys)
    _upload_all(coord, members, ("a0", "a1"))
    digest = hashlib.sha256(members.raw["a0"]).hexdigest()
    for who in ("aud", CUSTODIAN):
        error = _refused(fed, coord, WrongStage, coord.archived, who, digest)
        assert "still open (stage masked_input)" in error.detail
    # a restarted aggregator reads the log afresh and withholds them alike
    coord = Coordinator(fed.ws, clock=clock)
    with pytest.raises(WrongStage, match="still open"):
        coord.archived("aud", digest)
    clock.advance(MASKED_DEADLINE)
    coord.tick()  # two of three: the attempt aborts, the next one opens
    assert (coord.live.round, coord.live.attempt) == (1, 1)
    assert coord.archived("aud", digest) == members.raw["a0"]


def test_ciphertexts_that_are_not_the_federations_are_refused_unchanged(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    # b0..b4 commit to malformed ciphertexts: only a committed ciphertext is parsed
    spares = tuple(f"b{i}" for i in range(5))
    fed = make_federation(
        tmp_path / "ws",
        (*MEMBERS, *spares),
        custodians=(CUSTODIAN,),
        round={"secure_sum": "he", "min_agents": 3, "decrypt_s": DECRYPT_S},
        sections={"he": {"custodian": CUSTODIAN}},
    )
    coord = Coordinator(fed.ws, clock=clock)
    _publish(fed, coord, keys)
    for m in (*MEMBERS, *spares):
        assert coord.join(m, 1, 0, join_request()).accepted
    coord.tick()
    assert coord.live.spec is not None and coord.live.stage == "commit"
    members = HeMembers(coord.live.spec, fed.identities, keys)
    values = quantized_input("a1", members.spec).astype(np.float64)
    other_params = he.HeParams(8192, (50, 60), 30)
    other = he.load_public_context(
        he.generate_keys(other_params)[1], other_params, other_params.context_max_bytes(False)
    )
    chunks = he.encrypt(members.public, values)
    bad = {
        "other params": (he.frame_chunks(he.encrypt(other, values)), CryptoError),
        "garbage": (he.frame_chunks([b"\x01" * 1000]), CryptoError),
        "no frame": (b"\x00\x01", PayloadError),
        "two chunks": (he.frame_chunks(chunks * 2), PayloadError),
        "trailing bytes": (he.frame_chunks(chunks) + b"\x00", PayloadError),
    }
    for spare, (raw, _) in zip(spares, bad.values(), strict=True):
        members.raw[spare] = raw
    members.commit(coord, (*MEMBERS, *spares))
    assert coord.live.stage == "masked_input"
    coord.masked_input("a0", 1, 0, *members.upload("a0"))
    for spare, (name, (raw, exc)) in zip(spares, bad.items(), strict=True):
        error = _refused(
            fed, coord, exc, coord.masked_input, spare, 1, 0, *members.upload(spare, raw)
        )
        assert error.detail, name
    # a well-formed ciphertext, but not the one its member committed to
    other_bytes = members.upload("a1", he.frame_chunks(chunks))
    error = _refused(fed, coord, IntegrityError, coord.masked_input, "a1", 1, 0, *other_bytes)
    assert "not the one it committed to" in error.detail
    # a second, different upload of a member already in the sum
    again = members.upload("a0", he.frame_chunks(chunks))
    _refused(fed, coord, DuplicateMessage, coord.masked_input, "a0", 1, 0, *again)
    # the sum is intact: the round still closes with the exact model
    _upload_all(coord, members, MEMBERS[1:])
    clock.advance(MASKED_DEADLINE)  # the spares never upload what they committed to
    coord.tick()
    coord.decryption(CUSTODIAN, 1, 0, members.decryption(coord.he_sum(CUSTODIAN, 1, 0)))
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    quantized = [quantized_input(m, members.spec) for m in MEMBERS]
    np.testing.assert_array_equal(new, expected_params(old, quantized, members.spec))


# -- the custodian's decryption --------------------------------------------------------------------


def test_a_decryption_that_does_not_check_out_is_refused_and_nothing_stored(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws", custodians=(CUSTODIAN, "kx"))
    coord, members = _start(fed, clock, keys)
    _upload_all(coord, members, MEMBERS[:4])
    # before decrypt: no offer, no decryption
    _refused(fed, coord, WrongStage, coord.he_sum, CUSTODIAN, 1, 0)
    clock.advance(MASKED_DEADLINE)
    coord.tick()
    offer = coord.he_sum(CUSTODIAN, 1, 0)
    _refused(fed, coord, UnknownMember, coord.he_sum, "kx", 1, 0)
    _refused(fed, coord, WrongStage, coord.he_sum, CUSTODIAN, 1, 1)
    good = members.decryption(offer)
    clear = members.plaintext(offer.contributors)
    top = len(offer.contributors) * members.spec.quant_spec().levels
    too_big = np.frombuffer(clear, "<i8").copy()
    too_big[0] = top + 1
    negative = np.frombuffer(clear, "<i8").copy()
    negative[0] = -1
    forged = {
        "bad signature": (members.decryption(offer, signer="kx"), SignatureError),
        "other contributors": (
            members.decryption(offer, contributors=sorted(MEMBERS)),
            ProtocolError,
        ),
        "fewer contributors": (
            members.decryption(offer, contributors=offer.contributors[:3]),
            ProtocolError,
        ),
        "other sum": (members.decryption(offer, sum_sha256="0" * 64), ProtocolError),
        "other attempt": (members.decryption(offer, attempt=1), ProtocolError),
        "other custodian": (members.decryption(offer, custodian="kx"), UnknownMember),
        "short plaintext": (members.decryption(offer, plaintext=clear[:-8]), PayloadError),
        "plaintext not hashed": (
            members.decryption(offer, plaintext=clear[:-8] + b"\x01" + clear[-7:]),
            IntegrityError,
        ),
        "value above n levels": (
            members.decryption(
                offer,
                plaintext=too_big.tobytes(),
                plaintext_sha256=hashlib.sha256(too_big.tobytes()).hexdigest(),
            ),
            BadVector,
        ),
        "negative value": (
            members.decryption(
                offer,
                plaintext=negative.tobytes(),
                plaintext_sha256=hashlib.sha256(negative.tobytes()).hexdigest(),
            ),
            BadVector,
        ),
        "truncated statement": (good[:40], PayloadError),
        "statement length over the bound": (b"\xff\xff\xff\xff" + good[4:], PayloadError),
        "not json": (b"\x03\x00\x00\x00abc" + clear, PayloadError),
    }
    for name, (body, exc) in forged.items():
        assert _refused(fed, coord, exc, coord.decryption, CUSTODIAN, 1, 0, body).detail, name
    _refused(fed, coord, UnknownMember, coord.decryption, "kx", 1, 0, good)
    _refused(fed, coord, UnknownMember, coord.decryption, "a0", 1, 0, good)
    assert fed.ws.state.messages.get(1, 0, "decrypt", CUSTODIAN) is None
    assert "he_decryption" not in _kinds(fed)

    coord.decryption(CUSTODIAN, 1, 0, good)
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "closed"


def test_no_decryption_by_the_deadline_aborts_and_the_next_attempt_opens(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws")
    coord, members = _start(fed, clock, keys)
    _upload_all(coord, members, MEMBERS)
    assert coord.live.stage == "decrypt"
    assert coord.deadline() == clock.now + DECRYPT_S
    clock.advance(DECRYPT_S - 0.5)
    coord.tick()
    assert coord.live.stage == "decrypt"
    clock.advance(1.0)
    coord.tick()
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.stage == "aborted"
    assert "did not decrypt within round.decrypt_s" in row.detail
    assert any("did not decrypt" in alert for alert in coord.alerts)
    assert (coord.live.round, coord.live.attempt, coord.live.stage) == (1, 1, "open")
    # a late decryption of the aborted attempt is refused
    late = members.decryption(
        wire.HeSumOffer(
            federation_id=FED,
            round=1,
            attempt=0,
            contributors=sorted(MEMBERS),
            sum_sha256=he.sum_digest(members.sum_of(sorted(MEMBERS))),
            log_index=0,
        )
    )
    with pytest.raises(WrongStage):
        coord.decryption(CUSTODIAN, 1, 0, late)
    # the next attempt forms its cohort again (the context stays published)
    for m in MEMBERS:
        coord.join(m, 1, 1, join_request())
    coord.tick()
    assert coord.live.stage == "commit"
    assert coord.live.spec is not None and coord.live.spec.attempt == 1


def test_a_restarted_coordinator_resumes_mid_decrypt_and_closes_identically(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "a")
    coord, members = _start(fed, clock, keys)
    del coord
    fed.ws.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    spaces = {k: Workspace.open(tmp_path / k) for k in "ab"}
    coords = {k: Coordinator(w, clock=clock) for k, w in spaces.items()}
    for c in coords.values():
        _upload_all(c, members, MEMBERS[:4])
    clock.advance(MASKED_DEADLINE)
    for c in coords.values():
        c.tick()
        assert c.live.stage == "decrypt"
    before = _he_view(coords["b"])
    spaces["b"].close()
    spaces["b"] = Workspace.open(tmp_path / "b")
    coords["b"] = Coordinator(spaces["b"], clock=clock)
    assert coords["b"].live.stage == "decrypt" and _he_view(coords["b"]) == before
    offers = [c.he_sum(CUSTODIAN, 1, 0) for c in coords.values()]
    assert offers[0] == offers[1]
    body = members.decryption(offers[0])
    for c in coords.values():
        c.decryption(CUSTODIAN, 1, 0, body)
    params = [model_params(w, 2) for w in spaces.values()]
    np.testing.assert_array_equal(params[0], params[1])
    aggregates = [
        next(e for e in log_entries(w) if e["kind"] == "aggregate")["body"] for w in spaces.values()
    ]
    assert aggregates[0]["sum_sha256"] == aggregates[1]["sum_sha256"]


def test_a_decryption_stored_before_a_crash_is_replayed_and_closes(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    fed = he_federation(tmp_path / "ws")
    coord, members = _start(fed, clock, keys)
    _upload_all(coord, members, MEMBERS)
    # the incarnation dies after committing the decryption, before closing the round
    monkeypatch.setattr(coord._lifecycle, "close_if_complete", lambda: None)
    coord.decryption(CUSTODIAN, 1, 0, members.decryption(coord.he_sum(CUSTODIAN, 1, 0)))
    assert coord.live.stage == "decrypt"
    fed.ws.close()
    ws = Workspace.open(fed.root)
    restarted = Coordinator(ws, clock=clock)
    assert restarted.live.stage == "decrypt" and _he_view(restarted)[3] is not None
    restarted.tick()  # the stage is complete: it closes
    assert restarted.live.round == 2
    old, new = model_params(ws, 1), model_params(ws, 2)
    quantized = [quantized_input(m, members.spec) for m in MEMBERS]
    np.testing.assert_array_equal(new, expected_params(old, quantized, members.spec))
    assert [e["kind"] for e in log_entries(ws)].count("he_decryption") == 1


# -- publishing the context ------------------------------------------------------------------------


def test_the_context_is_checked_published_once_and_served(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws", custodians=(CUSTODIAN, "kx"))
    coord = Coordinator(fed.ws, clock=clock)
    ids = fed.identities
    secret, public = keys
    kh = ids[CUSTODIAN]
    small = he.HeParams(4096, (40, 40), 30)
    other_public = he.generate_keys(small)[1]

    def refused(exc: type[FedsecError], member: str, published: wire.HeContext) -> None:
        before = (snapshot(fed.ws, coord), _kinds(fed))
        with pytest.raises(exc) as info:
            coord.publish_he_context(member, published)
        assert type(info.value) is exc and 400 <= info.value.http_status < 500
        assert (snapshot(fed.ws, coord), _kinds(fed)) == before
        assert not fed.ws.he_context_path.exists()

    good = context_message(public, kh)
    refused(ForbiddenError, "kx", context_message(public, ids["kx"], custodian="kx"))
    refused(ForbiddenError, "a0", good)
    refused(SignatureError, CUSTODIAN, context_message(public, ids["kx"]))
    refused(IntegrityError, CUSTODIAN, context_message(public, kh, federation_id="fed2"))
    # a context with the secret key is larger than any public one: refused unparsed
    refused(PayloadError, CUSTODIAN, context_message(secret, kh, context=secret))
    refused(PayloadError, CUSTODIAN, context_message(public, kh, scale_bits=30))
    refused(CryptoError, CUSTODIAN, context_message(other_public, kh, context=other_public))
    refused(IntegrityError, CUSTODIAN, context_message(public, kh, context_sha256="0" * 64))
    bad_b64 = msgspec.structs.replace(good, context="not base64!")
    refused(PayloadError, CUSTODIAN, bad_b64)
    with pytest.raises(NotFound):
        coord.he_context()

    assert coord.publish_he_context(CUSTODIAN, good) is True
    assert coord.he_context() == good
    assert fed.ws.he_context_path.exists()
    sha = hashlib.sha256(public).hexdigest()
    assert coord.archived(CUSTODIAN, sha) == public
    assert _kinds(fed).count("he_context") == 1
    assert coord.publish_he_context(CUSTODIAN, good) is False  # an identical repeat
    other = he.generate_keys(PARAMS)[1]
    refused_again = context_message(other, kh)
    before = _kinds(fed)
    with pytest.raises(DuplicateMessage) as info:
        coord.publish_he_context(CUSTODIAN, refused_again)
    assert info.value.http_status == 409 and _kinds(fed) == before
    assert coord.he_context() == good

    # a restart serves the stored context, logged once
    fed.ws.close()
    again = Coordinator(Workspace.open(fed.root), clock=clock)
    assert again.he_context() == good
    assert [e["kind"] for e in log_entries(again.ws)].count("he_context") == 1


def test_a_non_he_federation_has_no_context(tmp_path: Path, clock: FakeClock) -> None:
    fed = make_federation(tmp_path / "ws", custodians=(CUSTODIAN,))
    coord = Coordinator(fed.ws, clock=clock)
    with pytest.raises(NotFound):
        coord.he_context()
    with pytest.raises(ProtocolError):
        coord.publish_he_context(CUSTODIAN, context_message(b"x", fed.identities[CUSTODIAN]))
    # the archive holds members' messages: a custodian has no business there
    digest = fed.ws.models.latest().sha256
    with pytest.raises(ForbiddenError):
        coord.archived(CUSTODIAN, digest)


def test_an_auditor_cannot_read_plain_updates_from_the_archive(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = make_federation(
        tmp_path / "ws", auditors=("aud",), round={"secure_sum": "none", "min_agents": 1}
    )
    coord = Coordinator(fed.ws, clock=clock)
    with pytest.raises(ForbiddenError, match="in the clear"):
        coord.archived("aud", "e" * 64)


def test_a_cohort_the_ckks_headroom_cannot_hold_is_never_fixed(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    # quant_bits 16: 65535 levels; scale 2^40 under a 60-bit prime holds sums below 2^18,
    # so at most 4 members; min_agents 5 can never be met
    fed = he_federation(tmp_path / "ws", quant_bits=16, min_agents=5)
    coord = Coordinator(fed.ws, clock=clock)
    _publish(fed, coord, keys)
    for m in MEMBERS:
        coord.join(m, 1, 0, join_request())
    with caplog.at_level(logging.WARNING, logger="fedsec.aggregator.coordinator"):
        for _ in range(3):
            clock.advance(FAST_ROUND["advertise_s"])
            coord.tick()
    assert coord.live.stage == "open"
    assert caplog.text.count("event=he_headroom_exceeded") == 1
    assert sum("holds sums of at most 4 members" in a for a in coord.alerts) == 1


def test_the_cohort_is_capped_at_what_the_headroom_holds(
    tmp_path: Path, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    fed = he_federation(tmp_path / "ws", quant_bits=16)
    coord = Coordinator(fed.ws, clock=clock)
    _publish(fed, coord, keys)
    for m in MEMBERS[:4]:
        assert coord.join(m, 1, 0, join_request()).accepted
    # four 16-bit vectors are all 2^18 holds: the fourth join fills the cohort
    assert coord.live.spec is not None and coord.live.spec.cohort == list(MEMBERS[:4])
    with pytest.raises(WrongStage):
        coord.join("a4", 1, 0, join_request())


# -- over HTTP -------------------------------------------------------------------------------------

Client = tuple[TestClient, Federation, Coordinator]


@pytest_asyncio.fixture
async def served(
    tmp_path: Path,
    clock: FakeClock,
    aiohttp_client: Callable[..., Awaitable[TestClient]],
) -> Client:
    fed = he_federation(tmp_path / "ws", readers=True)
    coord = Coordinator(fed.ws, clock=clock)
    return await aiohttp_client(make_app(fed.ws, coord)), fed, coord


async def _http(
    served: Client, who: str, method: str, path: str, body: bytes = b""
) -> tuple[int, bytes]:
    client, fed, _ = served
    headers = sign_request(fed.identities[who], method, path, {}, body)
    async with client.request(method, path, data=body, headers=headers) as resp:
        return resp.status, await resp.read()


@pytest.mark.asyncio
async def test_the_he_endpoints_over_http_with_their_roles(
    served: Client, clock: FakeClock, keys: tuple[bytes, bytes]
) -> None:
    _, fed, coord = served
    published = wire.encode(context_message(keys[1], fed.identities[CUSTODIAN]))
    status, raw = await _http(served, "a0", "GET", "/v1/he/context")
    assert status == 404 and json.loads(raw)["error"] == "not_found"
    for who in ("a0", "aud", "obs"):
        status, raw = await _http(served, who, "POST", "/v1/he/context", published)
        assert status == 403 and "has role" in json.loads(raw)["detail"], raw
    status, raw = await _http(served, CUSTODIAN, "POST", "/v1/he/context", published)
    assert (status, json.loads(raw)) == (200, {"accepted": True})
    for who in ("a0", "obs", "aud", CUSTODIAN):
        status, raw = await _http(served, who, "GET", "/v1/he/context")
        assert status == 200 and raw == published

    for m in MEMBERS:
        coord.join(m, 1, 0, join_request())
    assert coord.live.spec is not None
    members = HeMembers(coord.live.spec, fed.identities, keys)
    # stage commit: no ciphertext is taken, no commitment set served, until it closes
    raw_vec, commitment, signature = members.upload("a0")
    path = f"/v1/rounds/1/masked-input?attempt=0&commitment={commitment}&signature={signature}"
    status, raw = await _http(served, "a0", "POST", path, raw_vec)
    assert status == 409 and json.loads(raw)["error"] == "wrong_stage", raw
    status, raw = await _http(served, "a0", "GET", "/v1/rounds/1/commit?attempt=0")
    assert status == 409 and json.loads(raw)["error"] == "wrong_stage", raw
    for who in ("aud", "obs", CUSTODIAN):
        body = wire.encode(members.commit_body("a0"))
        status, raw = await _http(served, who, "POST", "/v1/rounds/1/commit?attempt=0", body)
        assert status == 403, raw
    for i, m in enumerate(MEMBERS):
        wait = "&wait=1" if i == len(MEMBERS) - 1 else ""
        path = f"/v1/rounds/1/commit?attempt=0{wait}"
        status, raw = await _http(served, m, "POST", path, wire.encode(members.commit_body(m)))
        assert status == 200, raw
    answer = msgspec.json.decode(raw, type=wire.Accepted)  # the last one waited for the set
    assert answer.commitments is not None
    assert [c.member for c in answer.commitments.commitments] == sorted(MEMBERS)
    status, raw = await _http(served, "a0", "GET", "/v1/rounds/1/commit?attempt=0")
    assert status == 200 and msgspec.json.decode(raw, type=wire.CommitmentSetBody) == (
        answer.commitments
    )
    members.bound = wire.commitments_digest(
        (c.member, c.vector_sha256) for c in answer.commitments.commitments
    )
    for m in MEMBERS:
        raw_vec, commitment, signature = members.upload(m)
        path = f"/v1/rounds/1/masked-input?attempt=0&commitment={commitment}&signature={signature}"
        status, raw = await _http(served, m, "POST", path, raw_vec)
        assert status == 200, raw
    assert coord.live.stage == "decrypt"

    for who in ("a0", "aud", "obs"):
        status, raw = await _http(served, who, "GET", "/v1/rounds/1/he-sum?attempt=0")
        assert status == 403, raw
    status, raw = await _http(served, CUSTODIAN, "GET", "/v1/rounds/1/he-sum?attempt=0&wait=1")
    assert status == 200
    offer = msgspec.json.decode(raw, type=wire.HeSumOffer)
    assert offer.contributors == sorted(MEMBERS)

    # the log and the archive, for the custodian and the auditor only
    for who in ("a0", "obs"):
        status, raw = await _http(served, who, "GET", "/v1/audit/log")
        assert status == 403, raw
    lines = [line for _, line in fed.ws.state.log.log_lines()]
    for who in (CUSTODIAN, "aud"):
        status, raw = await _http(served, who, "GET", "/v1/audit/log")
        assert status == 200 and raw == b"".join(line + b"\n" for line in lines)
    status, raw = await _http(served, CUSTODIAN, "GET", f"/v1/audit/log?from={len(lines) - 2}")
    assert status == 200 and raw.splitlines() == lines[-2:]
    status, raw = await _http(served, CUSTODIAN, "GET", f"/v1/audit/log?from={len(lines) + 5}")
    assert (status, raw) == (200, b"")
    status, raw = await _http(served, CUSTODIAN, "GET", "/v1/audit/log?from=-1")
    assert status == 400
    accepted = [
        e
        for e in log_entries(fed.ws)
        if e["kind"] == "accepted" and e["body"]["stage"] == "masked_input"
    ]
    digest = accepted[0]["body"]["sha256"]
    # the custodian re-adds the ciphertexts in decrypt; an auditor waits for the end
    status, raw = await _http(served, CUSTODIAN, "GET", f"/v1/audit/archive/{digest}")
    assert status == 200 and hashlib.sha256(raw).hexdigest() == digest
    assert raw == members.raw[accepted[0]["body"]["member"]]
    status, raw = await _http(served, "aud", "GET", f"/v1/audit/archive/{digest}")
    assert status == 409 and "still open" in json.loads(raw)["detail"]
    status, raw = await _http(served, "a0", "GET", f"/v1/audit/archive/{digest}")
    assert status == 403
    status, raw = await _http(served, CUSTODIAN, "GET", f"/v1/audit/archive/{'e' * 64}")
    assert status == 404 and json.loads(raw)["error"] == "not_found"
    status, raw = await _http(served, CUSTODIAN, "GET", "/v1/audit/archive/ABC")
    assert status == 400

    body = members.decryption(offer)
    status, raw = await _http(served, "a0", "POST", "/v1/rounds/1/decryption?attempt=0", body)
    assert status == 403
    bad = members.decryption(offer, sum_sha256="0" * 64)
    status, raw = await _http(served, CUSTODIAN, "POST", "/v1/rounds/1/decryption?attempt=0", bad)
    assert status == 409 and json.loads(raw)["error"] == "protocol_error"
    status, raw = await _http(served, CUSTODIAN, "POST", "/v1/rounds/1/decryption?attempt=0", body)
    assert (status, json.loads(raw)) == (200, {"accepted": True})
    assert coord.live.round == 2 and fed.ws.models.latest().version == 2
    status, raw = await _http(served, "aud", "GET", f"/v1/audit/archive/{digest}")
    assert status == 200 and hashlib.sha256(raw).hexdigest() == digest
