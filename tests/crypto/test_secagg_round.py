"""Whole SecAgg+ rounds: exact sums of the survivors under dropouts at every stage."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsec.crypto.quantize import clip_l2, dequantize_one, dequantize_sum
from fedsec.crypto.secagg import ServerStage, masks, prune
from fedsec.crypto.secagg.graph import NeighbourGraph
from fedsec.crypto.secagg.messages import SecAggParams
from fedsec.errors import RecoveryImpossible, RoundAborted
from tests.support.secagg import Round, make_params

STAGES = ("advertise", "share", "masked", "unmask")


def _exact_weighted(r: Round, members: list[str]) -> tuple[np.ndarray, float]:
    """Σ w·clip(Δ) and Σ w as the members' own dequantized inputs say (each exact to a step)."""
    total = np.zeros(r.params.dim)
    weight = 0.0
    for m in members:
        deq, w = dequantize_one(r.inputs[m], r.params.quant)
        total += deq
        weight += w
    return total, weight


class Expected:
    """What a correct server must do, computed from the graph rules alone."""

    def __init__(self, params: SecAggParams, lost: dict[str, set[str]]) -> None:
        graph = NeighbourGraph(params.cohort, params.neighbors, params.seed)
        t = params.threshold
        need = max(t, 2) + 1
        self.aborted_at: str | None = None
        self.live = prune(graph, set(params.cohort) - lost["advertise"], t)
        if len(self.live) < need:
            self.aborted_at = "advertise"
            return
        self.participants = prune(graph, self.live - lost["share"], t)
        if len(self.participants) < need:
            self.aborted_at = "share"
            return
        self.survivors = self.participants - lost["masked"]
        if len(self.survivors) < need:
            self.aborted_at = "masked"
            return
        self.dropped = self.participants - self.survivors
        # a survivor unmasks only on t of its neighbours' consistency signatures
        self.refusers = {m for m in self.survivors if len(graph.neighbors(m) & self.survivors) < t}
        responders = self.survivors - lost["unmask"] - self.refusers
        # secrets that must be reconstructed, with the holders that did not answer
        self.short: dict[str, frozenset[str]] = {}
        needed = list(self.survivors) + [
            d for d in self.dropped if graph.neighbors(d) & self.survivors
        ]
        for owner in needed:
            if len(graph.neighbors(owner) & responders) < t:
                self.short[owner] = frozenset(
                    (graph.neighbors(owner) & self.survivors) - responders
                )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SecAggParams, dict[str, set[str]]]:
    n = draw(st.integers(3, 12))
    if draw(st.booleans()):
        k, t = None, None  # the defaults
    else:
        k = draw(st.integers(2, n - 1))
        t = draw(st.integers(1, k))
    params = make_params(
        n,
        k,
        t,
        bits=draw(st.integers(2, 16)),
        dim=draw(st.integers(1, 50)),
        seed=draw(st.binary(min_size=32, max_size=32)),
    )
    # 0..15: stays; 16..19: lost at that stage (shrinks towards "everyone stays")
    fates = draw(st.lists(st.integers(0, 19), min_size=n, max_size=n))
    lost: dict[str, set[str]] = {s: set() for s in STAGES}
    for member, fate in zip(params.cohort, fates, strict=True):
        if fate >= 16:
            lost[STAGES[fate - 16]].add(member)
    return params, lost


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_round_sums_exactly_or_fails_with_a_protocol_error(
    scenario: tuple[SecAggParams, dict[str, set[str]]],
) -> None:
    params, lost = scenario
    expected = Expected(params, lost)
    r = Round(params)
    try:
        result = r.run(lost["advertise"], lost["share"], lost["masked"], lost["unmask"])
    except RoundAborted:
        assert expected.aborted_at is not None
        event(f"aborted after {expected.aborted_at}")
        return
    except RecoveryImpossible as exc:
        assert expected.aborted_at is None
        assert expected.short, "the server gave up on a round that could complete"
        # the missing members are exactly the silent holders of one secret that is short
        assert frozenset(exc.missing) in expected.short.values()
        assert set(exc.missing) <= lost["unmask"] | expected.refusers
        assert r.server.stage is ServerStage.UNMASK  # still open: late answers may rescue it
        event("recovery impossible")
        return
    assert expected.aborted_at is None
    assert not expected.short
    assert r.refused == expected.refusers - lost["unmask"]
    assert set(result.survivors) == expected.survivors
    assert set(result.dropped) == expected.dropped
    # the core property: exactly the plain sum of the survivors' quantized inputs
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)
    # dequantized: within one step per member of the exact weighted sum (documented bound)
    exact, weight = _exact_weighted(r, list(result.survivors))
    weighted, weights = dequantize_sum(result.ring_sum, len(result.survivors), params.quant)
    np.testing.assert_allclose(weighted, exact, rtol=0, atol=1e-6)
    assert weights == pytest.approx(weight)
    true_sum = sum(
        w * clip_l2(delta, params.quant.clip).astype(np.float64)
        for delta, w in (r.updates[m] for m in result.survivors)
    )
    n = len(result.survivors)
    assert np.all(np.abs(weighted - true_sum) < n * params.quant.step() * 1.02)
    assert r.server.stage is ServerStage.DONE
    event(f"completed, {len(result.dropped)} dropped")


