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


def _state(hood: Neighbourhood) -> tuple[object, ...]:
    peer = hood.peer
    held = {k: (v.message.round, v.message.exchange) for k, v in peer._held.items()}
    trained = {k: v.message.round for k, v in peer._trained.items()}
    state = peer.round, peer.exchange, peer.model.tobytes(), len(peer.journal.entries)
    return (*state, held, trained)


def test_accepted_models_are_averaged_by_volume(hood: Neighbourhood) -> None:
    own = np.full(DIM, 2.0)
    hood.peer.own_model(own)
    a, b, c = hood.neighbours
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.full(DIM, 2.0), samples=30), FED, 0)
    hood.peer.receive(b.key_id, _raw(b.key_id, 0, np.full(DIM, 3.0), samples=10), FED, 0)
    assert not hood.peer.ready()
    hood.peer.receive(c.key_id, _raw(c.key_id, 0, np.full(DIM, 1.0), samples=50), FED, 0)
    assert hood.peer.ready()
    outcome = hood.peer.combine()
    expected = (10 * 2.0 + 30 * 2.0 + 10 * 3.0 + 50 * 1.0) / 100
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
    hood.peer.receive(flipped.key_id, _raw(flipped.key_id, 0, -1.5 * direction), FED, 0)
    outcome = hood.peer.combine()
    assert flipped.key_id in outcome.refused and "cosine" in outcome.refused[flipped.key_id]
    assert flipped.key_id not in outcome.accepted
    np.testing.assert_allclose(outcome.model, direction, rtol=1e-5)
    refused = hood.peer.journal.of_kind("peer_refused")
    assert [r["sender"] for r in refused] == [flipped.key_id]


def test_a_boosted_update_in_the_honest_direction_is_refused_for_its_length() -> None:
    hood = make_neighbourhood()
    direction = np.ones(DIM)
    hood.peer.own_model(direction)
    a, b, booster = hood.neighbours
    for n in (a, b):
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, 1.5 * direction), FED, 0)
    hood.peer.receive(booster.key_id, _raw(booster.key_id, 0, 10 * direction), FED, 0)
    outcome = hood.peer.combine()
    assert list(outcome.refused) == [booster.key_id]
    assert "over 2 times this peer's own" in outcome.refused[booster.key_id]
    np.testing.assert_allclose(outcome.model, (1 + 1.5 + 1.5) / 3 * direction)
    refused = hood.peer.journal.of_kind("peer_refused")
    assert [r["sender"] for r in refused] == [booster.key_id]
    # without the length test the booster's direction passes and it drags the average
    plain = make_neighbourhood(settings=GossipSettings(max_norm_ratio=0))
    plain.peer.own_model(direction)
    for n, scale in zip(plain.neighbours, (1.5, 1.5, 10), strict=True):
        plain.peer.receive(n.key_id, _raw(n.key_id, 0, scale * direction), FED, 0)
    assert not plain.peer.combine().refused


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


def _mix(sender: str, round_: int, exchange: int, model: np.ndarray, samples: int = 10) -> bytes:
    return messages.encode(messages.make_mix(FED, round_, exchange, sender, samples, model))


def test_later_exchanges_mix_in_only_the_neighbours_the_first_accepted() -> None:
    hood = make_neighbourhood(exchanges=2)
    direction = np.ones(DIM)
    hood.peer.own_model(direction)
    a, b, flipped = hood.neighbours
    for n in (a, b):
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, direction), FED, 0)
    hood.peer.receive(flipped.key_id, _raw(flipped.key_id, 0, -4 * direction), FED, 0)
    first = hood.peer.combine()
    assert (first.exchange, list(first.refused)) == (0, [flipped.key_id])
    assert (hood.peer.round, hood.peer.exchange) == (0, 1)
    assert not hood.peer.ready()
    # the refused neighbour's mixed model is received and journalled, never averaged in
    hood.peer.receive(flipped.key_id, _mix(flipped.key_id, 0, 1, np.full(DIM, -1e3)), FED, 0)
    hood.peer.receive(a.key_id, _mix(a.key_id, 0, 1, np.full(DIM, 2.0)), FED, 0)
    hood.peer.receive(b.key_id, _mix(b.key_id, 0, 1, np.full(DIM, 3.0), samples=20), FED, 0)
    assert hood.peer.ready()
    mixed = hood.peer.combine()
    # x = 1; pulls 1 and 2 (the radius, twice their median 1.5·√8, clips neither)
    np.testing.assert_allclose(mixed.model, np.full(DIM, 1 + (10 * 1 + 20 * 2) / 40))
    assert mixed.accepted == tuple(sorted([a.key_id, b.key_id])) and not mixed.refused
    assert (hood.peer.round, hood.peer.exchange) == (1, 0)
    combined = hood.peer.journal.of_kind("peer_combined")
    assert [(c["round"], c["exchange"]) for c in combined] == [(0, 0), (0, 1)]
    assert flipped.key_id not in combined[1]["accepted"]


