"""Shared pieces for the coordinator and HTTP API tests.

A federation workspace with enrolled identities, a fake clock, the client side
of a SecAgg+ cohort (real :class:`ClientSession` objects speaking the wire
schemas), the aggregate a round must produce, and a snapshot of everything a
refused request must leave untouched.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.storage.roster_file import ROSTER_FILE
from fedsec.aggregator.workspace import Workspace, init_workspace
from fedsec.config import default_federation_toml, toml_value
from fedsec.crypto.commitment import CommitmentContext, commit
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import QuantSpec, RingVector, dequantize_sum, pack, quantize
from fedsec.crypto.secagg import (
    ClientSession,
    EncryptedShare,
    SecAggParams,
    ShareRelay,
)
from fedsec.crypto.secagg.messages import graph_commitment
from fedsec.modelfile import decode_model
from fedsec.protocol import codec, wire
from fedsec.protocol.roster import sign_roster_entry
from fedsec.task.digest import loaded_task_pin
from fedsec.tasks import get_task
from fedsec.tasks.params import arrays_to_state, flatten_params

FED = "fed1"
TASK = "breast_cancer"
STATE_TABLES = ("rounds", "joins", "messages", "reports", "receipts", "server_state")

# Short deadlines: tests move the fake clock past them instead of waiting.
FAST_ROUND = {
    "open_s": 5.0,
    "advertise_s": 5.0,
    "share_s": 5.0,
    "masked_s": 5.0,
    "unmask_s": 5.0,
}


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def config_text(federation_id: str = FED, **sections: Mapping[str, Any]) -> str:
    """The default federation.toml with ``section={key: value}`` overrides applied."""
    doc = tomllib.loads(default_federation_toml(federation_id, TASK))
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    lines = []
    for name, values in doc.items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {toml_value(v)}" for key, v in values.items())
        lines.append("")
    return "\n".join(lines)


def identity_for(name: str) -> SigningIdentity:
    return SigningIdentity(hashlib.sha256(b"aggregator-test/" + name.encode()).digest())


@dataclass
class Federation:
    ws: Workspace
    identities: dict[str, SigningIdentity]  # every enrolled id, whatever its role

    @property
    def root(self) -> Path:
        return self.ws.root


def make_federation(
    root: Path,
    agents: Iterable[str] = ("a0", "a1", "a2", "a3", "a4"),
    *,
    observers: Iterable[str] = (),
    auditors: Iterable[str] = (),
    custodians: Iterable[str] = (),
    round: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    validation: bool = True,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
) -> Federation:
    """A fresh workspace with the given members enrolled (admin-signed roster entries);
    ``sections`` overrides further sections of federation.toml (``{"alerts": {...}}``)."""
    extra = dict(sections or {})
    text = config_text(
        round={**FAST_ROUND, **(round or {})},
        server=dict(server or {}),
        validation={"enabled": validation, **extra.pop("validation", {})},
        **extra,
    )
    ws = init_workspace(root, FED, TASK, config_text=text)
    admin = ws.admin()
    identities: dict[str, SigningIdentity] = {}
    roles = (
        ("agent", agents),
        ("observer", observers),
        ("auditor", auditors),
        ("custodian", custodians),
    )
    for role, names in roles:
        for name in names:
            identities[name] = identity_for(name)
            ws.roster.add(
                sign_roster_entry(
                    federation_id=FED,
                    agent_id=name,
                    public_key=identities[name].public_bytes,
                    role=role,  # type: ignore[arg-type]
                    admin=admin,
                )
            )
    return Federation(ws, identities)


def graph_nonce_for(member: str, round_: int) -> bytes:
    """The graph nonce a test member commits to when it joins ``round_``: fixed, so the
    test's Cohort can reveal it."""
    return hashlib.sha256(f"graph-nonce/{member}/{round_}".encode()).digest()


def join_request(member: str = "", round_: int = 1, samples: int = 50) -> wire.JoinRequest:
    """A join of ``member`` (its SecAgg+ graph commitment included when named)."""
    task = get_task(TASK)
    commitment = (
        graph_commitment(FED, round_, member, graph_nonce_for(member, round_)).hex()
        if member
        else ""
    )
    return wire.JoinRequest(
        dataset_schema=task.schema.fingerprint(),
        task_version=task.version,
        samples=samples,
        graph_commitment=commitment,
        task_pin=loaded_task_pin(TASK),
    )


def params_from_spec(spec: wire.RoundSpec) -> SecAggParams:
    """The SecAgg+ parameters an agent derives from a signed round spec."""
    return spec.secagg_params()