def test_dequantized_mean_within_documented_error() -> None:
    params = make_params(8, 7, 4, bits=12, dim=30)
    r = Round(params)
    result = r.run(lost_masked={"m03"})
    survivors = list(result.survivors)
    exact = np.zeros(params.dim)
    for m in survivors:
        delta, weight = r.updates[m]
        exact += weight * clip_l2(delta, params.quant.clip).astype(np.float64)
    n = len(survivors)
    step = params.quant.step()
    weighted, _ = dequantize_sum(result.ring_sum, n, params.quant)
    assert np.all(np.abs(weighted - exact) < n * step)
    assert np.all(np.abs(weighted / n - exact / n) < step)


# -- explicit cases ---------------------------------------------------------------------------


def test_classic_secagg_no_dropouts() -> None:
    params = make_params(6, 5, 3, dim=20)
    r = Round(params)
    result = r.run()
    assert result.survivors == params.cohort
    assert result.dropped == ()
    assert [int(v) for v in result.ring_sum] == r.plain_sum(params.cohort)
    # masked inputs really are masked: none equals the packed plain input
    for m, msg in r.masked.items():
        assert np.count_nonzero(r.inputs[m]) == 0 or msg.vector != r.inputs[m].tobytes()


def test_secagg_plus_sparse_graph_with_a_dropout() -> None:
    params = make_params(12, 4, 3, dim=10)
    r = Round(params)
    result = r.run(lost_masked={"m05"})
    assert result.dropped == ("m05",)
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_the_server_keeps_no_mask_buffer_after_unmasking() -> None:
    """The mask buffer would otherwise stay allocated while the round's sum is applied."""
    params = make_params(12, 4, 3, dim=10)
    r = Round(params)
    result = r.run(lost_masked={"m05"})  # a pairwise mask recovered as well
    assert getattr(masks._scratch, "buf", None) is None
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_member_lost_after_advertise_excluded_before_shares() -> None:
    params = make_params(8, 4, 2)
    r = Round(params)
    key_list = r.advertise(lost={"m02"})
    assert "m02" not in {e.member for e in key_list.entries}
    assert "m02" not in r.server.live
    relays = r.share_keys()
    assert all(
        s.sender != "m02" and s.recipient != "m02"
        for msg in r.share_msgs.values()
        for s in msg.shares
    )
    assert "m02" not in relays
    r.masked_input()
    r.unmask()
    result = r.server.finalize()
    assert "m02" not in result.survivors + result.dropped
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_member_lost_after_share_keys_not_a_participant() -> None:
    params = make_params(8, 4, 2)
    r = Round(params)
    r.advertise()
    relays = r.share_keys(lost={"m06"})
    assert "m06" not in r.server.participants
    assert all("m06" not in relay.participants for relay in relays.values())
    assert all(s.sender != "m06" for relay in relays.values() for s in relay.shares)
    r.masked_input()
    r.unmask()
    result = r.server.finalize()
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_member_lost_after_shares_has_its_mask_key_recovered() -> None:
    params = make_params(8, 4, 2)
    r = Round(params)
    r.advertise()
    r.share_keys()
    request = r.masked_input(lost={"m01", "m04"})
    assert request.dropped == ("m01", "m04")
    assert "m01" not in request.survivors
    r.unmask()
    # each survivor that neighbours a dropped member revealed its key share, not its seed share
    for m, response in r.responses.items():
        neighbours = r.server.graph.neighbors(m)
        assert {o for o, _ in response.key_shares} == neighbours & {"m01", "m04"}
        assert {o for o, _ in response.seed_shares} == neighbours - {"m01", "m04"}
    result = r.server.finalize()
    assert result.dropped == ("m01", "m04")
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_losses_during_unmask_fine_while_t_shares_remain() -> None:
    params = make_params(7, 6, 3)  # classic: every secret has 6 holders, 3 needed
    r = Round(params)
    result = r.run(lost_masked={"m00"}, lost_unmask={"m01", "m02"})
    assert result.dropped == ("m00",)
    assert set(result.survivors) == set(params.cohort) - {"m00"}  # unmask silence != dropped
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_too_many_unmask_losses_names_who_is_missing() -> None:
    params = make_params(7, 6, 4)  # classic: each secret has 6 holders, 4 needed
    r = Round(params)
    r.advertise()
    r.share_keys()
    r.masked_input()
    r.unmask(lost={"m01", "m02", "m03"})  # m00's seed: only m04..m06 answered, 3 < 4
    with pytest.raises(RecoveryImpossible) as info:
        r.server.finalize()
    assert set(info.value.missing) == {"m01", "m02", "m03"}
    assert r.server.stage is ServerStage.UNMASK  # still open
    # a late answer from one of them rescues the round
    r.server.receive_unmask(r.clients["m01"].unmask(r.proofs["m01"]))
    result = r.server.finalize()
    assert result.survivors == params.cohort
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_too_many_unmask_losses_missing_is_exact_for_a_sparse_graph() -> None:
    params = make_params(10, 4, 3)
    r = Round(params)
    r.advertise()
    r.share_keys()
    r.masked_input()
    owner = "m00"
    holders = sorted(r.server.graph.neighbors(owner))
    silent = set(holders[:2])  # 4 holders, 2 silent: 2 left < 3
    r.unmask(lost=silent)
    with pytest.raises(RecoveryImpossible) as info:
        r.server.finalize()
    assert set(info.value.missing) == silent
    assert owner in str(info.value)