def test_a_mixed_model_far_from_the_neighbourhood_pulls_no_further_than_the_clip() -> None:
    hood = make_neighbourhood(exchanges=2)
    hood.peer.own_model(np.zeros(DIM))
    for n in hood.neighbours:
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, np.zeros(DIM)), FED, 0)
    hood.peer.combine()
    a, b, forger = hood.neighbours
    for n in (a, b):
        hood.peer.receive(n.key_id, _mix(n.key_id, 0, 1, np.ones(DIM)), FED, 0)
    hood.peer.receive(forger.key_id, _mix(forger.key_id, 0, 1, np.full(DIM, 1e6)), FED, 0)
    mixed = hood.peer.combine()
    # the forged pull is clipped to twice the median (√8 ones): one more than 2 ones
    assert float(np.linalg.norm(mixed.model)) <= (1 + 1 + 2) / 4 * np.sqrt(DIM) + 1e-9


def test_exchanges_out_of_order_or_malformed_are_refused_without_a_trace() -> None:
    hood = make_neighbourhood(exchanges=2)
    a = hood.neighbours[0]
    hood.peer.own_model(np.ones(DIM))
    hood.peer.receive(a.key_id, _raw(a.key_id, 0, np.ones(DIM)), FED, 0)
    hood.peer.receive(a.key_id, _mix(a.key_id, 0, 1, np.ones(DIM)), FED, 0)
    ones = np.ones(DIM, dtype=messages.WIRE_DTYPE).tobytes()
    with_update = PeerModel(FED, 0, a.key_id, 10, ones, ones, exchange=1)
    before = _state(hood)
    cases = [
        (_mix(a.key_id, 0, 1, np.zeros(DIM)), ReplayError),  # the same exchange again
        (_raw(a.key_id, 0, np.zeros(DIM)), ReplayError),  # an earlier exchange
        (_mix(a.key_id, 0, 2, np.zeros(DIM)), PayloadError),  # the rounds have two
        (messages.encode(with_update), BadVector),  # a mixing exchange carries no update
    ]
    for raw, error in cases:
        with pytest.raises(error):
            hood.peer.receive(a.key_id, raw, FED, 0)
        assert _state(hood) == before
    with pytest.raises(ProtocolError, match="exchange 0 carries"):
        hood.peer.mixing_model()
    hood.peer.combine()
    with pytest.raises(ProtocolError, match="trains in exchange 0"):
        hood.peer.own_model(np.ones(DIM))
    assert hood.peer.mixing_model().update == b""


def test_the_topology_mixes_as_a_random_regular_graph_not_a_ring_lattice() -> None:
    admin = SigningIdentity.generate()
    members = [f"member-{i:02d}" for i in range(20)]  # fixed, so the graph is too
    topology = sign_topology(admin, FED, bytes(range(32)), 4)
    graph = topology_graph(topology, admin.public_bytes, FED, members)
    index = {m: i for i, m in enumerate(members)}
    adjacency = np.zeros((20, 20))
    for m in members:
        for n in graph.neighbors(m):
            adjacency[index[m], index[n]] = 1
    assert (adjacency == adjacency.T).all() and adjacency.sum(axis=1).tolist() == [4] * 20
    mixing = (np.eye(20) + adjacency) / 5
    second = sorted(np.abs(np.linalg.eigvalsh(mixing)))[-2]
    # the ring lattice of the same size mixes at 0.904; below 1 means connected
    assert second < 0.85


