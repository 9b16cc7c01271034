"""Who a peer's neighbours are: a random k-regular graph from a seed the admin signs.

The graph is the SecAgg+ neighbour graph (:class:`fedsec.crypto.secagg.graph.NeighbourGraph`,
a Harary graph over an order fixed by the seed), built over the roster's key ids in sorted
order, so every member computes the same graph from the signed seed and the roster alone
and no member can choose its own neighbours.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.crypto.secagg.graph import NeighbourGraph, round_graph
from fedsec.errors import ConfigError, ProtocolError

#: The signature domain of a topology statement (fedsec.crypto.identity domains).
TOPOLOGY_DOMAIN = "peer-topology"
#: Bytes of a topology seed: 256 bits, so no member can grind the roster for a seed.
SEED_BYTES = 32


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
) -> NeighbourGraph:
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
    return round_graph(tuple(sorted(members)), topology.degree, seed)
