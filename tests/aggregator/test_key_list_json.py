"""Values every member is sent (the key list, the round's spec), encoded once per object
and spliced into each member's answer."""

from __future__ import annotations

from pathlib import Path

import msgspec

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import handlers
from fedsec.protocol import codec, wire
from tests.support.aggregator import (
    FakeClock,
    advertise_all,
    attempt_of,
    fetch_shares,
    fix_cohort,
    join_request,
    make_federation,
    mask_all,
    share_all,
    sign_all,
)


def _key_list(members: int, tag: str = "ab") -> wire.KeyListBody:
    return wire.KeyListBody(
        entries=[
            wire.KeyEntry(
                member=f"agent-{i}",
                enc_public=tag * 32,
                mask_public="cd" * 32,
                signature="ef" * 64,
                graph_nonce="12" * 16,
            )
            for i in range(members)
        ]
    )


def test_the_spliced_answer_is_byte_for_byte_the_encoded_one() -> None:
    cache = handlers._EncodedOnce[wire.KeyListBody]()
    keys = _key_list(5)
    spliced = wire.encode(wire.Accepted(accepted=True, keys=cache.of(keys)))  # type: ignore[arg-type]
    assert spliced == wire.encode(wire.Accepted(accepted=True, keys=keys))
    assert msgspec.json.decode(spliced, type=wire.Accepted).keys == keys
    assert cache.encoded(keys) == wire.encode(keys)


def test_a_list_is_encoded_once_and_a_new_list_anew() -> None:
    cache = handlers._EncodedOnce[wire.KeyListBody]()
    first = _key_list(3)
    assert cache.encoded(first) is cache.encoded(first)  # the same bytes object: no re-encode
    second = _key_list(3, tag="99")  # the next attempt's list: another object
    assert cache.encoded(second) == wire.encode(second)
    assert cache.encoded(second) != wire.encode(first)
    # an equal list that is another object is encoded again, to the same bytes
    again = _key_list(3, tag="99")
    assert cache.encoded(again) == cache.encoded(second)


def test_the_round_state_with_its_spec_spliced_is_byte_for_byte_the_encoded_one(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "ws", validation=False)
    coord = Coordinator(fed.ws, clock=FakeClock())
    assert wire.encode(handlers._round_state(coord)) == wire.encode(coord.round_state())
    for m in ("a0", "a1", "a2", "a3", "a4"):
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    assert coord.live.spec is not None  # the spec is in the state from now on
    spliced = wire.encode(handlers._round_state(coord))
    assert spliced == wire.encode(coord.round_state())
    assert msgspec.json.decode(spliced, type=wire.RoundState) == coord.round_state()
    # within one answer's JSON, the spec is the one encoded once for the attempt
    answer = wire.encode(wire.Accepted(accepted=True, state=handlers._round_state(coord)))
    assert answer == wire.encode(wire.Accepted(accepted=True, state=coord.round_state()))


def test_a_consistency_proof_with_its_sets_spliced_is_byte_for_byte_the_old_one(
    tmp_path: Path,
) -> None:
    members = ("a0", "a1", "a2", "a3", "a4")
    fed = make_federation(tmp_path / "ws", agents=members, validation=False)
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    cohort = fix_cohort(coord, fed.identities, members)
    advertise_all(coord, cohort, members)
    share_all(coord, cohort, members)
    fetch_shares(coord, cohort, members)
    mask_all(coord, cohort, members[:4])  # a4 drops: both sets are non-empty
    clock.advance(60.0)
    coord.tick()
    sign_all(coord, cohort)
    assert coord.live.stage == "unmask"
    r, a = attempt_of(coord)
    server = coord.live.summing().server  # type: ignore[attr-defined]
    proofs = {m: coord.consistency_proof(m, r, a) for m in members[:4]}
    for m, proof in proofs.items():
        # the body as built before the sets were shared: lists copied per proof
        old = codec.consistency_proof_body(server.consistency_proof(m), coord.token)
        spliced = handlers._spliced_proof(proof)
        assert wire.encode(spliced) == wire.encode(old)
        assert wire.encode(wire.Accepted(accepted=True, proof=spliced)) == wire.encode(
            wire.Accepted(accepted=True, proof=old)
        )
        assert msgspec.json.decode(wire.encode(spliced), type=wire.ConsistencyProofBody) == old
    assert proofs["a0"].dropped == ["a4"] and proofs["a0"].signatures
    # every survivor's proof (and the unmask request) holds the same lists: encoded once
    unmask = coord.unmask_request("a0", r, a)
    assert proofs["a0"].survivors is proofs["a3"].survivors is unmask.survivors
    assert proofs["a0"].dropped is proofs["a3"].dropped is unmask.dropped
    assert handlers._SURVIVORS_JSON.encoded(proofs["a3"].survivors) is (
        handlers._SURVIVORS_JSON.encoded(proofs["a0"].survivors)
    )
