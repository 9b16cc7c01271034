"""The SecAgg+ neighbour graph: regular, symmetric, seed-determined; pruning; default (k, t)."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from fedsec.crypto.secagg.graph import (
    DEFAULT_TOLERATED_CORRUPT,
    NeighbourGraph,
    check_threshold,
    default_neighbors,
    default_threshold,
    max_degree,
    member_x,
    prune,
    unrecoverable_bound,
)
from fedsec.errors import ProtocolError

SEED = b"\x11" * 32


def _cohort(n: int) -> list[str]:
    return [f"m{i:03d}" for i in range(n)]


def _edges(graph: NeighbourGraph) -> set[frozenset[str]]:
    return {frozenset((a, b)) for a in graph.cohort for b in graph.neighbors(a)}


@pytest.mark.parametrize("n", range(3, 41))
def test_degrees_exact_and_symmetric(n: int) -> None:
    cohort = _cohort(n)
    for k in range(2, n):
        graph = NeighbourGraph(cohort, k, SEED)
        degrees = sorted(len(graph.neighbors(m)) for m in cohort)
        if (n * k) % 2 == 1:
            assert degrees == [k] * (n - 1) + [k + 1], (n, k)
        else:
            assert degrees == [k] * n, (n, k)
        for a in cohort:
            assert a not in graph.neighbors(a)
            for b in graph.neighbors(a):
                assert a in graph.neighbors(b), (n, k, a, b)


@pytest.mark.parametrize("n", [3, 4, 5, 8, 13, 40])
def test_k_equals_n_minus_1_is_complete(n: int) -> None:
    cohort = _cohort(n)
    graph = NeighbourGraph(cohort, n - 1, SEED)
    for m in cohort:
        assert graph.neighbors(m) == frozenset(cohort) - {m}


def test_deterministic_from_seed_and_cohort() -> None:
    cohort = _cohort(30)
    a = NeighbourGraph(cohort, 4, SEED)
    b = NeighbourGraph(list(reversed(cohort)), 4, SEED)  # order of the list does not matter
    assert _edges(a) == _edges(b)
    others = [_edges(NeighbourGraph(cohort, 4, bytes([i]) * 32)) for i in range(5)]
    assert all(edges != _edges(a) for edges in others)
    assert len({frozenset(e) for e in others}) == len(others)


def test_graph_is_connected_ring_structure() -> None:
    # Harary H(n, k) is k-connected; at least check it is connected, so no island of
    # members masks only among themselves.
    for n, k in [(12, 2), (12, 3), (25, 4), (40, 5)]:
        graph = NeighbourGraph(_cohort(n), k, SEED)
        seen, todo = set(), [graph.cohort[0]]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.neighbors(m) - seen)
        assert seen == set(graph.cohort)


def test_live_neighbors_in_cohort_order() -> None:
    cohort = _cohort(10)
    graph = NeighbourGraph(cohort, 4, SEED)
    member = cohort[3]
    alive = set(cohort) - {sorted(graph.neighbors(member))[0]}
    live = graph.live_neighbors(member, alive)
    assert live == [m for m in cohort if m in graph.neighbors(member) and m in alive]
    assert len(live) == 3


@pytest.mark.parametrize(
    ("cohort", "k"),
    [(["a", "b"], 1), (["a", "b", "c"], 1), (["a", "b", "c"], 3), (["a", "a", "b", "c"], 2)],
)
def test_bad_graph_parameters(cohort: list[str], k: int) -> None:
    with pytest.raises(ProtocolError):
        NeighbourGraph(cohort, k, SEED)


# -- prune ------------------------------------------------------------------------------------


def _prune_by_definition(graph: NeighbourGraph, alive: set[str], t: int) -> frozenset[str]:
    """Largest subset where everyone has >= t neighbours inside it (brute force)."""
    members = sorted(alive)
    for size in range(len(members), -1, -1):
        for subset in itertools.combinations(members, size):
            s = set(subset)
            if all(len(graph.neighbors(m) & s) >= t for m in s):
                return frozenset(s)
    return frozenset()


@pytest.mark.parametrize("trial", range(30))
def test_prune_is_the_largest_valid_subset(trial: int) -> None:
    digest = hashlib.sha256(trial.to_bytes(2, "big")).digest()
    n = 5 + digest[0] % 6
    k = 2 + digest[1] % (n - 2)
    t = 1 + digest[2] % k
    cohort = _cohort(n)
    graph = NeighbourGraph(cohort, k, digest)
    alive = {m for i, m in enumerate(cohort) if (digest[3 + i] % 3) != 0}
    kept = prune(graph, alive, t)
    assert kept <= alive
    assert all(len(graph.neighbors(m) & kept) >= t for m in kept)
    assert kept == _prune_by_definition(graph, alive, t)


def test_prune_cascades() -> None:
    # ring (k = 2): losing one member leaves its two neighbours with 1 live neighbour;
    # at t = 2 they go, which starves theirs, and so on: nobody survives.
    cohort = _cohort(8)
    graph = NeighbourGraph(cohort, 2, SEED)
    alive = set(cohort) - {cohort[0]}
    assert prune(graph, alive, 2) == frozenset()
    assert prune(graph, alive, 1) == frozenset(alive)
    assert prune(graph, set(cohort), 2) == frozenset(cohort)


def test_prune_does_not_mutate_input() -> None:
    cohort = _cohort(8)
    graph = NeighbourGraph(cohort, 2, SEED)
    alive = set(cohort[1:])
    prune(graph, alive, 2)
    assert alive == set(cohort[1:])


def test_member_x_is_one_based_cohort_position() -> None:
    assert member_x(["a", "b", "c"]) == {"a": 1, "b": 2, "c": 3}


# -- default (k, t) ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [20, 50, 100, 1000])
def test_default_neighbors_meets_target(n: int) -> None:
    k, t = default_neighbors(n)
    assert 2 <= k <= n - 1
    d = max_degree(n, k)
    assert t == default_threshold(d) == (d + DEFAULT_TOLERATED_CORRUPT) // 2 + 1
    assert 2 * t > d + DEFAULT_TOLERATED_CORRUPT  # holds against one colluding neighbour
    check_threshold(n, k, t)
    if k == n - 1:  # classic SecAgg: the most holders a secret can have
        return
    assert unrecoverable_bound(n, k, t, 0.10) < 1e-4
    if k < n - 1:
        assert k < n // 2  # sparse: that is the point of SecAgg+
    # smallest such k
    for smaller in range(2, k):
        t_smaller = default_threshold(max_degree(n, smaller))
        assert t_smaller > smaller or unrecoverable_bound(n, smaller, t_smaller, 0.10) >= 1e-4


def test_default_neighbors_grows_slowly() -> None:
    ks = [default_neighbors(n)[0] for n in (100, 1000, 10000)]
    assert ks == sorted(ks)
    assert ks[-1] < 40  # O(log n), not O(n)


def test_default_neighbors_small_cohorts_fall_back_to_classic() -> None:
    for n in (3, 4, 5):
        k, t = default_neighbors(n)
        assert k == n - 1
        assert t == min(default_threshold(k), k)
        check_threshold(n, k, t)
    with pytest.raises(ProtocolError):
        default_neighbors(2)


def test_unrecoverable_bound_values() -> None:
    # k = 2, t = 2, dropout 0.1: P[Bin(2, 0.9) < 2] = 1 - 0.81 = 0.19 per member
    assert unrecoverable_bound(1, 2, 2, 0.1) == pytest.approx(0.19)
    assert unrecoverable_bound(100, 2, 2, 0.1) == 1.0  # capped
    assert unrecoverable_bound(10, 5, 1, 0.0) == 0.0


@pytest.mark.parametrize(
    ("n", "k", "t", "tolerated"),
    [(10, 7, 4, 1), (10, 7, 4, 0), (10, 9, 5, 1), (9, 3, 2, 0), (50, 21, 11, 1)],
)
def test_a_threshold_an_equivocating_aggregator_can_split_is_refused(
    n: int, k: int, t: int, tolerated: int
) -> None:
    d = max_degree(n, k)
    if 2 * t > d + tolerated:
        check_threshold(n, k, t, tolerated)
        return
    with pytest.raises(ProtocolError, match=f"2t must exceed {d + tolerated}"):
        check_threshold(n, k, t, tolerated)


def test_max_degree_counts_the_extra_chord_of_an_odd_graph() -> None:
    for n, k in ((9, 3), (11, 5), (10, 4), (9, 8)):
        graph = NeighbourGraph([f"m{i}" for i in range(n)], k, SEED)
        assert max(len(graph.neighbors(m)) for m in graph.cohort) == max_degree(n, k)