def fixed_delta(member: str, dim: int) -> np.ndarray:
    """A small deterministic update (norm well under the default clip of 1.0)."""
    digest = hashlib.sha256(b"delta/" + member.encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "big"))
    return rng.normal(scale=0.01, size=dim).astype(np.float32)


WEIGHTS = (1.0, 0.5, 0.75, 0.25, 1.0, 0.6)


def weight_for(member: str) -> float:
    return WEIGHTS[int(hashlib.sha256(member.encode()).digest()[0]) % len(WEIGHTS)]


def quantized_input(member: str, spec: wire.RoundSpec) -> RingVector:
    quant = QuantSpec(spec.quant_bits, spec.clip_norm, spec.ring_bits)
    seed = hashlib.sha256(b"rounding/" + member.encode()).digest()
    return quantize(fixed_delta(member, spec.dim), weight_for(member), quant, seed)


def plain_input(member: str, spec: wire.RoundSpec) -> bytes:
    """A member's packed quantized update for ``secure_sum = "none"``."""
    return pack(quantized_input(member, spec), spec.ring_bits)


def salt_for(member: str) -> bytes:
    """A fixed commitment salt per member, so a retried upload is byte-identical."""
    return hashlib.sha256(b"salt/" + member.encode()).digest()


def commitment_for(member: str, spec: wire.RoundSpec, quantized: RingVector) -> str:
    """Hex H(salt ‖ quantized update) for ``member``'s contribution to ``spec``'s attempt."""
    context = CommitmentContext(
        spec.federation_id, spec.round, spec.attempt, member, spec.ring_bits
    )
    return commit(quantized, salt_for(member), context).hex()


def contribution_statement(
    member: str,
    spec: wire.RoundSpec,
    raw: bytes,
    quantized: RingVector,
    signer: SigningIdentity,
    commitments_sha256: str = "",
) -> wire.ContributionStatement:
    """``member``'s statement binding the uploaded ``raw`` bytes to its commitment (and,
    he, to ``commitments_sha256``, the commitment set's digest), signed by ``signer``
    (the member's own identity unless a test forges one)."""
    return wire.ContributionStatement(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member,
        vector_sha256=hashlib.sha256(raw).hexdigest(),
        commitment=commitment_for(member, spec, quantized),
        commitments_sha256=commitments_sha256,
    ).sign(signer)


Upload = tuple[bytes, str, str]  # (raw vector, commitment hex, signature hex)


def plain_upload(
    member: str,
    spec: wire.RoundSpec,
    identities: Mapping[str, SigningIdentity],
    raw: bytes | None = None,
    *,
    signer: str | None = None,
    commitments_sha256: str = "",
) -> Upload:
    """(raw, commitment, signature) of a plain (``secure_sum = "none"``) input.

    ``raw`` replaces the uploaded bytes (the statement is then signed over them);
    ``signer`` names another member whose key signs the statement;
    ``commitments_sha256``: he, the commitment set's digest the statement binds.
    """
    if raw is None:
        raw = plain_input(member, spec)
    statement = contribution_statement(
        member,
        spec,
        raw,
        quantized_input(member, spec),
        identities[signer or member],
        commitments_sha256,
    )
    return raw, statement.commitment, statement.signature


def he_commit_body(
    member: str, spec: wire.RoundSpec, identity: SigningIdentity, raw: bytes
) -> wire.CommitBody:
    """``member``'s signed commitment (he stage commit) to the ciphertext ``raw``."""
    digest = hashlib.sha256(raw).hexdigest()
    signed = wire.CiphertextCommitment(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member,
        vector_sha256=digest,
    ).sign(identity)
    return wire.CommitBody(digest, signed.signature)


