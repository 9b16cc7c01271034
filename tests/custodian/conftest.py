"""A real homomorphic-summation round as the custodian sees it: a transparency log built with
:mod:`fedsec.protocol.log` (genesis, roster, he_context, a signed he round spec, accepted
masked inputs with their members' signed statements, heads by the aggregator key) and the
archive of real framed TenSEAL ciphertexts those entries name.  As the aggregator logs
it, each member's signed commitment to its ciphertext's hash (stage commit) precedes
every ciphertext, and each statement binds the digest of the commitment set."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from fedsec.crypto import he
from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian.check import Custody, LogFollower
from fedsec.errors import NotFound
from fedsec.protocol import wire
from fedsec.protocol.log import GENESIS_PREV, LogEntry, head_body, lines, make_entry
from fedsec.protocol.log_entries import AcceptedEntry, GenesisEntry, LogBody
from fedsec.protocol.roster import sign_roster_entry

FID = "fed-he"
CUSTODIAN = "keeper"
MEMBERS = ("alice", "bob", "carol", "dave")
ROUND, ATTEMPT = 3, 0
DIM = 6  # model parameters; the encrypted vector has DIM + 1 values (the weight last)
QUANT_BITS = 8
# Small parameters keep each test fast: N = 4096, [60, 49] at 2^40 (headroom 2^18).
PARAMS = he.HeParams(4096, (60, 49), 40)


@pytest.fixture(scope="session")
def he_keys() -> tuple[bytes, bytes]:
    """(secret, public) context bytes, made once: key generation is the slow part."""
    return he.generate_keys(PARAMS)


def quantized_update(seed: int, dim: int = DIM) -> np.ndarray:
    """A member's quantized vector: ``dim + 1`` integers drawn uniformly from [0, 2^b - 1]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << QUANT_BITS, dim + 1).astype(np.int64)