def test_too_few_advertise_aborts() -> None:
    params = make_params(5, 4, 3)
    r = Round(params)
    with pytest.raises(RoundAborted):
        r.advertise(lost={"m00", "m01"})  # 3 left, need max(t, 2) + 1 = 4
    assert r.server.stage is ServerStage.ADVERTISE


def test_too_few_masked_inputs_aborts() -> None:
    params = make_params(5, 4, 3)
    r = Round(params)
    r.advertise()
    r.share_keys()
    with pytest.raises(RoundAborted):
        r.masked_input(lost={"m00", "m01"})
    assert r.server.stage is ServerStage.MASKED_INPUT


def test_dropped_member_whose_neighbours_all_dropped_needs_no_recovery() -> None:
    # ring graph, t = 1: three consecutive members lost at masked input leave the middle one
    # with no surviving neighbour, so no survivor masked with it and its key is not needed.
    params = make_params(12, 2, 1)
    r = Round(params)
    r.advertise()
    r.share_keys()
    graph = r.server.graph
    middle = "m00"
    a, b = sorted(graph.neighbors(middle))
    lost = {middle, a, b}
    r.masked_input(lost=lost)
    r.unmask()
    result = r.server.finalize()
    assert set(result.dropped) == lost
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_unmask_is_decided_once_every_secret_has_t_plus_one_shares() -> None:
    # classic SecAgg, 9 members, t = 3: every secret has 8 holders (7 after a dropout)
    params = make_params(9, 8, 3)
    r = Round(params)
    r.advertise()
    r.share_keys()
    request = r.masked_input(lost={"m08"})
    proofs = r.consistency()
    assert not r.server.ready_to_finalize()
    answered: list[str] = []
    for m in request.survivors:
        if r.server.ready_to_finalize():
            break
        r.server.receive_unmask(r.clients[m].unmask(proofs[m]))
        answered.append(m)
    # a seed's holders are the other survivors; t + 1 = 4 of them hold a share of each
    # seed once m00..m04 answered (m00's seed: m01..m04)
    assert answered == ["m00", "m01", "m02", "m03", "m04"]
    assert r.server.answered != r.server.survivors  # decided without m04..m07
    result = r.server.finalize()
    assert result.survivors == params.cohort[:8] and result.dropped == ("m08",)
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_unmask_is_not_decided_while_a_secret_lacks_its_check_share() -> None:
    params = make_params(10, 4, 3)  # sparse: each secret has 4 holders, t + 1 = 4
    r = Round(params)
    r.advertise()
    r.share_keys()
    request = r.masked_input()
    proofs = r.consistency()
    graph = r.server.graph
    # everyone answers but two neighbours of m00: m00's seed has 2 shares, fewer than t
    silent = sorted(graph.neighbors("m00"))[:2]
    for m in request.survivors:
        if m not in silent:
            r.server.receive_unmask(r.clients[m].unmask(proofs[m]))
    assert not r.server.ready_to_finalize()
    # one more answer gives m00's seed t = 3 shares but not the fourth that checks them
    r.server.receive_unmask(r.clients[silent[0]].unmask(proofs[silent[0]]))
    assert not r.server.ready_to_finalize()
    r.server.receive_unmask(r.clients[silent[1]].unmask(proofs[silent[1]]))
    assert r.server.ready_to_finalize()
    result = r.server.finalize()
    assert [int(v) for v in result.ring_sum] == r.plain_sum(result.survivors)


def test_ready_to_finalize_is_false_outside_the_unmask_stage() -> None:
    r = Round(make_params(5))
    assert not r.server.ready_to_finalize()
    r.advertise()
    r.share_keys()
    assert not r.server.ready_to_finalize()