class Cohort:
    """The client side of one SecAgg+ round: real ClientSessions, wire-schema messages.

    Every answer is computed once per member and cached, so the same bytes can be
    handed to several coordinators (an uninterrupted and a restarted one).
    """

    def __init__(self, spec: wire.RoundSpec, identities: Mapping[str, SigningIdentity]) -> None:
        self.spec = spec
        self.identities = dict(identities)
        self.params = params_from_spec(spec)
        roster = {m: identities[m].public_bytes for m in spec.cohort}
        self.sessions = {
            m: ClientSession(
                spec.member_params(m),  # a sharded attempt: the member's group only
                m,
                identities[m],
                roster,
                graph_nonce=graph_nonce_for(m, spec.round) if spec.graph_commitments else b"",
            )
            for m in spec.cohort
        }
        self._advertised: dict[str, wire.AdvertiseKeysBody] = {}
        self._shares: dict[str, wire.ShareKeysBody] = {}
        self._masked: dict[str, bytes] = {}
        self._signed: dict[str, wire.ConsistencyBody] = {}
        self._unmask: dict[str, wire.UnmaskResponseBody] = {}
        self.quantized: dict[str, RingVector] = {}

    def advertise(self, member: str) -> wire.AdvertiseKeysBody:
        if member not in self._advertised:
            self._advertised[member] = codec.advertise_body(self.sessions[member].advertise())
        return self._advertised[member]

    def share_keys(self, member: str, keys: wire.KeyListBody) -> wire.ShareKeysBody:
        if member not in self._shares:
            out = self.sessions[member].share_keys(codec.key_list(keys))
            self._shares[member] = wire.ShareKeysBody(
                shares=[
                    wire.OutgoingShare(recipient=s.recipient, ciphertext=s.ciphertext.hex())
                    for s in out.shares
                ]
            )
        return self._shares[member]

    def receive_shares(self, member: str, relay: wire.ShareRelayBody) -> None:
        self.sessions[member].receive_shares(
            ShareRelay(
                member,
                tuple(relay.participants),
                tuple(
                    EncryptedShare(s.sender, member, bytes.fromhex(s.ciphertext))
                    for s in relay.shares
                ),
            )
        )

    def masked_input(self, member: str) -> bytes:
        if member not in self._masked:
            self.quantized[member] = quantized_input(member, self.spec)
            self._masked[member] = self.sessions[member].masked_input(self.quantized[member]).vector
        return self._masked[member]

    def upload(self, member: str, raw: bytes | None = None, *, signer: str | None = None) -> Upload:
        """(raw, commitment, signature): the masked input with its signed contribution
        statement, as the coordinator's ``masked_input`` takes them.

        The salt is fixed per member and Ed25519 is deterministic, so every call returns
        the same values.  ``raw`` replaces the uploaded bytes (the statement is then
        signed over them); ``signer`` names another member whose key signs it.
        """
        masked = self.masked_input(member)
        if raw is None:
            raw = masked
        statement = contribution_statement(
            member, self.spec, raw, self.quantized[member], self.identities[signer or member]
        )
        return raw, statement.commitment, statement.signature

    def sign(self, member: str, request: wire.UnmaskRequestBody) -> wire.ConsistencyBody:
        """The member's consistency signature on the survivor sets it was told."""
        if member not in self._signed:
            signature = self.sessions[member].sign_survivors(codec.unmask_request(request))
            self._signed[member] = codec.consistency_body(signature)
        return self._signed[member]

    def unmask(self, member: str, proof: wire.ConsistencyProofBody) -> wire.UnmaskResponseBody:
        if member not in self._unmask:
            resp = self.sessions[member].unmask(codec.consistency_proof(proof, member))
            self._unmask[member] = codec.unmask_body(resp)
        return self._unmask[member]


# -- driving a SecAgg+ attempt through a coordinator, stage by stage ------------------------------


def attempt_of(coord: Coordinator) -> tuple[int, int]:
    """(round, attempt) of the attempt in progress."""
    return coord.live.round, coord.live.attempt


def fix_cohort(
    coord: Coordinator, identities: Mapping[str, SigningIdentity], members: Iterable[str]
) -> Cohort:
    """Every one of ``members`` joins the attempt in progress (each join accepted), the
    coordinator's tick fixes the cohort; the members' side of that attempt."""
    r, a = coord.live.round, coord.live.attempt
    for m in members:
        assert coord.join(m, r, a, join_request(m, r)).accepted
    coord.tick()
    assert coord.live.spec is not None
    return Cohort(coord.live.spec, identities)


