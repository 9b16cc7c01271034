"""Who shares secrets with whom: the SecAgg+ neighbour graph and its survivors.

The graph is a Harary graph H(n, k) over a random ordering of the cohort, the
construction of Bell et al. (2020): members sit on a ring in an order fixed by
the round seed, each is joined to its ⌊k/2⌋ nearest members on either side and,
for odd k, to the member opposite.  Every member has exactly k neighbours;
when n·k is odd (odd n, odd k) a regular graph cannot exist and one member gets
k + 1.  k = n − 1 is the complete graph, i.e. classic SecAgg.

Everybody computes the same graph from (seed, cohort) alone, so the aggregator
cannot choose who a member's neighbours are.

Surviving members: a member whose secrets are held by fewer than ``threshold``
surviving neighbours could never be unmasked if it dropped later, so
:func:`prune` removes such members (repeatedly, since a removal can leave a
neighbour short too).  Server and members apply the same rule to the same sets.

Threshold against an equivocating aggregator (:func:`check_threshold`): an
aggregator may tell some of a member's neighbours "it survived" (collecting
shares of its self-mask seed) and the others "it dropped" (collecting shares of
its mask key).  Each honest neighbour answers one unmask request only, and a
corrupt one hands over both of its shares, so with γ corrupt neighbours among
the d holders of a member's secrets the aggregator gets t of each kind only if
2(t − γ) ≤ d − γ.  Members therefore refuse a round unless 2t > d + γ for the
largest degree d of the graph and the γ they tolerate
(:data:`DEFAULT_TOLERATED_CORRUPT` unless their config says otherwise); the
consistency round (every survivor signs the survivor set it was told, and
unmasks only on t of its neighbours' signatures on the identical set) keeps the
honest members' views of that set the same where the aggregator cannot split it.

Default neighbours and threshold (:func:`default_neighbors`): t = ⌊(d + γ)/2⌋ + 1
with γ = :data:`DEFAULT_TOLERATED_CORRUPT`, the least threshold that holds
against an aggregator with γ colluding neighbours; k is the smallest value for
which, with each member independently lost with probability ``dropout`` (10 %) by the end of the
round, the union bound n · P[Binomial(k, 1 − dropout) < t] on "some member's
secret has too few surviving holders" is below ``target`` (10⁻⁴).  Where no
k < n − 1 achieves it, classic SecAgg (k = n − 1) is used.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from fedsec.crypto.errors import ProtocolError

DEFAULT_DROPOUT = 0.10
DEFAULT_FAILURE_TARGET = 1e-4
#: Corrupt neighbours a member tolerates by default, γ: one, so that an aggregator and
#: one colluding member together cannot open a member's input by equivocation.  Every
#: further colluder tolerated raises t by about one half, and with it the neighbours a
#: round needs for the same dropout tolerance.
DEFAULT_TOLERATED_CORRUPT = 1


class NeighbourGraph:
    """The round's neighbour relation; ``neighbors(m)`` excludes ``m`` itself."""

    __slots__ = ("_adjacent", "_in_order", "cohort", "degree")

    def __init__(self, cohort: Sequence[str], neighbors: int, seed: bytes) -> None:
        n = len(cohort)
        if len(set(cohort)) != n:
            raise ProtocolError("cohort lists a member twice")
        if n < 3:
            raise ProtocolError(f"a secure round needs at least 3 members, got {n}")
        if not 2 <= neighbors <= n - 1:
            raise ProtocolError(
                f"neighbours must be in 2..{n - 1} for {n} members, got {neighbors}"
            )
        self.cohort = tuple(cohort)
        self.degree = neighbors
        ring = sorted(cohort, key=lambda m: hashlib.sha256(seed + b"\x00" + m.encode()).digest())
        adjacent: dict[str, set[str]] = {m: set() for m in ring}

        def join(a: int, b: int) -> None:
            if a % n != b % n:
                adjacent[ring[a % n]].add(ring[b % n])
                adjacent[ring[b % n]].add(ring[a % n])

        for i in range(n):
            for step in range(1, neighbors // 2 + 1):
                join(i, i + step)
        if neighbors % 2 == 1:
            if n % 2 == 0:
                for i in range(n // 2):
                    join(i, i + n // 2)
            else:  # n·k odd: the chords i -> i + (n+1)/2 give member 0 one extra edge
                for i in range((n + 1) // 2):
                    join(i, i + (n + 1) // 2)
        self._adjacent = {m: frozenset(v) for m, v in adjacent.items()}
        # each member's neighbours in cohort order, so a live subset costs O(k), not O(n)
        position = {m: i for i, m in enumerate(self.cohort)}
        self._in_order = {m: sorted(v, key=position.__getitem__) for m, v in adjacent.items()}

    def neighbors(self, member: str) -> frozenset[str]:
        return self._adjacent[member]

    def live_neighbors(self, member: str, alive: Collection[str]) -> list[str]:
        """Neighbours of ``member`` that are in ``alive``, in cohort order."""
        return [m for m in self._in_order[member] if m in alive]


@functools.lru_cache(maxsize=16)
def round_graph(cohort: tuple[str, ...], neighbors: int, seed: bytes) -> NeighbourGraph:
    """The graph of one round, built once per process: it is a pure function of its
    arguments and immutable, and in a simulation every member of the round (and the
    server) would otherwise rebuild the same one."""
    return NeighbourGraph(cohort, neighbors, seed)


def prune(graph: NeighbourGraph, alive: Iterable[str], threshold: int) -> frozenset[str]:
    """Largest subset of ``alive`` in which every member has ≥ ``threshold`` live neighbours.

    The subset is unique (any member it keeps has enough neighbours in it, whatever
    the order of removals), so the whole cohort with ``degree >= threshold``, the
    common case of a round without losses, is returned without counting.
    """
    current = set(alive)
    if (
        graph.degree >= threshold
        and len(current) == len(graph.cohort)
        and current.issuperset(graph.cohort)
    ):
        return frozenset(current)
    changed = True
    while changed:
        changed = False
        for member in sorted(current):
            if len(graph.neighbors(member) & current) < threshold:
                current.discard(member)
                changed = True
    return frozenset(current)


def member_x(cohort: Sequence[str]) -> Mapping[str, int]:
    """Shamir x-coordinate of each member: its 1-based position in the cohort."""
    return {m: i + 1 for i, m in enumerate(cohort)}


def binomial_cdf_below(k: int, p_survive: float, t: int) -> float:
    """P[Binomial(k, p_survive) < t]."""
    return sum(
        math.comb(k, j) * p_survive**j * (1 - p_survive) ** (k - j) for j in range(min(t, k + 1))
    )


def max_degree(members: int, neighbors: int) -> int:
    """The most neighbours any member has: k, or k + 1 for one member when n·k is odd."""
    return neighbors + 1 if members * neighbors % 2 and neighbors < members - 1 else neighbors


def default_threshold(neighbors: int, tolerated: int = DEFAULT_TOLERATED_CORRUPT) -> int:
    """The least t with 2t > d + γ, for d = ``neighbors`` holders and γ = ``tolerated``."""
    return (neighbors + tolerated) // 2 + 1


def check_threshold(
    members: int, neighbors: int, threshold: int, tolerated: int = DEFAULT_TOLERATED_CORRUPT
) -> None:
    """Refuse a threshold an aggregator with ``tolerated`` colluding neighbours of a
    member could get around by equivocation (see the module docstring).

    Raises:
        ProtocolError: 2t ≤ d + γ for the graph's largest degree d.
    """
    if tolerated < 0:
        raise ProtocolError(f"tolerated corrupt neighbours must be ≥ 0, got {tolerated}")
    d = max_degree(members, neighbors)
    if 2 * threshold <= d + tolerated:
        raise ProtocolError(
            f"threshold {threshold} with up to {d} neighbours lets an equivocating aggregator "
            f"with {tolerated} colluding neighbour(s) collect both shares of a member: "
            f"2t must exceed {d + tolerated}, so t must be at least "
            f"{default_threshold(d, tolerated)}; refusing the round"
        )


def unrecoverable_bound(members: int, neighbors: int, threshold: int, dropout: float) -> float:
    """Union bound on P[some member's secret has fewer than t surviving holders]."""
    return min(1.0, members * binomial_cdf_below(neighbors, 1.0 - dropout, threshold))


def default_neighbors(
    members: int,
    dropout: float = DEFAULT_DROPOUT,
    target: float = DEFAULT_FAILURE_TARGET,
) -> tuple[int, int]:
    """(k, t) for a cohort of ``members``; see the module docstring for the rule."""
    if members < 3:
        raise ProtocolError(f"a secure round needs at least 3 members, got {members}")
    for k in range(2, members - 1):
        t = default_threshold(max_degree(members, k))
        if t <= k and unrecoverable_bound(members, k, t, dropout) < target:
            return k, t
    k = members - 1
    return k, min(default_threshold(k), k)
