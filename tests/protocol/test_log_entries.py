"""The log entry bodies (fedsec.protocol.log_entries): one struct per kind, byte-identical lines.

Each sample pairs a struct with the dict the aggregator wrote for that kind before the
bodies were typed (the literal its writer built), so a log written now is byte for
byte what the older code wrote; the v1 fixture, written by older code still, decodes
and re-encodes to its own lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fedsec.crypto.identity import SigningIdentity, canonical_json
from fedsec.errors import IntegrityError
from fedsec.protocol import wire
from fedsec.protocol.data_schema import ObservedColumn, ObservedSchema
from fedsec.protocol.log import KINDS, make_entry, parse_line
from fedsec.protocol.log_entries import (
    ENTRY_TYPES,
    AcceptedEntry,
    AggregateEntry,
    AlertEntry,
    ArchivePrunedEntry,
    ChallengeEntry,
    GenesisEntry,
    HeadEntry,
    LogBody,
    ModelVersionEntry,
    QuarantineEntry,
    RefusedEntry,
    RevealEntry,
    RollbackEntry,
    RoundAbortedEntry,
    RoundOpenEntry,
    decode_body,
    encode_body,
    kind_of,
)
from fedsec.protocol.roster import RosterEntry

FIXTURE_LOG = Path(__file__).resolve().parents[1] / "fixtures/compat-v1/aggregator/audit/log.jsonl"
H = "ab" * 32  # a sha256 hex
SIG = "cd" * 64  # an Ed25519 signature hex
KEY = "ef" * 32  # an Ed25519 public key hex


def _spec() -> wire.RoundSpec:
    return wire.RoundSpec(
        federation_id="fed-ü",
        round=2,
        attempt=1,
        secure_sum="secagg",
        model_version=1,
        model_sha256=H,
        task="breast_cancer",
        task_version="1",
        schema_fingerprint=H,
        cohort=["agent-1", "agent-2"],
        neighbors=1,
        threshold=2,
        quant_bits=16,
        ring_bits=32,
        clip_norm=1.0,
        dim=31,
        seed=H,
        max_weight_samples=100,
        weight_caps={"agent-1": 1.0, "agent-2": 0.5},
        training=wire.TrainingSpec(local_epochs=1, batch_size=32, lr=0.1, optimizer="sgd"),
        dp=wire.DPSpec(enabled=True, noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-05),
        deadlines={"advertise": 4.0, "unmask": 8.5},
        signature=SIG,
    )


def _report(**extra: Any) -> wire.PrivacyReport:
    return wire.PrivacyReport(
        federation_id="fed",
        round=2,
        attempt=0,
        member="agent-1",
        dataset_id="clinic",
        epsilon=1.25,
        delta=1e-05,
        noise_multiplier=1.1,
        sample_rate=0.01,
        steps=40,
        samples=400,
        signature=SIG,
        **extra,
    )


_ROSTER = RosterEntry(
    agent_id="agent-1",
    public_key=KEY,
    role="agent",
    max_weight=None,
    status="active",
    added_at=1796168226.8673782,
    admin_signature=SIG,
)
_ACCEPTED: dict[str, Any] = {
    "round": 2,
    "attempt": 0,
    "stage": "advertise",
    "member": "agent-1",
    "sha256": H,
    "bytes": 214,
}
_REFUSED: dict[str, Any] = {
    "round": 2,
    "attempt": 0,
    "stage": "masked_input",
    "member": "agent-1",
    "sha256": H,
    "code": "wrong_stage",
    "detail": "round 2 is in stage unmask, not masked_input",
}

#: (id, the struct the writer passes now, the dict the writer built before the structs)
SAMPLES: list[tuple[str, LogBody, dict[str, Any]]] = [
    (
        "genesis",
        GenesisEntry(
            federation_id="fed",
            aggregator_public_key=KEY,
            admin_public_key=KEY,
            task="breast_cancer",
            task_version="1",
            schema_fingerprint=H,
            server={"optimizer": "fedadam", "server_lr": 1.0, "adam_tau": 0.001},
            round={"min_agents": 2, "rounds": 3, "secure_sum": "secagg", "advertise_s": 4.0},
        ),
        {
            "federation_id": "fed",
            "aggregator_public_key": KEY,
            "admin_public_key": KEY,
            "task": "breast_cancer",
            "task_version": "1",
            "schema_fingerprint": H,
            "server": {"optimizer": "fedadam", "server_lr": 1.0, "adam_tau": 0.001},
            "round": {"min_agents": 2, "rounds": 3, "secure_sum": "secagg", "advertise_s": 4.0},
        },
    ),
    ("roster", _ROSTER, _ROSTER.to_dict()),
    (
        "roster revoked",
        msgspec.structs.replace(_ROSTER, status="revoked", revoked_at=1796168300.5),
        {**_ROSTER.to_dict(), "status": "revoked", "revoked_at": 1796168300.5},
    ),
    ("round_open", RoundOpenEntry(round=2, attempt=0), {"round": 2, "attempt": 0}),
    ("round_spec", _spec(), msgspec.to_builtins(_spec())),
    ("accepted", AcceptedEntry(**_ACCEPTED), _ACCEPTED),
    (
        "accepted masked_input",
        AcceptedEntry(**{**_ACCEPTED, "stage": "masked_input"}, commitment=H, signature=SIG),
        {**_ACCEPTED, "stage": "masked_input", "commitment": H, "signature": SIG},
    ),
    ("refused", RefusedEntry(**_REFUSED), _REFUSED),
    (
        "refused aggregate",
        RefusedEntry(**_REFUSED, suppressed=7, codes={"payload_invalid": 2, "wrong_stage": 5}),
        {**_REFUSED, "suppressed": 7, "codes": {"payload_invalid": 2, "wrong_stage": 5}},
    ),
    ("privacy_report", _report(), msgspec.to_builtins(_report())),
    (
        "privacy_report_declaring_charges",
        _report(charge=3, unreported=[wire.ChargeRecord(1, 1, 1.1, 0.01, 40)]),
        {
            **msgspec.to_builtins(_report()),
            "charge": 3,
            "unreported": [
                {"index": 1, "round": 1, "noise_multiplier": 1.1, "sample_rate": 0.01, "steps": 40}
            ],
        },
    ),
    (
        "data_summary",
        wire.DataSummary(
            federation_id="fed",
            member="agent-1",
            records=120,
            label_counts={"cold": 70, "flu": 50},
            missing_rate={"bmi": 0.25},
            schema_fingerprint=H,
            observed=ObservedSchema(
                label="dx",
                classes=["cold", "flu"],
                columns=[ObservedColumn(name="bmi", kind="numeric")],
            ),
            label_coverage=1.0,
            quality_score=0.75,
            signature=SIG,
        ),
        {
            "federation_id": "fed",
            "member": "agent-1",
            "records": 120,
            "label_counts": {"cold": 70, "flu": 50},
            "missing_rate": {"bmi": 0.25},
            "schema_fingerprint": H,
            "observed": {
                "label": "dx",
                "classes": ["cold", "flu"],
                "columns": [{"name": "bmi", "kind": "numeric", "unit": "", "categories": []}],
            },
            "label_coverage": 1.0,
            "quality_score": 0.75,
            "signature": SIG,
        },
    ),
    (
        "privacy_report trained_round",
        _report(trained_round=1),
        {**msgspec.to_builtins(_report()), "trained_round": 1},
    ),
    (
        "aggregate",
        AggregateEntry(
            round=2,
            attempt=0,
            survivors=["agent-1", "agent-2"],
            dropped=[],
            sum_sha256=H,
            weight_sum=1.9999999,
            parent_version=1,
            optimizer="fedavg",
            server_lr=1.0,
        ),
        {
            "round": 2,
            "attempt": 0,
            "survivors": ["agent-1", "agent-2"],
            "dropped": [],
            "sum_sha256": H,
            "weight_sum": 1.9999999,
            "parent_version": 1,
            "optimizer": "fedavg",
            "server_lr": 1.0,
        },
    ),
    (
        "model_version",
        ModelVersionEntry(
            federation_id="fed",
            version=2,
            parent=1,
            round=2,
            sha256=H,
            created=1796168240.25,
            metrics={"accuracy": 0.93, "loss": 0.2},
            kind="aggregate",
            note="",
            signature=SIG,
        ),
        {
            "federation_id": "fed",
            "version": 2,
            "parent": 1,
            "round": 2,
            "sha256": H,
            "created": 1796168240.25,
            "metrics": {"accuracy": 0.93, "loss": 0.2},
            "kind": "aggregate",
            "note": "",
            "signature": SIG,
        },
    ),
    (
        "model_version initial",
        ModelVersionEntry(
            federation_id="fed",
            version=0,
            parent=None,
            round=None,
            sha256=H,
            created=1796168220.0,
            metrics={},
            kind="initial",
            note="initial model",
            signature=SIG,
        ),
        {
            "federation_id": "fed",
            "version": 0,
            "parent": None,
            "round": None,
            "sha256": H,
            "created": 1796168220.0,
            "metrics": {},
            "kind": "initial",
            "note": "initial model",
            "signature": SIG,
        },
    ),
    (
        "round_aborted",
        RoundAbortedEntry(round=3, attempt=0, detail="only 1 of 2 members"),
        {"round": 3, "attempt": 0, "detail": "only 1 of 2 members"},
    ),
    (
        "rollback",
        RollbackEntry(version=5, weights_of=3, note="bad accuracy"),
        {"version": 5, "weights_of": 3, "note": "bad accuracy"},
    ),
    (
        "alert",
        AlertEntry(detail="round 3 attempt 0 aborted: «x»", time=1796168250.125),
        {"detail": "round 3 attempt 0 aborted: «x»", "time": 1796168250.125},
    ),
    (
        "archive_pruned",
        ArchivePrunedEntry(retention_rounds=2, before_round=7, rounds=[6], objects=[H]),
        {"retention_rounds": 2, "before_round": 7, "rounds": [6], "objects": [H]},
    ),
    (
        "challenge",
        ChallengeEntry(
            round=2,
            attempt=0,
            member="agent-1",
            auditor="auditor-1",
            beacon_index=40,
            beacon=H,
            rate=0.5,
        ),
        {
            "round": 2,
            "attempt": 0,
            "member": "agent-1",
            "auditor": "auditor-1",
            "beacon_index": 40,
            "beacon": H,
            "rate": 0.5,
        },
    ),
    (
        "reveal",
        RevealEntry(
            round=2, attempt=0, member="agent-1", auditor="auditor-1", sha256=H, bytes=1024
        ),
        {
            "round": 2,
            "attempt": 0,
            "member": "agent-1",
            "auditor": "auditor-1",
            "sha256": H,
            "bytes": 1024,
        },
    ),
    (
        "he_context",
        wire.HeContextStatement(
            federation_id="fed",
            custodian="kh",
            poly_modulus_degree=8192,
            coeff_mod_bit_sizes=[60, 60],
            scale_bits=40,
            context_sha256=H,
            signature=SIG,
        ),
        {
            "federation_id": "fed",
            "custodian": "kh",
            "poly_modulus_degree": 8192,
            "coeff_mod_bit_sizes": [60, 60],
            "scale_bits": 40,
            "context_sha256": H,
            "signature": SIG,
        },
    ),
    (
        "he_decryption",
        wire.DecryptionStatement(
            federation_id="fed",
            round=3,
            attempt=0,
            custodian="kh",
            contributors=["a0", "a1", "a2"],
            sum_sha256=H,
            plaintext_sha256=H,
            signature=SIG,
        ),
        {
            "federation_id": "fed",
            "round": 3,
            "attempt": 0,
            "custodian": "kh",
            "contributors": ["a0", "a1", "a2"],
            "sum_sha256": H,
            "plaintext_sha256": H,
            "signature": SIG,
        },
    ),
    (
        "quarantine",
        QuarantineEntry(
            member="m1",
            round=3,
            attempt=0,
            issuer="aud",
            failed=["direction"],
            reason="failed verdict",
            rollback_to=3,
        ),
        {
            "member": "m1",
            "round": 3,
            "attempt": 0,
            "issuer": "aud",
            "failed": ["direction"],
            "reason": "failed verdict",
            "rollback_to": 3,
        },
    ),
    (
        "head",
        HeadEntry(federation_id="fed", signed_index=41, signed_hash=H, signature=SIG),
        {"federation_id": "fed", "signed_index": 41, "signed_hash": H, "signature": SIG},
    ),
]


def test_the_kinds_are_the_registry_and_every_kind_has_a_sample() -> None:
    assert frozenset(ENTRY_TYPES) == KINDS
    assert {kind_of(body) for _, body, _ in SAMPLES} == KINDS
    assert len(set(ENTRY_TYPES.values())) == len(ENTRY_TYPES)  # one struct per kind


@pytest.mark.parametrize(("name", "body", "written"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_every_kind_writes_the_line_the_older_code_wrote_and_round_trips(
    name: str, body: LogBody, written: dict[str, Any]
) -> None:
    kind = kind_of(body)
    entry = make_entry(7, H, 1796168255.03, body)
    old_line = canonical_json(
        {"index": 7, "prev": H, "time": 1796168255.03, "kind": kind, "body": written}
    )
    assert entry.line == old_line
    parsed = parse_line(entry.line, 8, "log")
    decoded = parsed.decode()
    assert decoded == body and type(decoded) is type(body)
    assert make_entry(7, H, 1796168255.03, decoded).line == entry.line


def test_the_v1_fixture_decodes_entry_by_entry_and_re_encodes_to_its_own_lines() -> None:
    lines = FIXTURE_LOG.read_bytes().splitlines()
    seen = set()
    for lineno, line in enumerate(lines, start=1):
        entry = parse_line(line, lineno, "log.jsonl")
        body = entry.decode()
        assert type(body) is ENTRY_TYPES[entry.kind]
        again = make_entry(entry.index, entry.prev, entry.time, body)
        assert again.line == line, f"line {lineno} ({entry.kind})"
        seen.add(entry.kind)
    assert len(lines) == 144
    assert seen >= {"genesis", "roster", "round_spec", "accepted", "aggregate", "head"}


@pytest.mark.parametrize(("name", "body", "written"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_a_body_with_an_extra_or_a_missing_field_is_refused(
    name: str, body: LogBody, written: dict[str, Any]
) -> None:
    kind = kind_of(body)
    with pytest.raises(IntegrityError, match="unknown field `smuggled`"):
        decode_body(kind, {**written, "smuggled": 1})
    required = next(
        f for f in msgspec.structs.fields(type(body)) if f.required and f.name in written
    )
    missing = {k: v for k, v in written.items() if k != required.name}
    with pytest.raises(IntegrityError, match=f"missing required field `{required.name}`"):
        decode_body(kind, missing)


def test_an_optional_field_spelled_out_at_its_default_is_refused() -> None:
    with pytest.raises(IntegrityError, match="not in the form the aggregator writes"):
        decode_body("accepted", {**_ACCEPTED, "commitment": None, "signature": None})
    with pytest.raises(IntegrityError, match="not in the form the aggregator writes"):
        decode_body("refused", {**_REFUSED, "suppressed": None})


def test_wrong_types_and_unknown_kinds_are_refused() -> None:
    with pytest.raises(IntegrityError, match="Expected `int`, got `str`"):
        decode_body("round_open", {"round": "2", "attempt": 0})
    with pytest.raises(IntegrityError, match="Expected `int`, got `bool`"):
        decode_body("round_open", {"round": True, "attempt": 0})
    with pytest.raises(IntegrityError, match="unknown entry kind 'bonus_payment'"):
        decode_body("bonus_payment", {})
    receipt: Any = wire.Receipt(
        federation_id="f",
        round=1,
        attempt=0,
        member="m",
        contribution_sha256=H,
        log_index=1,
        issued_at=1.0,
    )
    with pytest.raises(TypeError, match="Receipt is not a log entry body"):
        kind_of(receipt)


def test_a_head_body_from_the_signer_is_a_head_entry() -> None:
    from fedsec.protocol.log import verify_head
    from fedsec.protocol.log_builder import LogBuilder

    signer = SigningIdentity.generate()
    log = LogBuilder("fed", signer)
    last = log.append(RoundOpenEntry(round=1, attempt=0))
    logged = log.head()
    head = logged.decode()
    assert isinstance(head, HeadEntry) and head.signed_index == 0
    verify_head(head, signer.public_bytes, last)
    assert logged.prev == last.hash and json.loads(logged.line)["body"] == encode_body(head)
