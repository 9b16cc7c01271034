"""Round parameters and the typed messages of one SecAgg+ round.

Messages are plain immutable values; the transport (fedsec.protocol.wire) turns them
into JSON and binary bodies.  :class:`AdvertiseKeys` and :class:`ConsistencySignature`
carry signatures of their own: they are relayed to other members, who must be able to
check that the aggregator did not substitute keys or invent a member's view of the
survivors.  Every other message is authenticated by the transport's request signature
(agent -> aggregator) or by AEAD (shares).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from fedsec.crypto.errors import ProtocolError
from fedsec.crypto.identity import canonical_json
from fedsec.crypto.quantize import QuantSpec, packed_size
from fedsec.crypto.shamir import MAX_X

ADVERTISE_DOMAIN = "secagg-advertise-keys"
CONSISTENCY_DOMAIN = "secagg-consistency"
SEED_BYTES = 32
#: A member's share of the neighbour graph's randomness: committed when it joins (before
#: the aggregator signs the spec), revealed in its signed advertisement.
GRAPH_NONCE_BYTES = 32
_GRAPH_COMMITMENT_PREFIX = b"fedsec/secagg-graph-nonce/v1\x00"
_GRAPH_SEED_PREFIX = b"fedsec/secagg-graph-seed/v1\x00"


def graph_commitment(federation_id: str, round_: int, member: str, nonce: bytes) -> bytes:
    """SHA-256 commitment to a member's graph nonce, bound to federation, round and member.

    Raises:
        ProtocolError: the nonce is not :data:`GRAPH_NONCE_BYTES` long.
    """
    if len(nonce) != GRAPH_NONCE_BYTES:
        raise ProtocolError(f"graph nonce must be {GRAPH_NONCE_BYTES} bytes")
    return hashlib.sha256(
        _GRAPH_COMMITMENT_PREFIX + canonical_json([federation_id, round_, member, nonce.hex()])
    ).digest()


#: Largest cohort of any round (fedsec.protocol.limits re-exports it for every mode):
#: a member's Shamir x-coordinate is its 1-based place in the cohort and travels in 2
#: bytes (:data:`fedsec.crypto.shamir.MAX_X`), so 65,535 members is the most SecAgg+ can
#: address.
MAX_COHORT = MAX_X
MAX_MEMBER_ID = 128


@dataclass(frozen=True, slots=True)
class SecAggParams:
    """Everything both sides must agree on for one round."""

    federation_id: str
    round: int
    cohort: tuple[str, ...]
    neighbors: int
    threshold: int
    quant: QuantSpec
    dim: int  # model parameters; the masked vector has dim + 1 elements (weight last)
    seed: bytes
    # the codec sums modulo the ring on purpose (a centred decoding whose wraps it counts),
    # so the cohort may exceed what the ring holds without wrapping
    wraps: bool = False
    # each cohort member's commitment to its graph nonce, in cohort order; empty: the
    # graph comes from ``seed`` alone (rounds without the commit-reveal, tests, benchmarks)
    graph_commitments: tuple[bytes, ...] = ()
    # computed once: a member checks ~k signatures and derives ~k pair seeds bound to it
    _digest: bytes = field(init=False, repr=False, compare=False)
    # member -> its place in the cohort, computed once: each advertisement's commitment is
    # looked up by it (a scan of the cohort was O(n) per advertisement, O(n^2) a round)
    _position: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.cohort)
        if n > MAX_COHORT:
            raise ProtocolError(f"cohort of {n} exceeds the maximum {MAX_COHORT}")
        if list(self.cohort) != sorted(set(self.cohort)):
            raise ProtocolError("cohort must be sorted and without duplicates")
        for member in self.cohort:
            if not 0 < len(member) <= MAX_MEMBER_ID:
                raise ProtocolError(f"member id must be 1..{MAX_MEMBER_ID} characters")
        if not 2 <= self.neighbors <= n - 1:
            raise ProtocolError(f"neighbours must be in 2..{n - 1} for {n} members")
        if not 1 <= self.threshold <= self.neighbors:
            raise ProtocolError(f"threshold must be in 1..{self.neighbors}, got {self.threshold}")
        if n > self.quant.max_members() and not self.wraps:
            raise ProtocolError(
                f"{n} members overflow ring 2^{self.quant.ring_bits} at {self.quant.bits} bits"
            )
        if self.dim < 1:
            raise ProtocolError(f"dimension must be positive, got {self.dim}")
        if len(self.seed) != SEED_BYTES:
            raise ProtocolError(f"round seed must be {SEED_BYTES} bytes")
        if self.graph_commitments and (
            len(self.graph_commitments) != n or any(len(c) != 32 for c in self.graph_commitments)
        ):
            raise ProtocolError("graph commitments must be one 32-byte hash per cohort member")
        object.__setattr__(self, "_digest", self._compute_digest())
        object.__setattr__(self, "_position", {m: i for i, m in enumerate(self.cohort)})

    @property
    def vector_length(self) -> int:
        return self.dim + 1

    @property
    def vector_bytes(self) -> int:
        return packed_size(self.vector_length, self.quant.ring_bits)

    def digest(self) -> bytes:
        """SHA-256 over every parameter: binds signatures and masks to this exact round."""
        return self._digest

    def has_member(self, member: str) -> bool:
        """``member`` is in the cohort (a dictionary look-up, not a scan of it)."""
        return member in self._position

    def commitment_of(self, member: str) -> bytes | None:
        """``member``'s graph-nonce commitment; None in a round without them."""
        if not self.graph_commitments:
            return None
        position = self._position.get(member)
        if position is None:
            raise ValueError(f"{member!r} is not in the cohort")  # as tuple.index did
        return self.graph_commitments[position]

    def opens_commitment(self, member: str, nonce: bytes) -> bool:
        """``nonce`` is the one ``member``'s commitment in these parameters was made to
        (compared in constant time); False for a member without a commitment."""
        committed = self.commitment_of(member) if self.has_member(member) else None
        return (
            committed is not None
            and len(nonce) == GRAPH_NONCE_BYTES
            and hmac.compare_digest(
                graph_commitment(self.federation_id, self.round, member, nonce), committed
            )
        )

    def graph_seed(self, advertised: Iterable[AdvertiseKeys]) -> bytes:
        """The seed of the neighbour graph: ``seed`` alone in a round without graph
        commitments; otherwise a hash over the parameters and the graph nonces every
        advertising member revealed, which nobody knew when the spec was signed and no
        member could choose after seeing another's."""
        if not self.graph_commitments:
            return self.seed
        revealed = sorted((a.member, a.graph_nonce.hex()) for a in advertised)
        return hashlib.sha256(
            _GRAPH_SEED_PREFIX + self.digest() + canonical_json(revealed)
        ).digest()

    def _compute_digest(self) -> bytes:
        return hashlib.sha256(
            canonical_json(
                {
                    "federation_id": self.federation_id,
                    "round": self.round,
                    "cohort": list(self.cohort),
                    "neighbors": self.neighbors,
                    "threshold": self.threshold,
                    "bits": self.quant.bits,
                    "clip": self.quant.clip,
                    "ring_bits": self.quant.ring_bits,
                    "dim": self.dim,
                    "seed": self.seed.hex(),
                }
                # only when set, so the digests of rounds without them stay what they were
                | ({"wraps": True} if self.wraps else {})
                | (
                    {"graph_commitments": [c.hex() for c in self.graph_commitments]}
                    if self.graph_commitments
                    else {}
                )
            )
        ).digest()