@dataclass
class Federation:
    """The parties and a log under construction; each method appends real entries."""

    secret: bytes
    public: bytes
    aggregator: SigningIdentity = field(default_factory=SigningIdentity.generate)
    admin: SigningIdentity = field(default_factory=SigningIdentity.generate)
    custodian: SigningIdentity = field(default_factory=SigningIdentity.generate)
    members: dict[str, SigningIdentity] = field(
        default_factory=lambda: {m: SigningIdentity.generate() for m in MEMBERS}
    )
    entries: list[LogEntry] = field(default_factory=list)
    archive: dict[str, bytes] = field(default_factory=dict)
    plain: dict[str, np.ndarray] = field(default_factory=dict)
    # the attempt under construction: each member's own ciphertext, and the commitments
    # logged so far as (member, sha256), whose digest the next statements bind
    bodies: dict[str, bytes] = field(default_factory=dict)
    commits: list[tuple[str, str]] = field(default_factory=list)
    min_agents: int = 3
    dim: int = DIM

    def __post_init__(self) -> None:
        self.public_ctx = he.load_public_context(
            self.public, PARAMS, PARAMS.context_max_bytes(secret=False)
        )
        self.secret_ctx = he.load_secret_context(
            self.secret, PARAMS, PARAMS.context_max_bytes(secret=True)
        )
        self.context_sha256 = hashlib.sha256(self.public).hexdigest()

    # -- building the log ----------------------------------------------------------------

    def append(self, body: LogBody) -> LogEntry:
        if isinstance(body, wire.RoundSpec):  # a new attempt: nothing committed yet
            self.bodies, self.commits = {}, []
        prev = self.entries[-1].hash if self.entries else GENESIS_PREV
        entry = make_entry(len(self.entries), prev, 1_700_000_000.0 + len(self.entries), body)
        self.entries.append(entry)
        return entry

    def head(self, signer: SigningIdentity | None = None) -> None:
        self.append(head_body(signer or self.aggregator, FID, self.entries[-1]))

    def setup(self) -> Federation:
        """Genesis, roster (members and custodian), the custodian's he_context, a head."""
        self.append(
            GenesisEntry(
                federation_id=FID,
                aggregator_public_key=self.aggregator.public_bytes.hex(),
                admin_public_key=self.admin.public_bytes.hex(),
                task="t",
                task_version="1",
                schema_fingerprint="s",
                server={},
                round={"min_agents": self.min_agents, "secure_sum": "he"},
            )
        )
        for member, identity in self.members.items():
            self.enrol(member, identity, "agent")
        self.enrol(CUSTODIAN, self.custodian, "custodian")
        self.append(self.context_statement())
        self.head()
        return self

    def enrol(self, member: str, identity: SigningIdentity, role: Any) -> None:
        self.append(
            sign_roster_entry(
                federation_id=FID,
                agent_id=member,
                public_key=identity.public_bytes,
                role=role,
                admin=self.admin,
                added_at=1_700_000_000.0,
            )
        )

    def context_statement(self, context_sha256: str | None = None) -> wire.HeContextStatement:
        return wire.HeContextStatement(
            federation_id=FID,
            custodian=CUSTODIAN,
            poly_modulus_degree=PARAMS.poly_modulus_degree,
            coeff_mod_bit_sizes=list(PARAMS.coeff_mod_bit_sizes),
            scale_bits=PARAMS.scale_bits,
            context_sha256=context_sha256 or self.context_sha256,
        ).sign(self.custodian)

    def spec(self, cohort: Sequence[str] = MEMBERS, **changes: Any) -> wire.RoundSpec:
        fields: dict[str, Any] = {
            "federation_id": FID,
            "round": ROUND,
            "attempt": ATTEMPT,
            "secure_sum": "he",
            "model_version": 2,
            "model_sha256": "ab" * 32,
            "task": "t",
            "task_version": "1",
            "schema_fingerprint": "s",
            "cohort": sorted(cohort),
            "neighbors": 0,
            "threshold": 0,
            "quant_bits": QUANT_BITS,
            "ring_bits": 16,
            "clip_norm": 1.0,
            "dim": self.dim,
            "seed": "00" * 32,
            "max_weight_samples": 1000,
            "weight_caps": {},
            "training": wire.TrainingSpec(local_epochs=1, batch_size=32, lr=0.05, optimizer="sgd"),
            "dp": wire.DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5),
            "deadlines": {"masked_input": 60.0, "decrypt": 60.0},
            "he_context_sha256": self.context_sha256,
            "custodian": CUSTODIAN,
        }
        fields.update(changes)
        return wire.RoundSpec(**fields).sign(self.aggregator)

    def encrypted(self, values: np.ndarray) -> bytes:
        return he.frame_chunks(he.encrypt(self.public_ctx, values.astype(np.float64)))

    def prepared(self, member: str) -> bytes:
        """``member``'s own encryption of its update in this attempt (made once)."""
        if member not in self.bodies:
            self.plain[member] = quantized_update(MEMBERS.index(member) + 100 * ROUND, self.dim)
            self.bodies[member] = self.encrypted(self.plain[member])
        return self.bodies[member]

    def commit(
        self,
        members: Sequence[str] = MEMBERS,
        bodies: Mapping[str, bytes] | None = None,
        *,
        signer: SigningIdentity | None = None,
    ) -> None:
        """Log each member's signed commitment to the hash of the ciphertext it will
        upload (``bodies``, else its own encryption), signed by ``signer`` (the member)."""
        for member in members:
            body = (bodies or {}).get(member) or self.prepared(member)
            self.bodies[member] = body
            digest = hashlib.sha256(body).hexdigest()
            signed = wire.CiphertextCommitment(
                federation_id=FID, round=ROUND, attempt=ATTEMPT, member=member, vector_sha256=digest
            ).sign(signer or self.members.get(member) or self.custodian)
            raw = wire.encode(wire.CommitBody(digest, signed.signature))
            self.archive[hashlib.sha256(raw).hexdigest()] = raw
            self.append(
                AcceptedEntry(
                    round=ROUND,
                    attempt=ATTEMPT,
                    stage="commit",
                    member=member,
                    sha256=hashlib.sha256(raw).hexdigest(),
                    bytes=len(raw),
                    commitment=digest,
                    signature=signed.signature,
                )
            )
            self.commits.append((member, digest))

    @property
    def bound(self) -> str:
        """The digest of the commitments logged so far, which a statement binds."""
        return wire.commitments_digest(self.commits)

    def accept(
        self,
        member: str,
        body: bytes | None = None,
        *,
        signer: SigningIdentity | None = None,
        bound: str | None = None,
    ) -> AcceptedEntry:
        """Log ``member``'s masked input (the ciphertext it committed to, or its own
        encryption, by default), with the statement ``signer`` (the member by default)
        signs, binding ``bound`` (the commitments logged so far); archive the bytes."""
        if body is None:
            body = self.prepared(member)
        digest = hashlib.sha256(body).hexdigest()
        statement = wire.ContributionStatement(
            federation_id=FID,
            round=ROUND,
            attempt=ATTEMPT,
            member=member,
            vector_sha256=digest,
            commitment="cd" * 32,
            commitments_sha256=self.bound if bound is None else bound,
        ).sign(signer or self.members[member])
        self.archive[digest] = body
        entry = AcceptedEntry(
            round=ROUND,
            attempt=ATTEMPT,
            stage="masked_input",
            member=member,
            sha256=digest,
            bytes=len(body),
            commitment=statement.commitment,
            signature=statement.signature,
        )
        self.append(entry)
        return entry

    def honest_round(self, members: Sequence[str] = MEMBERS) -> wire.HeSumOffer:
        """Spec, every member's commitment, then its accepted contribution, a head; the
        honest offer."""
        self.append(self.spec())
        self.commit(members)
        for member in members:
            self.accept(member)
        offer = self.offer(members)
        self.head()
        return offer

    def offer(
        self, members: Sequence[str], bodies: Sequence[bytes] | None = None, **changes: Any
    ) -> wire.HeSumOffer:
        """The offer an honest aggregator makes: the digest of the sum of ``bodies``
        (default: the logged contributions of ``members``)."""
        if bodies is None:
            by_member = {
                e.body["member"]: e.body["sha256"]
                for e in self.entries
                if e.kind == "accepted" and e.body["stage"] == "masked_input"
            }
            bodies = [self.archive[by_member[m]] for m in members]
        total = he.CiphertextSum(self.public_ctx, PARAMS, self.dim + 1)
        for body in bodies:
            total.add(he.unframe_chunks(body, PARAMS, self.dim + 1))
        fields: dict[str, Any] = {
            "federation_id": FID,
            "round": ROUND,
            "attempt": ATTEMPT,
            "contributors": sorted(members),
            "sum_sha256": total.digest(),
            "log_index": len(self.entries),
        }
        fields.update(changes)
        return wire.HeSumOffer(**fields)

    # -- the custodian's side ------------------------------------------------------------

    def log_bytes(self) -> bytes:
        return lines(self.entries)

    def follower(self) -> LogFollower:
        follower = LogFollower(FID, self.aggregator.public_bytes)
        follower.feed(self.log_bytes())
        return follower

    def custody(self) -> Custody:
        return Custody(
            federation_id=FID,
            custodian_id=CUSTODIAN,
            public_key=self.custodian.public_bytes,
            context_sha256=self.context_sha256,
            public_ctx=self.public_ctx,
            secret_ctx=self.secret_ctx,
        )

    def fetch(self) -> Callable[[str], bytes]:
        def fetch(sha256: str) -> bytes:
            try:
                return self.archive[sha256]
            except KeyError:
                raise NotFound(f"no archive object {sha256}") from None

        return fetch

    def expected_sum(self, members: Sequence[str]) -> np.ndarray:
        return np.sum([self.plain[m] for m in members], axis=0).astype("<i8")


@pytest.fixture
def federation(he_keys: tuple[bytes, bytes]) -> Federation:
    secret, public = he_keys
    return Federation(secret, public).setup()
