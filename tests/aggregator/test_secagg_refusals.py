"""Messages a SecAgg+ party must refuse, each with its typed error and with no state change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from fedsec.crypto.envelope import KeyAgreementKey
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import pack
from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ClientSession,
    ClientStage,
    ConsistencyProof,
    ConsistencySignature,
    EncryptedShare,
    KeyList,
    MaskedInput,
    ServerStage,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
)
from fedsec.crypto.secagg.messages import ADVERTISE_DOMAIN
from fedsec.errors import (
    BadVector,
    DuplicateMessage,
    FedsecError,
    InvalidKeyList,
    MisaddressedShare,
    ProtocolError,
    UnknownMember,
    WrongStage,
)
from tests.support.secagg import Round, client_state, identity_for, make_params, server_state


def _params():  # type: ignore[no-untyped-def]
    # 8 members, 4 neighbours each: sparse, so "not a neighbour" exists; 12-bit ring,
    # 7 elements = 84 bits, so the packed vector has 4 padding bits.
    return make_params(8, 4, 2, bits=8, dim=6)


def _server_refuses(r: Round, error: type[FedsecError], action: Callable[[], object]) -> None:
    before = server_state(r.server)
    with pytest.raises(error):
        action()
    assert server_state(r.server) == before


def _client_refuses(
    client: ClientSession, error: type[FedsecError], action: Callable[[], object]
) -> None:
    before = client_state(client)
    with pytest.raises(error):
        action()
    assert client_state(client) == before


@pytest.fixture()
def r() -> Round:
    return Round(_params())


def _at_share_keys(r: Round) -> None:
    r.advertise()


def _at_masked_input(r: Round) -> None:
    r.advertise()
    r.share_keys()


def _at_consistency(r: Round, lost_masked: set[str] | None = None) -> UnmaskRequest:
    r.advertise()
    r.share_keys()
    return r.masked_input(lost=lost_masked or set())


def _at_unmask(r: Round, lost_masked: set[str] | None = None) -> UnmaskRequest:
    request = _at_consistency(r, lost_masked)
    r.consistency()
    return request


def _answer(r: Round, member: str) -> UnmaskResponse:
    return r.clients[member].unmask(r.proofs[member])


def _neighbour_and_stranger(r: Round, member: str) -> tuple[str, str]:
    neighbours = r.server.graph.neighbors(member)
    neighbour = sorted(neighbours)[0]
    stranger = sorted(set(r.params.cohort) - neighbours - {member})[0]
    return neighbour, stranger


# -- duplicates -------------------------------------------------------------------------------


def test_duplicate_advertise(r: Round) -> None:
    msg = r.clients["m00"].advertise()
    r.server.receive_advertise(msg)
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_advertise(msg))
    # a second, different advertisement from the same member is just as refused
    other = ClientSession(
        r.params, "m00", identity_for("m00"), r.roster, tolerated_corrupt=None
    ).advertise()
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_advertise(other))
    assert r.server.advertised["m00"] == msg


def test_duplicate_share_keys(r: Round) -> None:
    _at_share_keys(r)
    assert r.key_list is not None
    msg = r.clients["m00"].share_keys(r.key_list)
    r.server.receive_share_keys(msg)
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_share_keys(msg))


def test_duplicate_masked_input(r: Round) -> None:
    _at_masked_input(r)
    msg = r.clients["m00"].masked_input(r.inputs["m00"])
    r.server.receive_masked_input(msg)
    before_sum = r.server._sum.total()
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_masked_input(msg))
    assert r.server.contributed == ["m00"]
    assert (r.server._sum.total() == before_sum).all()


def test_duplicate_unmask(r: Round) -> None:
    _at_unmask(r)
    answer = _answer(r, "m00")
    r.server.receive_unmask(answer)
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_unmask(answer))


def test_share_keys_with_two_shares_for_one_recipient(r: Round) -> None:
    _at_share_keys(r)
    assert r.key_list is not None
    msg = r.clients["m00"].share_keys(r.key_list)
    doubled = ShareKeys("m00", (*msg.shares, msg.shares[0]))
    _server_refuses(r, DuplicateMessage, lambda: r.server.receive_share_keys(doubled))


# -- stages -----------------------------------------------------------------------------------


def test_late_advertise_after_close(r: Round) -> None:
    late = r.clients["m07"].advertise()
    for m in r.params.cohort[:-1]:
        r.server.receive_advertise(r.clients[m].advertise())
    r.server.close_advertise()
    _server_refuses(r, WrongStage, lambda: r.server.receive_advertise(late))
    assert "m07" not in r.server.live


def test_late_share_keys_after_close(r: Round) -> None:
    _at_share_keys(r)
    assert r.key_list is not None
    late = r.clients["m03"].share_keys(r.key_list)
    for m in sorted(r.server.live - {"m03"}):
        r.server.receive_share_keys(r.clients[m].share_keys(r.key_list))
    r.server.close_share_keys()
    _server_refuses(r, WrongStage, lambda: r.server.receive_share_keys(late))
    assert "m03" not in r.server.participants


def test_late_masked_input_after_close(r: Round) -> None:
    _at_masked_input(r)
    late = r.clients["m02"].masked_input(r.inputs["m02"])
    for m in sorted(r.server.participants - {"m02"}):
        r.server.receive_masked_input(r.clients[m].masked_input(r.inputs[m]))
    request = r.server.close_masked_input()
    assert "m02" in request.dropped
    _server_refuses(r, WrongStage, lambda: r.server.receive_masked_input(late))
    assert "m02" not in r.server.contributed


def test_late_unmask_after_finalize(r: Round) -> None:
    _at_unmask(r)
    late = _answer(r, "m05")
    r.unmask(lost={"m05"})
    r.server.finalize()
    _server_refuses(r, WrongStage, lambda: r.server.receive_unmask(late))
    _server_refuses(r, WrongStage, r.server.finalize)


def test_server_message_of_wrong_stage(r: Round) -> None:
    bogus_masked = MaskedInput("m00", bytes(r.params.vector_bytes))
    _server_refuses(r, WrongStage, lambda: r.server.receive_masked_input(bogus_masked))
    _server_refuses(r, WrongStage, lambda: r.server.receive_unmask(UnmaskResponse("m00", (), ())))
    _server_refuses(r, WrongStage, lambda: r.server.receive_share_keys(ShareKeys("m00", ())))
    _server_refuses(r, WrongStage, r.server.close_share_keys)
    _server_refuses(r, WrongStage, r.server.finalize)
    _at_share_keys(r)
    _server_refuses(r, WrongStage, lambda: r.server.receive_masked_input(bogus_masked))
    _server_refuses(r, WrongStage, r.server.close_advertise)


def test_client_message_of_wrong_stage(r: Round) -> None:
    client = r.clients["m00"]
    _client_refuses(client, WrongStage, lambda: client.masked_input(r.inputs["m00"]))
    _client_refuses(client, WrongStage, lambda: client.share_keys(KeyList(())))
    _client_refuses(client, WrongStage, lambda: client.sign_survivors(UnmaskRequest((), ())))
    proof = ConsistencyProof("m00", UnmaskRequest((), ()), ())
    _client_refuses(client, WrongStage, lambda: client.unmask(proof))
    _client_refuses(client, WrongStage, lambda: client.receive_shares(ShareRelay("m00", (), ())))
    client.advertise()
    _client_refuses(client, WrongStage, client.advertise)
    assert client.stage is ClientStage.SHARE_KEYS


# -- unknown members --------------------------------------------------------------------------


def test_unknown_member_advertise(r: Round) -> None:
    mallory = SigningIdentity.generate()
    params = r.params
    enc, mask = KeyAgreementKey().public_bytes, KeyAgreementKey().public_bytes
    sig = mallory.sign(
        ADVERTISE_DOMAIN, AdvertiseKeys.signed_bytes(params.digest(), "mallory", enc, mask)
    )
    msg = AdvertiseKeys("mallory", enc, mask, sig)
    _server_refuses(r, UnknownMember, lambda: r.server.receive_advertise(msg))


def test_unknown_member_client_session(r: Round) -> None:
    with pytest.raises(UnknownMember):
        ClientSession(
            r.params, "mallory", SigningIdentity.generate(), r.roster, tolerated_corrupt=None
        )


def test_member_excluded_at_advertise_cannot_send_later(r: Round) -> None:
    excluded = r.clients["m04"]
    excluded.advertise()  # never reaches the server
    key_list = r.advertise(lost={"m04"})
    # its shares (made from a list that does not include it) are refused as unknown
    forged_shares = ShareKeys("m04", ())
    _server_refuses(r, UnknownMember, lambda: r.server.receive_share_keys(forged_shares))
    # and the client itself refuses a key list that lacks its own keys
    _client_refuses(excluded, InvalidKeyList, lambda: excluded.share_keys(key_list))


def test_non_participant_masked_input_and_non_survivor_unmask(r: Round) -> None:
    r.advertise()
    r.share_keys(lost={"m06"})
    assert "m06" not in r.server.participants
    vector = pack(r.inputs["m06"], r.params.quant.ring_bits)
    _server_refuses(
        r, UnknownMember, lambda: r.server.receive_masked_input(MaskedInput("m06", vector))
    )
    request = r.masked_input(lost={"m01"})
    assert "m01" in request.dropped
    signature = ConsistencySignature("m01", b"\x00" * 64)
    _server_refuses(r, UnknownMember, lambda: r.server.receive_consistency(signature))
    r.consistency(lost={"m02"})
    _server_refuses(
        r, UnknownMember, lambda: r.server.receive_unmask(UnmaskResponse("m01", (), ()))
    )
    # a survivor that did not sign the survivor sets gets no say in unmasking
    _server_refuses(
        r, UnknownMember, lambda: r.server.receive_unmask(UnmaskResponse("m02", (), ()))
    )
    _server_refuses(
        r, UnknownMember, lambda: r.server.receive_unmask(UnmaskResponse("m06", (), ()))
    )


# -- forged key lists -------------------------------------------------------------------------


def test_server_refuses_forged_advertisement(r: Round) -> None:
    genuine = r.clients["m00"].advertise()
    swapped = dataclasses.replace(genuine, mask_public=KeyAgreementKey().public_bytes)
    _server_refuses(r, InvalidKeyList, lambda: r.server.receive_advertise(swapped))
    # signed by someone else's identity key
    params = r.params
    wrong_signer = identity_for("m01").sign(
        ADVERTISE_DOMAIN,
        AdvertiseKeys.signed_bytes(params.digest(), "m00", genuine.enc_public, genuine.mask_public),
    )
    forged = dataclasses.replace(genuine, signature=wrong_signer)
    _server_refuses(r, InvalidKeyList, lambda: r.server.receive_advertise(forged))
    # signed for another round: the params digest differs
    other_round = dataclasses.replace(params, round=params.round + 1)
    replay = ClientSession(
        other_round, "m00", identity_for("m00"), r.roster, tolerated_corrupt=None
    ).advertise()
    _server_refuses(r, InvalidKeyList, lambda: r.server.receive_advertise(replay))
    r.server.receive_advertise(genuine)  # the genuine one is still accepted
    assert r.server.advertised == {"m00": genuine}


def test_server_refuses_keys_reused_from_another_member(r: Round) -> None:
    first = r.clients["m00"].advertise()
    r.server.receive_advertise(first)
    signed = AdvertiseKeys.signed_bytes(
        r.params.digest(), "m01", first.enc_public, first.mask_public
    )
    copy = AdvertiseKeys(
        "m01",
        first.enc_public,
        first.mask_public,
        identity_for("m01").sign(ADVERTISE_DOMAIN, signed),
    )
    _server_refuses(r, InvalidKeyList, lambda: r.server.receive_advertise(copy))


def _substitute(key_list: KeyList, member: str, **changes: bytes) -> KeyList:
    return KeyList(
        tuple(
            dataclasses.replace(e, **changes) if e.member == member else e for e in key_list.entries
        )
    )


def test_client_refuses_key_list_with_forged_neighbour_key(r: Round) -> None:
    key_list = r.advertise()
    client = r.clients["m00"]
    neighbour, _ = _neighbour_and_stranger(r, "m00")
    attacker = KeyAgreementKey()
    # the aggregator substitutes its own key for a neighbour's, keeping the old signature
    for field in ("enc_public", "mask_public"):
        forged = _substitute(key_list, neighbour, **{field: attacker.public_bytes})
        _client_refuses(client, InvalidKeyList, lambda forged=forged: client.share_keys(forged))
    # or signs the substitute with a key that is not the neighbour's roster key
    params = r.params
    sig = SigningIdentity.generate().sign(
        ADVERTISE_DOMAIN,
        AdvertiseKeys.signed_bytes(
            params.digest(), neighbour, attacker.public_bytes, attacker.public_bytes
        ),
    )
    forged = _substitute(
        key_list,
        neighbour,
        enc_public=attacker.public_bytes,
        mask_public=attacker.public_bytes,
        signature=sig,
    )
    _client_refuses(client, InvalidKeyList, lambda: client.share_keys(forged))
    assert client.stage is ClientStage.SHARE_KEYS
    client.share_keys(key_list)  # the genuine list still works
    assert client.stage is ClientStage.AWAIT_SHARES


def test_client_refuses_key_list_replacing_its_own_key(r: Round) -> None:
    key_list = r.advertise()
    client = r.clients["m00"]
    attacker = KeyAgreementKey()
    params = r.params
    # even correctly signed (say, a stolen identity key), keys that are not the ones
    # this session made are refused: the member cannot decrypt or mask with them
    sig = identity_for("m00").sign(
        ADVERTISE_DOMAIN,
        AdvertiseKeys.signed_bytes(
            params.digest(), "m00", attacker.public_bytes, attacker.public_bytes
        ),
    )
    forged = _substitute(
        key_list,
        "m00",
        enc_public=attacker.public_bytes,
        mask_public=attacker.public_bytes,
        signature=sig,
    )
    _client_refuses(client, InvalidKeyList, lambda: client.share_keys(forged))
    without = KeyList(tuple(e for e in key_list.entries if e.member != "m00"))
    _client_refuses(client, InvalidKeyList, lambda: client.share_keys(without))


def test_client_refuses_key_list_with_outsider_or_duplicate(r: Round) -> None:
    key_list = r.advertise()
    client = r.clients["m00"]
    outsider = dataclasses.replace(key_list.entries[1], member="mallory")
    with_outsider = KeyList((*key_list.entries, outsider))
    _client_refuses(client, InvalidKeyList, lambda: client.share_keys(with_outsider))
    doubled = KeyList((*key_list.entries, key_list.entries[1]))
    _client_refuses(client, InvalidKeyList, lambda: client.share_keys(doubled))


# -- misaddressed shares ----------------------------------------------------------------------


def test_server_refuses_share_to_non_neighbour_or_claiming_other_sender(r: Round) -> None:
    key_list = r.advertise()
    msg = r.clients["m00"].share_keys(key_list)
    _, stranger = _neighbour_and_stranger(r, "m00")
    to_stranger = dataclasses.replace(msg.shares[0], recipient=stranger)
    bad = ShareKeys("m00", (to_stranger, *msg.shares[1:]))
    _server_refuses(r, MisaddressedShare, lambda: r.server.receive_share_keys(bad))
    other_sender = dataclasses.replace(msg.shares[0], sender="m01")
    bad = ShareKeys("m00", (other_sender, *msg.shares[1:]))
    _server_refuses(r, MisaddressedShare, lambda: r.server.receive_share_keys(bad))
    missing = ShareKeys("m00", msg.shares[1:])
    _server_refuses(r, ProtocolError, lambda: r.server.receive_share_keys(missing))
    short = dataclasses.replace(msg.shares[0], ciphertext=msg.shares[0].ciphertext[:-1])
    bad = ShareKeys("m00", (short, *msg.shares[1:]))
    _server_refuses(r, ProtocolError, lambda: r.server.receive_share_keys(bad))
    r.server.receive_share_keys(msg)  # the genuine message is still accepted


def _relays_for(r: Round) -> dict[str, ShareRelay]:
    """Run share keys up to the relay without handing relays to the clients."""
    assert r.key_list is not None
    for m in sorted(r.server.live):
        r.server.receive_share_keys(r.clients[m].share_keys(r.key_list))
    return r.server.close_share_keys()


def test_client_refuses_relay_for_someone_else(r: Round) -> None:
    r.advertise()
    relays = _relays_for(r)
    client = r.clients["m00"]
    _client_refuses(client, MisaddressedShare, lambda: client.receive_shares(relays["m01"]))
    # right envelope, but one share inside is addressed to another member
    other = relays["m01"].shares[0]
    mixed = dataclasses.replace(relays["m00"], shares=(other, *relays["m00"].shares[1:]))
    _client_refuses(client, MisaddressedShare, lambda: client.receive_shares(mixed))
    client.receive_shares(relays["m00"])
    assert client.stage is ClientStage.MASKED_INPUT


def test_client_refuses_share_relabelled_to_it(r: Round) -> None:
    # the aggregator relabels a share meant for m01 as one for m00: AEAD binds the pair
    r.advertise()
    relays = _relays_for(r)
    client = r.clients["m00"]
    mine = relays["m00"].shares
    sender = mine[0].sender
    theirs = next(
        s for m, relay in relays.items() if m != "m00" for s in relay.shares if s.sender == sender
    )
    relabelled = EncryptedShare(sender, "m00", theirs.ciphertext)
    relay = dataclasses.replace(relays["m00"], shares=(relabelled, *mine[1:]))
    _client_refuses(client, ProtocolError, lambda: client.receive_shares(relay))


def test_client_refuses_tampered_missing_or_duplicated_share(r: Round) -> None:
    r.advertise()
    relays = _relays_for(r)
    client = r.clients["m00"]
    relay = relays["m00"]
    first = relay.shares[0]
    flipped = bytes([first.ciphertext[0] ^ 1]) + first.ciphertext[1:]
    tampered = dataclasses.replace(
        relay, shares=(dataclasses.replace(first, ciphertext=flipped), *relay.shares[1:])
    )
    _client_refuses(client, ProtocolError, lambda: client.receive_shares(tampered))
    missing = dataclasses.replace(relay, shares=relay.shares[1:])
    _client_refuses(client, ProtocolError, lambda: client.receive_shares(missing))
    doubled = dataclasses.replace(relay, shares=(*relay.shares, first))
    _client_refuses(client, DuplicateMessage, lambda: client.receive_shares(doubled))
    outsider = dataclasses.replace(relay, participants=(*relay.participants, "mallory"))
    _client_refuses(client, ProtocolError, lambda: client.receive_shares(outsider))


# -- bad vectors ------------------------------------------------------------------------------


def test_server_refuses_bad_masked_vectors(r: Round) -> None:
    _at_masked_input(r)
    good = r.clients["m00"].masked_input(r.inputs["m00"])
    r.server.receive_masked_input(r.clients["m01"].masked_input(r.inputs["m01"]))
    assert (r.params.vector_length * r.params.quant.ring_bits) % 8 != 0
    cases = [
        good.vector[:-1],
        good.vector + b"\x00",
        b"",
        good.vector[:-1] + bytes([good.vector[-1] | 0x80]),  # a padding bit set
    ]
    for vector in cases:
        bad = MaskedInput("m00", vector)
        _server_refuses(r, BadVector, lambda bad=bad: r.server.receive_masked_input(bad))
    assert r.server.contributed == ["m01"]
    r.server.receive_masked_input(good)
    assert r.server.contributed == ["m01", "m00"]


def test_client_refuses_bad_input_vector(r: Round) -> None:
    _at_masked_input(r)
    client = r.clients["m00"]
    q = r.inputs["m00"]
    _client_refuses(client, BadVector, lambda: client.masked_input(q[:-1]))
    too_big = q.astype("uint64")
    too_big[0] = 1 << r.params.quant.ring_bits
    _client_refuses(client, BadVector, lambda: client.masked_input(too_big))


# -- unmask -----------------------------------------------------------------------------------


def test_client_never_reveals_both_shares_of_one_member(r: Round) -> None:
    request = _at_consistency(r, lost_masked={"m03"})
    client = r.clients["m00"]
    both = UnmaskRequest(request.survivors, (*request.dropped, request.survivors[-1]))
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(both))
    overlap = UnmaskRequest((*request.survivors, "m03"), request.dropped)
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(overlap))
    twice = UnmaskRequest((*request.survivors, "m00"), request.dropped)
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(twice))
    assert client.stage is ClientStage.CONSISTENCY
    r.consistency()
    answer = _answer(r, "m00")
    seeds = {m for m, _ in answer.seed_shares}
    keys = {m for m, _ in answer.key_shares}
    assert not seeds & keys
    assert "m03" not in seeds


def test_client_refuses_request_without_it_or_not_partitioning(r: Round) -> None:
    request = _at_consistency(r)
    client = r.clients["m00"]
    without = UnmaskRequest(
        tuple(m for m in request.survivors if m != "m00"), (*request.dropped, "m00")
    )
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(without))
    partial = UnmaskRequest(request.survivors[:-1], request.dropped)  # one participant unnamed
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(partial))
    extra = UnmaskRequest((*request.survivors, "mallory"), request.dropped)
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(extra))


def test_client_refuses_request_with_fewer_survivors_than_threshold() -> None:
    r = Round(make_params(8, 4, 3, dim=6))
    r.advertise()
    r.share_keys()
    client = r.clients["m00"]
    participants = sorted(client._participants)
    survivors = ("m00", next(m for m in participants if m != "m00"))
    request = UnmaskRequest(survivors, tuple(m for m in participants if m not in survivors))
    client.masked_input(r.inputs["m00"])
    _client_refuses(client, ProtocolError, lambda: client.sign_survivors(request))


def test_second_unmask_request_refused(r: Round) -> None:
    request = _at_unmask(r, lost_masked={"m03"})
    client = r.clients["m00"]
    _answer(r, "m00")
    # a second, different request (e.g. now calling m04 dropped) would expose m04's key share
    second = UnmaskRequest(
        tuple(m for m in request.survivors if m != "m04"), (*request.dropped, "m04")
    )
    _client_refuses(client, WrongStage, lambda: client.sign_survivors(second))
    _client_refuses(
        client,
        WrongStage,
        lambda: client.unmask(dataclasses.replace(r.proofs["m00"], request=second)),
    )
    _client_refuses(client, WrongStage, lambda: _answer(r, "m00"))
    assert client.stage is ClientStage.DONE


def test_server_refuses_unmask_answer_with_extra_or_missing_shares(r: Round) -> None:
    request = _at_unmask(r, lost_masked={"m03"})
    member = next(m for m in request.survivors if "m03" in r.server.graph.neighbors(m))
    answer = _answer(r, member)
    assert answer.seed_shares and answer.key_shares
    _, stranger = _neighbour_and_stranger(r, member)
    fake = answer.seed_shares[0][1]
    variants = [
        dataclasses.replace(answer, seed_shares=answer.seed_shares[1:]),  # missing
        dataclasses.replace(answer, key_shares=()),  # missing key share
        dataclasses.replace(answer, seed_shares=(*answer.seed_shares, (stranger, fake))),
        dataclasses.replace(answer, seed_shares=(*answer.seed_shares, answer.seed_shares[0])),
        # the dropped member's share offered as a seed share: both kinds for one member
        dataclasses.replace(
            answer, seed_shares=(*answer.seed_shares, ("m03", answer.key_shares[0][1]))
        ),
        # a survivor's seed share offered as a key share
        dataclasses.replace(answer, key_shares=(*answer.key_shares, answer.seed_shares[0])),
    ]
    for bad in variants:
        _server_refuses(r, ProtocolError, lambda bad=bad: r.server.receive_unmask(bad))


def test_server_refuses_unmask_share_with_wrong_x_or_bad_bytes(r: Round) -> None:
    _at_unmask(r)
    answer = _answer(r, "m00")
    other = _answer(r, "m01")
    owner, raw = answer.seed_shares[0]
    # right owner, but the share is another holder's point
    foreign = next((raw2 for o, raw2 in other.seed_shares if o == owner), None)
    variants = [
        dataclasses.replace(answer, seed_shares=((owner, raw[:-1]), *answer.seed_shares[1:]))
    ]
    if foreign is not None:
        variants.append(
            dataclasses.replace(answer, seed_shares=((owner, foreign), *answer.seed_shares[1:]))
        )
    for bad in variants:
        _server_refuses(r, ProtocolError, lambda bad=bad: r.server.receive_unmask(bad))
    r.server.receive_unmask(answer)


def test_server_close_refusals_leave_stage_open(r: Round) -> None:
    # RoundAborted on close keeps the stage; nothing half-applied
    for m in ("m00", "m01"):
        r.server.receive_advertise(r.clients[m].advertise())
    before = server_state(r.server)
    with pytest.raises(ProtocolError):
        r.server.close_advertise()
    assert server_state(r.server) == before
    assert r.server.stage is ServerStage.ADVERTISE