@dataclass(frozen=True, slots=True)
class AdvertiseKeys:
    """A member's two ephemeral X25519 public keys, signed with its identity key."""

    member: str
    enc_public: bytes
    mask_public: bytes
    signature: bytes
    graph_nonce: bytes = b""  # revealed: the round's graph commitment opens to it

    @staticmethod
    def signed_bytes(
        params_digest: bytes, member: str, enc: bytes, mask: bytes, graph_nonce: bytes = b""
    ) -> bytes:
        fields = [params_digest.hex(), member, enc.hex(), mask.hex()]
        return canonical_json([*fields, graph_nonce.hex()] if graph_nonce else fields)


@dataclass(frozen=True, slots=True)
class KeyList:
    """The advertised keys of every member still in the round, relayed by the server."""

    entries: tuple[AdvertiseKeys, ...]


@dataclass(frozen=True, slots=True)
class EncryptedShare:
    """Sender's shares (self-mask seed, mask key) for one recipient, sealed end to end."""

    sender: str
    recipient: str
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class ShareKeys:
    """A member's encrypted shares for each of its live neighbours."""

    member: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, slots=True)
class ShareRelay:
    """Shares addressed to ``recipient`` and the members that completed share keys."""

    recipient: str
    participants: tuple[str, ...]
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """A member's masked, packed input vector."""

    member: str
    vector: bytes


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Survivors (reveal their self-mask seed shares) and dropped members (reveal key shares)."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    """One survivor's shares: of survivors' seeds and of dropped members' mask keys."""

    member: str
    seed_shares: tuple[tuple[str, bytes], ...]
    key_shares: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class ConsistencySignature:
    """A survivor's signature on the (survivors, dropped) sets it was told, made before it
    reveals any share (Bonawitz et al. 2017's consistency check)."""

    member: str
    signature: bytes

    @staticmethod
    def signed_bytes(params_digest: bytes, request: UnmaskRequest) -> bytes:
        """What a survivor signs: the round's parameter digest (federation, round, cohort and
        the attempt's fresh seed) and both sets, each sorted."""
        return canonical_json(
            [params_digest.hex(), sorted(request.survivors), sorted(request.dropped)]
        )


@dataclass(frozen=True, slots=True)
class ConsistencyProof:
    """The sets a survivor signed, with the signatures its neighbours made on them, relayed
    by the server: the survivor unmasks only on ``threshold`` valid ones."""

    recipient: str
    request: UnmaskRequest
    signatures: tuple[ConsistencySignature, ...]
