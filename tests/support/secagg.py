"""Drive a SecAgg+ round between real ClientSessions and a ServerSession, stage by stage.

No transport: messages are handed over directly, and a member "drops" by simply not
being handed its next message (or by its answer never reaching the server).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsec.crypto.errors import ProtocolError
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec, default_ring_bits, quantize
from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ClientSession,
    ConsistencyProof,
    ConsistencySignature,
    KeyList,
    MaskedInput,
    RoundResult,
    SecAggParams,
    ServerSession,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
    default_neighbors,
)
from fedsec.crypto.secagg.messages import graph_commitment


def member_ids(n: int) -> tuple[str, ...]:
    return tuple(f"m{i:02d}" for i in range(n))


def identity_for(member: str) -> SigningIdentity:
    return SigningIdentity(hashlib.sha256(b"identity/" + member.encode()).digest())


def make_params(
    n: int,
    neighbors: int | None = None,
    threshold: int | None = None,
    *,
    bits: int = 8,
    dim: int = 6,
    clip: float = 1.0,
    federation: str = "fed-test",
    round_: int = 1,
    seed: bytes = b"\x07" * 32,
    graph_nonces: dict[str, bytes] | None = None,
) -> SecAggParams:
    """``graph_nonces``: each member's graph nonce, committed to in the parameters (the
    graph then comes from the nonces revealed at advertise); None: from ``seed`` alone."""
    k_default, t_default = default_neighbors(n)
    k = k_default if neighbors is None else neighbors
    t = (k // 2 + 1 if neighbors is not None else t_default) if threshold is None else threshold
    quant = QuantSpec(bits, clip, default_ring_bits(bits, n))
    cohort = member_ids(n)
    commitments = (
        tuple(graph_commitment(federation, round_, m, graph_nonces[m]) for m in cohort)
        if graph_nonces is not None
        else ()
    )
    return SecAggParams(
        federation, round_, cohort, k, t, quant, dim, seed, graph_commitments=commitments
    )


def raw_updates(params: SecAggParams, salt: int = 0) -> dict[str, tuple[np.ndarray, float]]:
    """Deterministic random updates and weights, one per cohort member."""
    out = {}
    for i, member in enumerate(params.cohort):
        digest = hashlib.sha256(f"{salt}/{member}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "big"))
        delta = rng.normal(scale=params.quant.clip, size=params.dim).astype(np.float32)
        out[member] = (delta, [1.0, 0.5, 0.0, 0.25, 1.0][i % 5])
    return out


def quantize_all(
    params: SecAggParams, updates: dict[str, tuple[np.ndarray, float]]
) -> dict[str, np.ndarray]:
    return {
        m: quantize(delta, weight, params.quant, hashlib.sha256(m.encode()).digest())
        for m, (delta, weight) in updates.items()
    }


@dataclass
class Round:
    """A round in progress; each step hands messages to whoever is still there."""

    params: SecAggParams
    roster: dict[str, bytes] = field(init=False)
    clients: dict[str, ClientSession] = field(init=False)
    server: ServerSession = field(init=False)
    updates: dict[str, tuple[np.ndarray, float]] = field(init=False)
    inputs: dict[str, np.ndarray] = field(init=False)
    adverts: dict[str, AdvertiseKeys] = field(default_factory=dict)
    key_list: KeyList | None = None
    share_msgs: dict[str, ShareKeys] = field(default_factory=dict)
    relays: dict[str, ShareRelay] = field(default_factory=dict)
    masked: dict[str, MaskedInput] = field(default_factory=dict)
    request: UnmaskRequest | None = None
    signatures: dict[str, ConsistencySignature] = field(default_factory=dict)
    proofs: dict[str, ConsistencyProof] = field(default_factory=dict)
    # γ each member's session checks the threshold against; None: any threshold
    tolerated_corrupt: int | None = None
    # the members' graph nonces, when the parameters carry their commitments
    graph_nonces: dict[str, bytes] = field(default_factory=dict)
    responses: dict[str, UnmaskResponse] = field(default_factory=dict)
    # survivors that refused to unmask (too few neighbours signed their sets)
    refused: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        cohort = self.params.cohort
        identities = {m: identity_for(m) for m in cohort}
        self.roster = {m: identities[m].public_bytes for m in cohort}
        self.clients = {
            m: ClientSession(
                self.params,
                m,
                identities[m],
                self.roster,
                tolerated_corrupt=self.tolerated_corrupt,
                graph_nonce=self.graph_nonces.get(m, b""),
            )
            for m in cohort
        }
        self.server = ServerSession(self.params, self.roster)
        self.updates = raw_updates(self.params)
        self.inputs = quantize_all(self.params, self.updates)

    # -- stages --------------------------------------------------------------------------

    def advertise(self, lost: Iterable[str] = ()) -> KeyList:
        lost = set(lost)
        for m, client in self.clients.items():
            if m not in lost:
                self.adverts[m] = client.advertise()
                self.server.receive_advertise(self.adverts[m])
        self.key_list = self.server.close_advertise()
        return self.key_list

    def share_keys(self, lost: Iterable[str] = ()) -> dict[str, ShareRelay]:
        assert self.key_list is not None
        lost = set(lost)
        for m in sorted(self.server.live):
            msg = self.clients[m].share_keys(self.key_list)
            if m not in lost:
                self.share_msgs[m] = msg
                self.server.receive_share_keys(msg)
        self.relays = self.server.close_share_keys()
        for m, relay in self.relays.items():
            self.clients[m].receive_shares(relay)
        return self.relays

    def masked_input(self, lost: Iterable[str] = ()) -> UnmaskRequest:
        lost = set(lost)
        for m in sorted(self.server.participants):
            if m not in lost:
                self.masked[m] = self.clients[m].masked_input(self.inputs[m])
                self.server.receive_masked_input(self.masked[m])
        self.request = self.server.close_masked_input()
        return self.request

    def consistency(self, lost: Iterable[str] = ()) -> dict[str, ConsistencyProof]:
        assert self.request is not None
        lost = set(lost)
        for m in self.request.survivors:
            if m not in lost:
                self.signatures[m] = self.clients[m].sign_survivors(self.request)
                self.server.receive_consistency(self.signatures[m])
        self.proofs = self.server.close_consistency()
        return self.proofs

    def unmask(self, lost: Iterable[str] = ()) -> None:
        if not self.proofs:
            self.consistency()
        lost = set(lost)
        for m, proof in self.proofs.items():
            if m not in lost:
                try:
                    self.responses[m] = self.clients[m].unmask(proof)
                except ProtocolError:
                    self.refused.add(m)
                    continue
                self.server.receive_unmask(self.responses[m])

    def run(
        self,
        lost_advertise: Iterable[str] = (),
        lost_share: Iterable[str] = (),
        lost_masked: Iterable[str] = (),
        lost_unmask: Iterable[str] = (),
    ) -> RoundResult:
        self.advertise(lost_advertise)
        self.share_keys(lost_share)
        self.masked_input(lost_masked)
        self.unmask(lost_unmask)
        return self.server.finalize()

    def plain_sum(self, members: Iterable[str]) -> list[int]:
        """Exact integer sum of the members' quantized inputs (no ring, no masks)."""
        return [int(v) for v in sum(self.inputs[m].astype(object) for m in members)]


def server_state(server: ServerSession) -> tuple[Any, ...]:
    """Everything a refused message must leave unchanged."""
    return (
        server.stage,
        dict(server.advertised),
        server.live,
        {m: msg for m, msg in server._shares.items()},
        server.participants,
        tuple(server.contributed),
        None if server._sum._taken else server._sum.total().tobytes(),  # taken at finalize
        server.survivors,
        server.dropped,
        dict(server.signatures),
        frozenset(server._responses),
        {m: tuple(v) for m, v in server._seed_shares.items()},
        {m: tuple(v) for m, v in server._key_shares.items()},
    )


def client_state(client: ClientSession) -> tuple[Any, ...]:
    return (
        client.stage,
        dict(client._keys),
        client._live,
        client._participants,
        dict(client._held),
        client._signed,
    )
