"""The gossip state machine: averaging by volume, filtering by direction, staleness, and
refusals that leave the peer as it was."""

from __future__ import annotations

import numpy as np
import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    AuthError,
    BadVector,
    IntegrityError,
    PayloadError,
    PayloadTooLarge,
    ProtocolError,
    ReplayError,
    SignatureError,
    StaleUpdate,
    UnknownMember,
)
from fedsec.peer import messages
from fedsec.peer.gossip import GossipSettings
from fedsec.peer.journal import verify_journal
from fedsec.peer.messages import PeerModel
from fedsec.peer.topology import sign_topology, topology_graph
from tests.peer.conftest import DIM, FED, Neighbourhood, make_neighbourhood


def _raw(
    sender: str,
    round_: int,
    update: np.ndarray,
    samples: int = 10,
    fed: str = FED,
    start: np.ndarray | None = None,
) -> bytes:
    """A neighbour's round; from the peer's round-0 model (zeros) unless ``start``."""
    begin = np.zeros(len(update)) if start is None else start
    return messages.encode(messages.make_model(fed, round_, sender, samples, begin, update))


def _state(hood: Neighbourhood) -> tuple[int, bytes, int, dict[str, int]]:
    peer = hood.peer
    held = {k: v.message.round for k, v in peer._held.items()}
    return peer.round, peer.model.tobytes(), len(peer.journal.entries), held


def test_accepted_models_are_averaged_by_volume(hood: Neighbourhood) -> None:
    own = np.full(DIM, 1.0)
    hood.peer.own_model(own)
    a, b, c = hood.neighbours
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.full(DIM, 2.0), samples=30), FED, 0)
    hood.peer.receive(b.key_id, _raw(b.key_id, 0, np.full(DIM, 3.0), samples=10), FED, 0)
    assert not hood.peer.ready()
    hood.peer.receive(c.key_id, _raw(c.key_id, 0, np.full(DIM, 1.0), samples=50), FED, 0)
    assert hood.peer.ready()
    outcome = hood.peer.combine()
    expected = (10 * 1.0 + 30 * 2.0 + 10 * 3.0 + 50 * 1.0) / 100
    np.testing.assert_allclose(outcome.model, np.full(DIM, expected))
    assert outcome.accepted == tuple(sorted(n.key_id for n in hood.neighbours))
    assert hood.peer.round == 1


def test_a_sign_flipped_neighbour_is_refused_and_journalled(hood: Neighbourhood) -> None:
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(DIM)
    hood.peer.own_model(direction)
    good, also_good, flipped = hood.neighbours
    hood.peer.receive(good.key_id, _raw(good.key_id, 0, direction * 1.1), FED, 0)
    hood.peer.receive(also_good.key_id, _raw(also_good.key_id, 0, direction * 0.9), FED, 0)
    hood.peer.receive(flipped.key_id, _raw(flipped.key_id, 0, -4 * direction), FED, 0)
    outcome = hood.peer.combine()
    assert flipped.key_id in outcome.refused and "cosine" in outcome.refused[flipped.key_id]
    assert flipped.key_id not in outcome.accepted
    np.testing.assert_allclose(outcome.model, direction, rtol=1e-5)
    refused = hood.peer.journal.of_kind("peer_refused")
    assert [r["sender"] for r in refused] == [flipped.key_id]


def test_a_forged_start_pulls_no_further_than_the_neighbourhoods_typical_one(
    hood: Neighbourhood,
) -> None:
    direction = np.ones(DIM)
    hood.peer.own_model(direction)
    a, b, forger = hood.neighbours
    for n in (a, b):
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, direction), FED, 0)
    far = np.full(DIM, 1000.0)  # an honest-looking update from a start far away
    hood.peer.receive(forger.key_id, _raw(forger.key_id, 0, direction, start=far), FED, 0)
    outcome = hood.peer.combine()
    assert forger.key_id in outcome.accepted
    # the median pull is 0 (two starts equal the peer's): the forged start adds nothing
    np.testing.assert_allclose(outcome.model, direction, rtol=1e-6)


@pytest.mark.parametrize("reference", ["median", "own"])
def test_neighbours_are_judged_against_the_neighbourhoods_direction_or_the_own(
    reference: str,
) -> None:
    hood = make_neighbourhood(settings=GossipSettings(reference=reference))  # type: ignore[arg-type]
    own, theirs = np.zeros(DIM), np.zeros(DIM)
    own[0], theirs[1] = 1.0, 1.0  # the peer's own update is at a right angle to the others'
    hood.peer.own_model(own)
    for n in hood.neighbours:
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, theirs), FED, 0)
    outcome = hood.peer.combine()
    assert len(outcome.refused) == (0 if reference == "median" else 3)


def test_without_filtering_the_flipped_model_drags_the_average() -> None:
    hood = make_neighbourhood(settings=GossipSettings(robust=False))
    direction = np.ones(DIM)
    hood.peer.own_model(direction)
    for n in hood.neighbours[:2]:
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, direction), FED, 0)
    bad = hood.neighbours[2]
    hood.peer.receive(bad.key_id, _raw(bad.key_id, 0, -4 * direction), FED, 0)
    outcome = hood.peer.combine()
    assert not outcome.refused
    np.testing.assert_allclose(outcome.model, np.full(DIM, -0.25))  # (3 - 4) / 4