def test_a_returning_peer_rejoins_from_the_median_of_its_neighbours_newest_rounds() -> None:
    hood = make_neighbourhood()
    a, b, forger = hood.neighbours
    # away since round 0, the neighbours are at round 5: their models are out of reach
    with pytest.raises(StaleUpdate):
        hood.peer.receive(a.key_id, _raw(a.key_id, 5, np.ones(DIM)), FED, 5)
    offers = {
        a.key_id: _raw(a.key_id, 5, np.ones(DIM), start=np.full(DIM, 2.0)),
        b.key_id: _raw(b.key_id, 4, np.ones(DIM), start=np.full(DIM, 4.0)),
        forger.key_id: _raw(forger.key_id, 5, np.full(DIM, 1e6)),
    }
    caught = hood.peer.catch_up(offers)
    # the median of the ends 3, 5 and 1e6: the forged offer moves it to the honest 5
    np.testing.assert_allclose(hood.peer.model, np.full(DIM, 5.0))
    assert (caught.round, hood.peer.round, hood.peer.exchange) == (6, 6, 0)
    assert sorted(caught.sources) == sorted(offers)
    (entry,) = hood.peer.journal.of_kind("peer_caught_up")
    assert entry["round"] == 6 and entry["sources"] == sorted(offers)
    # it trains and gossips on from there with its neighbours
    hood.peer.own_model(hood.peer.model + 1)
    hood.peer.receive(a.key_id, _raw(a.key_id, 6, np.ones(DIM), start=hood.peer.model), FED, 6)
    assert a.key_id in hood.peer.combine().accepted


def test_a_catch_up_offer_that_is_not_a_neighbours_training_changes_nothing() -> None:
    hood = make_neighbourhood()
    a, b, _ = hood.neighbours
    ok = _raw(a.key_id, 5, np.ones(DIM))
    cases: list[tuple[dict[str, bytes], type[Exception]]] = [
        ({hood.stranger.key_id: _raw(hood.stranger.key_id, 5, np.ones(DIM))}, UnknownMember),
        ({a.key_id: ok, b.key_id: ok}, AuthError),  # b offers what a signed
        ({a.key_id: _mix(a.key_id, 5, 1, np.ones(DIM))}, ProtocolError),
        ({a.key_id: _raw(a.key_id, 5, np.ones(DIM), fed="other")}, ProtocolError),
        ({a.key_id: ok[:-3]}, PayloadError),
        ({}, ProtocolError),
    ]
    before = _state(hood)
    for offers, error in cases:
        with pytest.raises(error):
            hood.peer.catch_up(offers)
        assert _state(hood) == before
    hood.peer.own_model(np.ones(DIM))
    for n in hood.neighbours:
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, np.ones(DIM)), FED, 0)
    hood.peer.combine()
    with pytest.raises(ProtocolError, match="no neighbour is past"):
        hood.peer.catch_up({a.key_id: _raw(a.key_id, 0, np.ones(DIM))})


def test_a_flip_is_judged_against_the_others_direction_not_one_it_votes_on() -> None:
    # noisy honest updates sharing a small common part (coordinate 0); the attacker sends
    # -1.5 times its own, so on coordinates 1-7 its value sits between the honest ones
    # and a median taken with it in would be its own vote (cosine +0.85 with it)
    hood = make_neighbourhood(neighbours=4)
    signs = np.array(
        [
            [1, 1, 1, -1, -1, -1, 1],
            [1, -1, -1, 1, 1, -1, -1],
            [-1, 1, -1, 1, -1, 1, 1],
            [-1, -1, 1, -1, 1, 1, -1],
        ]
    )
    honest = [np.concatenate([[0.3], row]) for row in signs]
    flipped = -1.5 * np.concatenate([[0.3], np.full(DIM - 1, -1 / 3)])
    hood.peer.own_model(honest[0])
    *good, attacker = hood.neighbours
    for n, update in zip(good, honest[1:], strict=True):
        hood.peer.receive(n.key_id, _raw(n.key_id, 0, update), FED, 0)
    hood.peer.receive(attacker.key_id, _raw(attacker.key_id, 0, flipped), FED, 0)
    outcome = hood.peer.combine()
    assert attacker.key_id in outcome.refused and "cosine" in outcome.refused[attacker.key_id]
