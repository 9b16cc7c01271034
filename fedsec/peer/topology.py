"""Who a peer's neighbours are: a random k-regular graph from a seed the admin signs.

The graph starts as the SecAgg+ neighbour graph (:class:`fedsec.crypto.secagg.graph.NeighbourGraph`,
a Harary graph over an order fixed by the seed) and is then randomised by double-edge
swaps drawn from the seed, which keep every degree and, after a few swaps per edge, leave
a near-uniform random k-regular graph.  The Harary graph alone is a ring lattice: gossip
over it mixes slowly (second eigenvalue of the uniform averaging matrix 0.90 for 20
members of degree 4, against 0.78 for a random 4-regular graph, so a random graph needs
less than half the exchanges for the same consensus).  Built over the roster's key ids in
sorted order with SHA-256 as the only source of randomness, every member computes the
same graph from the signed seed and the roster alone, and no member can choose its own
neighbours.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import msgspec

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.crypto.secagg.graph import round_graph
from fedsec.errors import ConfigError, ProtocolError

#: The signature domain of a topology statement (fedsec.crypto.identity domains).
TOPOLOGY_DOMAIN = "peer-topology"
#: Bytes of a topology seed: 256 bits, so no member can grind the roster for a seed.
SEED_BYTES = 32
#: Double-edge swaps tried per edge: the swap chain on k-regular graphs mixes within a few
#: swaps per edge in practice (Milo et al. 2003 use 100 in all; 10 per edge is the
#: common rule), and a graph of 1,000 members of degree 8 costs 30,000 SHA-256 blocks.
SWAPS_PER_EDGE: Final = 10


class PeerGraph:
    """Who neighbours whom: ``neighbors(m)`` excludes ``m`` itself."""

    __slots__ = ("_adjacent", "degree")

    def __init__(self, adjacent: dict[str, frozenset[str]], degree: int) -> None:
        self._adjacent = adjacent
        self.degree = degree

    def neighbors(self, member: str) -> frozenset[str]:
        return self._adjacent[member]


class SignedTopology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The admin's statement: in ``federation_id`` peers gossip over the degree-``degree``
    graph drawn from ``seed`` (hex)."""

    federation_id: str
    seed: str
    degree: int
    signature: str = ""  # hex Ed25519 over the other fields, domain peer-topology

    def statement(self) -> bytes:
        return canonical_json(
            {"federation_id": self.federation_id, "seed": self.seed, "degree": self.degree}
        )


def sign_topology(
    admin: SigningIdentity, federation_id: str, seed: bytes, degree: int
) -> SignedTopology:
    """The admin's signed topology statement.

    Raises:
        ConfigError: a seed that is not :data:`SEED_BYTES` long.
    """
    if len(seed) != SEED_BYTES:
        raise ConfigError(f"a topology seed is {SEED_BYTES} bytes, got {len(seed)}")
    unsigned = SignedTopology(federation_id, seed.hex(), degree)
    signature = admin.sign(TOPOLOGY_DOMAIN, unsigned.statement()).hex()
    return SignedTopology(federation_id, seed.hex(), degree, signature)


def topology_graph(
    topology: SignedTopology, admin_public: bytes, federation_id: str, members: Iterable[str]
) -> PeerGraph:
    """The graph ``topology`` draws over ``members`` (key ids), once its signature and
    federation check.

    Raises:
        SignatureError: the admin did not sign it.
        ProtocolError: it names another federation, a malformed seed, or a degree the
            roster cannot have (2..members − 1; at least 3 members).
    """
    if topology.federation_id != federation_id:
        raise ProtocolError(
            f"the topology is for federation {topology.federation_id!r}, not {federation_id!r}"
        )
    try:
        signature = bytes.fromhex(topology.signature)
        seed = bytes.fromhex(topology.seed)
    except ValueError:
        raise ProtocolError("the topology's seed or signature is not hex") from None
    PublicIdentity(admin_public).verify(TOPOLOGY_DOMAIN, topology.statement(), signature)
    if len(seed) != SEED_BYTES:
        raise ProtocolError(f"a topology seed is {SEED_BYTES} bytes, got {len(seed)}")
    lattice = round_graph(tuple(sorted(members)), topology.degree, seed)
    return _randomised(lattice.cohort, lattice.neighbors, topology.degree, seed)


def _randomised(
    cohort: tuple[str, ...], lattice: Callable[[str], frozenset[str]], degree: int, seed: bytes
) -> PeerGraph:
    """The lattice after :data:`SWAPS_PER_EDGE` double-edge swaps per edge (a, b), (c, d)
    -> (a, d), (c, b), each refused when it would make a loop, a double edge or cut the
    graph in two (checked once at the end: a cut graph swaps on until joined)."""
    adjacent = {m: set(lattice(m)) for m in cohort}
    edges = sorted({(a, b) if a < b else (b, a) for a in cohort for b in adjacent[a]})
    draws = _draws(seed)
    attempts = SWAPS_PER_EDGE * len(edges)
    while True:
        for _ in range(attempts):
            i, j = next(draws) % len(edges), next(draws) % len(edges)
            (a, b), (c, d) = edges[i], edges[j]
            if next(draws) % 2:
                c, d = d, c
            if len({a, b, c, d}) < 4 or d in adjacent[a] or b in adjacent[c]:
                continue
            for x, y, z in ((a, b, d), (b, a, c), (c, d, b), (d, c, a)):
                adjacent[x].discard(y)
                adjacent[x].add(z)
            edges[i], edges[j] = (min(a, d), max(a, d)), (min(c, b), max(c, b))
        if _connected(adjacent):
            return PeerGraph({m: frozenset(v) for m, v in adjacent.items()}, degree)
        attempts = len(edges)


def _draws(seed: bytes) -> Iterator[int]:
    """Integers below 2**64 from SHA-256 over the seed and a counter: the same on every
    member's machine, whatever its library versions."""
    counter = 0
    while True:
        block = hashlib.sha256(b"peer-topology-swaps" + seed + counter.to_bytes(8, "big")).digest()
        counter += 1
        for k in range(0, 32, 8):
            yield int.from_bytes(block[k : k + 8], "big")


def _connected(adjacent: dict[str, set[str]]) -> bool:
    start = next(iter(adjacent))
    seen, todo = {start}, [start]
    while todo:
        for n in adjacent[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return len(seen) == len(adjacent)