def test_a_missing_neighbour_is_skipped_and_a_stale_one_too() -> None:
    hood = make_neighbourhood(settings=GossipSettings(staleness=1))
    a, b, c = hood.neighbours
    hood.peer.own_model(np.ones(DIM))
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.ones(DIM)), FED, 0)
    first = hood.peer.combine()
    assert first.missing == tuple(sorted([b.key_id, c.key_id]))
    for r in (1, 2):
        hood.peer.own_model(hood.peer.model + 1)
        raw = _raw(b.key_id, r, np.ones(DIM), start=hood.peer.model)
        hood.peer.receive(b.key_id, raw, FED, r)
        outcome = hood.peer.combine()
    # a's round-0 model is two rounds old at round 2: beyond the bound of one
    assert a.key_id in outcome.missing and b.key_id in outcome.accepted


def _refusal_cases(hood: Neighbourhood) -> list[tuple[str, bytes, str, int, type[Exception]]]:
    a, _, _ = hood.neighbours
    ok = np.ones(DIM)
    nan = ok.copy()
    nan[3] = np.nan
    zero = np.zeros(DIM, dtype=messages.WIRE_DTYPE).tobytes()
    nan_raw = messages.encode(
        PeerModel(FED, 0, a.key_id, 10, zero, nan.astype(messages.WIRE_DTYPE).tobytes())
    )
    return [
        ("wrong length", _raw(a.key_id, 0, np.ones(DIM + 1)), FED, 0, BadVector),
        ("start of another length", _raw(a.key_id, 0, ok, start=np.ones(3)), FED, 0, BadVector),
        ("NaN", nan_raw, FED, 0, BadVector),
        ("not a message", b"\x93garbage", FED, 0, PayloadError),
        ("too long", b"\0" * (8 * DIM + 5000), FED, 0, PayloadTooLarge),
        ("other federation", _raw(a.key_id, 0, ok, fed="other"), "other", 0, ProtocolError),
        ("path names another round", _raw(a.key_id, 0, ok), FED, 1, ProtocolError),
        ("far ahead", _raw(a.key_id, 5, ok), FED, 5, StaleUpdate),
        ("stranger", _raw(hood.stranger.key_id, 0, ok), FED, 0, UnknownMember),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_malformed_or_misbound_message_is_refused_without_a_trace(case: int) -> None:
    hood = make_neighbourhood()
    name, raw, fed, round_, error = _refusal_cases(hood)[case]
    sender = hood.stranger.key_id if name == "stranger" else hood.neighbours[0].key_id
    before = _state(hood)
    with pytest.raises(error):
        hood.peer.receive(sender, raw, fed, round_)
    assert _state(hood) == before, name


def test_a_message_naming_another_sender_than_its_signer_is_refused(hood: Neighbourhood) -> None:
    a, b, _ = hood.neighbours
    before = _state(hood)
    with pytest.raises(AuthError, match="signed it"):
        hood.peer.receive(b.key_id, _raw(a.key_id, 0, np.ones(DIM)), FED, 0)
    assert _state(hood) == before


def test_a_model_from_an_earlier_round_is_a_replay(hood: Neighbourhood) -> None:
    a = hood.neighbours[0]
    hood.peer.own_model(np.ones(DIM))
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.ones(DIM)), FED, 0)
    hood.peer.combine()
    hood.peer.receive(a.key_id, _raw(a.key_id, 1, np.ones(DIM)), FED, 1)
    before = _state(hood)
    for round_ in (0, 1):
        with pytest.raises(ReplayError, match="replay"):
            hood.peer.receive(a.key_id, _raw(a.key_id, round_, np.zeros(DIM)), FED, round_)
    assert _state(hood) == before


def test_the_journal_chains_and_a_changed_line_is_detected(hood: Neighbourhood) -> None:
    a = hood.neighbours[0]
    message = hood.peer.own_model(np.ones(DIM))
    hood.peer.record_sent(a.key_id, message)
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.ones(DIM)), FED, 0)
    hood.peer.combine()
    hood.peer.journal.head()
    lines = [e.line for e in hood.peer.journal.entries]
    assert verify_journal(lines, hood.me.public_bytes, FED) == len(lines) - 2
    tampered = lines[1].replace(b'"samples":10', b'"samples":99')
    with pytest.raises(IntegrityError, match=r"chain breaks|canonical"):
        verify_journal([lines[0], tampered, *lines[2:]], hood.me.public_bytes, FED)
    other = SigningIdentity.generate()
    with pytest.raises(IntegrityError, match="signature"):
        verify_journal(lines, other.public_bytes, FED)


def test_the_topology_is_k_regular_from_the_admin_signed_seed() -> None:
    admin = SigningIdentity.generate()
    members = [SigningIdentity.generate().key_id for _ in range(10)]
    topology = sign_topology(admin, FED, bytes(range(32)), 4)
    graph = topology_graph(topology, admin.public_bytes, FED, members)
    assert all(len(graph.neighbors(m)) == 4 for m in members)
    again = topology_graph(topology, admin.public_bytes, FED, list(reversed(members)))
    assert all(graph.neighbors(m) == again.neighbors(m) for m in members)
    forged = sign_topology(SigningIdentity.generate(), FED, bytes(range(32)), 4)
    with pytest.raises(SignatureError):
        topology_graph(forged, admin.public_bytes, FED, members)
    with pytest.raises(ProtocolError):
        topology_graph(topology, admin.public_bytes, "another", members)
