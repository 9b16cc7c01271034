"""The neighbour graph comes from randomness nobody controls alone.

The spec's seed is the aggregator's own: if the graph were a function of it, the
aggregator could try seeds until its colluders are a victim's neighbours.  Members
commit to a graph nonce when they join (before the spec is signed) and reveal it,
signed, when they advertise; the graph comes from the revealed nonces, which the
aggregator does not know when it signs the spec and no member can change once the
spec carries its commitment.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from fedsec.crypto.secagg import ClientSession, KeyList
from fedsec.crypto.secagg.graph import NeighbourGraph
from fedsec.crypto.secagg.messages import AdvertiseKeys
from fedsec.errors import InvalidKeyList, ProtocolError
from tests.support.secagg import (
    Round,
    client_state,
    identity_for,
    make_params,
    member_ids,
    server_state,
)

N, K, T = 20, 4, 3  # small neighbourhoods: placing two colluders takes some luck
VICTIM, COLLUDERS = "m00", frozenset({"m10", "m11"})


def _nonces(tag: str) -> dict[str, bytes]:
    return {m: hashlib.sha256(f"{tag}/{m}".encode()).digest() for m in member_ids(N)}


def _placed(graph: NeighbourGraph) -> bool:
    return graph.neighbors(VICTIM) >= COLLUDERS


def _ground_seeds(count: int) -> list[bytes]:
    """Spec seeds under which, were the graph the seed's alone, both colluders would be
    the victim's neighbours: what an aggregator grinding its seed finds."""
    found = []
    for i in range(100_000):
        seed = hashlib.sha256(b"grind/%d" % i).digest()
        if _placed(NeighbourGraph(member_ids(N), K, seed)):
            found.append(seed)
            if len(found) == count:
                return found
    raise AssertionError("grinding found too few seeds")


def test_a_ground_spec_seed_no_longer_places_the_colluders() -> None:
    seeds = _ground_seeds(10)  # about 1 seed in 28 works: grinding is cheap
    placed = 0
    for i, seed in enumerate(seeds):
        nonces = _nonces(f"honest-{i}")
        r = Round(make_params(N, K, T, seed=seed, graph_nonces=nonces), graph_nonces=nonces)
        r.advertise()
        assert r.server.graph.degree == K
        placed += _placed(r.server.graph)
    # by chance alone about 1 in 28 graphs places both; the ground seeds no longer help
    assert placed <= 2, placed


def test_members_and_server_derive_the_same_graph_from_the_reveals() -> None:
    nonces = _nonces("same")
    r = Round(make_params(N, K, T, graph_nonces=nonces), graph_nonces=nonces)
    r.advertise()
    r.share_keys()
    assert r.server.graph is not NeighbourGraph(member_ids(N), K, r.params.seed)
    for client in r.clients.values():
        assert all(
            client.graph.neighbors(m) == r.server.graph.neighbors(m) for m in r.params.cohort
        )
    # the whole round still sums exactly
    r.masked_input()
    r.unmask()
    result = r.server.finalize()
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_a_nonce_that_does_not_open_its_commitment_is_refused() -> None:
    nonces = _nonces("forged")
    params = make_params(N, K, T, graph_nonces=nonces)
    r = Round(params, graph_nonces=nonces)
    honest = r.clients["m01"].advertise()
    # the member (or the aggregator) changes the nonce after the spec fixed it
    other = hashlib.sha256(b"another nonce").digest()
    signed = AdvertiseKeys.signed_bytes(
        params.digest(), "m01", honest.enc_public, honest.mask_public, other
    )
    changed = AdvertiseKeys(
        "m01",
        honest.enc_public,
        honest.mask_public,
        identity_for("m01").sign("secagg-advertise-keys", signed),
        other,
    )
    before = server_state(r.server)
    with pytest.raises(InvalidKeyList, match="does not open its commitment"):
        r.server.receive_advertise(changed)
    assert server_state(r.server) == before
    # a key list relaying it to a member that is not m01's neighbour is refused too
    adverts = [r.clients[m].advertise() for m in r.params.cohort if m != "m01"]
    client = r.clients["m00"]
    before_client = client_state(client)
    with pytest.raises(InvalidKeyList, match="does not open its commitment"):
        client.share_keys(KeyList((*adverts, changed)))
    assert client_state(client) == before_client


def test_a_member_refuses_parameters_without_its_commitment() -> None:
    nonces = _nonces("mine")
    params = make_params(N, K, T, graph_nonces=nonces)
    ClientSession(params, "m00", identity_for("m00"), {}, graph_nonce=nonces["m00"])
    with pytest.raises(ProtocolError, match="do not carry m00's commitment"):
        ClientSession(params, "m00", identity_for("m00"), {}, graph_nonce=b"\x01" * 32)
    swapped = dataclasses.replace(
        params, graph_commitments=(params.graph_commitments[1], *params.graph_commitments[1:])
    )
    with pytest.raises(ProtocolError, match="do not carry m00's commitment"):
        ClientSession(swapped, "m00", identity_for("m00"), {}, graph_nonce=nonces["m00"])
    # a member that committed refuses a round whose graph is the aggregator's seed alone
    legacy = make_params(N, K, T)
    with pytest.raises(ProtocolError, match="carry no graph commitments"):
        ClientSession(legacy, "m00", identity_for("m00"), {}, graph_nonce=nonces["m00"])