def advertise_all(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    r, a = attempt_of(coord)
    for m in members:
        coord.advertise(m, r, a, cohort.advertise(m))


def share_all(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    r, a = attempt_of(coord)
    for m in members:
        coord.share_keys(m, r, a, cohort.share_keys(m, coord.key_list(m, r, a)))


def fetch_shares(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    r, a = attempt_of(coord)
    for m in members:
        cohort.receive_shares(m, coord.share_relay(m, r, a))


def mask_all(
    coord: Coordinator, cohort: Cohort, members: tuple[str, ...]
) -> dict[str, wire.Receipt]:
    r, a = attempt_of(coord)
    return {m: coord.masked_input(m, r, a, *cohort.upload(m)) for m in members}


def sign_all(coord: Coordinator, cohort: Cohort, members: Iterable[str] | None = None) -> None:
    """Every survivor (or ``members``) signs the survivor sets, while the attempt is in
    the consistency stage; the stage closes once every survivor signed."""
    if coord.live.stage != "consistency":
        return
    r, a = attempt_of(coord)
    survivors = sorted(coord.live.summing().server.survivors)  # type: ignore[attr-defined]
    for m in survivors if members is None else members:
        coord.consistency(m, r, a, cohort.sign(m, coord.unmask_request(m, r, a)))


def unmask_all(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    r, a = attempt_of(coord)
    sign_all(coord, cohort)
    for m in members:
        coord.unmask(m, r, a, cohort.unmask(m, coord.consistency_proof(m, r, a)))


def privacy_report(member: str, epsilon: float = 1.5, **changes: Any) -> wire.PrivacyReport:
    """An unsigned privacy report of ``member`` for round 1, attempt 0 (``changes``
    override any field)."""
    fields: dict[str, Any] = {
        "federation_id": FED,
        "round": 1,
        "attempt": 0,
        "member": member,
        "dataset_id": f"breast_cancer:iid:0:{member}",
        "epsilon": epsilon,
        "delta": 1e-5,
        "noise_multiplier": 1.0,
        "sample_rate": 0.1,
        "steps": 10,
        "samples": 50,
    }
    fields.update(changes)
    return wire.PrivacyReport(**fields)


def expected_params(
    old: np.ndarray, quantized: Iterable[RingVector], spec: wire.RoundSpec
) -> np.ndarray:
    """FedAvg (server_lr 1) of the exact ring sum of the survivors' quantized inputs."""
    quant = QuantSpec(spec.quant_bits, spec.clip_norm, spec.ring_bits)
    vectors = list(quantized)
    total = np.zeros(spec.dim + 1, dtype=np.uint64)
    for q in vectors:
        total += q.astype(np.uint64)
    ring = (total & np.uint64(quant.ring_mask)).astype(quant.dtype)
    weighted, weights = dequantize_sum(ring, len(vectors), quant)
    mean = (weighted / weights).astype(np.float32)
    return (old + np.float32(1.0) * mean).astype(np.float32)


def float_mean(members: Iterable[str], dim: int) -> np.ndarray:
    """Σ w·Δ / Σ w from the unquantized updates (to check within quantization error)."""
    ms = list(members)
    num = sum(weight_for(m) * fixed_delta(m, dim).astype(np.float64) for m in ms)
    return np.asarray(num / sum(weight_for(m) for m in ms))


def model_params(ws: Workspace, version: int) -> np.ndarray:
    model = get_task(TASK).build_model(seed=0)
    arrays_to_state(model, decode_model(ws.models.read(version), max_bytes=1 << 30))
    return flatten_params(model)


def table_rows(ws: Workspace, table: str) -> list[tuple[Any, ...]]:
    """Every committed row of a state table, read through a separate connection."""
    assert table in STATE_TABLES
    con = sqlite3.connect(f"file:{ws.state.path}?mode=ro", uri=True)
    try:
        return con.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()
    finally:
        con.close()


def log_entries(ws: Workspace, start: int = 0) -> list[dict[str, Any]]:
    """The committed transparency-log entries from index ``start`` on, decoded.

    Read through a separate connection; deliberately not part of :func:`snapshot`,
    since a refused contribution is itself logged.
    """
    con = sqlite3.connect(f"file:{ws.state.path}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT line FROM log WHERE idx >= ? ORDER BY idx", (start,))
        return [json.loads(bytes(line)) for (line,) in rows.fetchall()]
    finally:
        con.close()


@dataclass
class Snapshot:
    tables: dict[str, list[tuple[Any, ...]]]
    live: tuple[Any, ...]
    session: tuple[Any, ...] | None
    plain: tuple[Any, ...] | None
    token: int
    roster: bytes
    models: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def snapshot(ws: Workspace, coord: Coordinator) -> Snapshot:
    """Everything a refused request must leave as it was."""
    live = coord.live
    session = None
    if live.session is not None:
        s = live.session
        session = (
            s.stage,
            tuple(sorted(s.advertised)),
            s.live,
            s.shared,
            s.participants,
            tuple(s.contributed),
            s.survivors,
            s.answered,
        )
    plain = None
    if live.plain_members is not None:
        plain = (tuple(live.plain_members), live.plain_weight, live.plain_sum.tobytes())  # type: ignore[union-attr]
    return Snapshot(
        tables={t: table_rows(ws, t) for t in STATE_TABLES},
        live=(live.round, live.attempt, live.stage, live.stage_started_at, live.spec),
        session=session,
        plain=plain,
        token=coord.token,
        roster=(ws.root / ROSTER_FILE).read_bytes(),
        models=ws.models.versions_on_disk(),
    )
