"""The body of every kind of transparency-log entry: one struct per kind, one registry.

docs/audit-log.md §3 specifies each body for third-party verifiers; this module is the
one place the code defines them.  The aggregator builds these structs and appends
them, ``fedsec audit verify``, ``report`` and the auditor's tools decode bodies back
into them.  A body is encoded as the JSON object of its fields (:func:`encode_body`),
which the log line embeds in canonical form (:mod:`fedsec.protocol.log`); an optional
field is omitted when absent (``omit_defaults``), exactly as the aggregator always
wrote it, so the bytes of every line stay as they were.

Decoding (:func:`decode_body`) is strict: an unknown or missing field, a value of the
wrong type, or an optional field spelled out at its default is refused, so a body
altered outside the schema is caught even before its chain and head are checked.

Four kinds carry a signed object defined with the message it is: ``roster``
(:class:`~fedsec.protocol.roster.RosterEntry`), ``round_spec``
(:class:`~fedsec.protocol.wire.RoundSpec`) and ``privacy_report``
(:class:`~fedsec.protocol.wire.PrivacyReport`) are registered as they are, as is
``data_summary`` (:class:`~fedsec.protocol.wire.DataSummary`);
``model_version`` is :class:`ModelVersionEntry`, the fields of a signed model manifest
(``fedsec.modelfile.ModelManifest``, which this layer may not import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias, cast

import msgspec

from fedsec.errors import IntegrityError
from fedsec.protocol.roster import RosterEntry
from fedsec.protocol.stages import Stage
from fedsec.protocol.wire import (
    DataSummary,
    DecryptionStatement,
    HeContextStatement,
    PrivacyReport,
    Probability,
    QuarantineOrder,
    RoundSpec,
    non_finite,
)


class _Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A log entry body: refuses unknown fields on decoding, keyword-only to build."""


class GenesisEntry(_Body, frozen=True):
    """Index 0: who the federation is and how it is configured."""

    federation_id: str
    aggregator_public_key: str  # hex Ed25519: heads, specs, manifests, receipts
    admin_public_key: str  # hex Ed25519: roster entries
    task: str
    task_version: str
    schema_fingerprint: str
    server: dict[str, Any]  # the configuration's server section
    round: dict[str, Any]  # the configuration's round section


class RoundOpenEntry(_Body, frozen=True):
    """An attempt opened for joining."""

    round: int
    attempt: int


class AcceptedEntry(_Body, frozen=True, omit_defaults=True):
    """A protocol message accepted (and archived before this entry was written)."""

    round: int
    attempt: int
    stage: Stage
    member: str
    sha256: str  # of the message bytes: the archive object's name
    bytes: int
    # masked_input only: the member's signed contribution statement (docs §4)
    commitment: str | None = None
    signature: str | None = None


class RefusedEntry(_Body, frozen=True, omit_defaults=True):
    """A masked input refused; an aggregate entry (``suppressed`` set) stands for
    refusals counted rather than logged one by one, described by the latest of them."""

    round: int
    attempt: int
    stage: Stage
    member: str
    sha256: str  # of the refused bytes
    code: str  # the error code the member was answered with
    detail: str
    suppressed: int | None = None  # aggregate entries: how many refusals this stands for
    codes: dict[str, int] | None = None  # aggregate entries: code -> how many of those


class GroupSumEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One shard group's part of a sharded attempt's sum: its members (as the signed spec's
    group lists them), whose masked inputs its ring sum holds, and that ring sum's SHA-256
    (``fedsec audit verify`` unmasks each group again and compares)."""

    members: list[str]
    survivors: list[str]
    sum_sha256: str


class AggregateEntry(_Body, frozen=True, omit_defaults=True):
    """A round attempt closed: what was summed, from whom, applied to what.  Distributed
    DP adds the realised noise multiplier of the sum (z·√(survivors/min_survivors)·Δ₂/γC:
    never below the spec's z) and the coordinates at the ring's edge (likely wraps), which
    a compressed round with fewer codec headroom bits counts too."""

    round: int
    attempt: int
    survivors: list[str]
    dropped: list[str]
    sum_sha256: str
    weight_sum: float
    parent_version: int
    optimizer: str
    server_lr: float
    noise_multiplier: float = 0.0
    edge_count: int = 0
    # [round] shards > 1: each group's membership and ring-sum hash, in the spec's order
    groups: list[GroupSumEntry] = msgspec.field(default_factory=list)


class ModelVersionEntry(_Body, frozen=True):
    """A signed model manifest, field for field (``fedsec.modelfile.ModelManifest``)."""

    federation_id: str
    version: int
    parent: int | None
    round: int | None
    sha256: str
    created: float
    metrics: dict[str, float]
    kind: Literal["initial", "aggregate", "rollback", "sealed"]
    note: str
    signature: str


class RoundAbortedEntry(_Body, frozen=True):
    """Too few members, or recovery impossible: a new attempt follows."""

    round: int
    attempt: int
    detail: str


class RollbackEntry(_Body, frozen=True):
    """Follows a rollback model version: which version carries whose weights."""

    version: int
    weights_of: int | None
    note: str


class AlertEntry(_Body, frozen=True, omit_defaults=True):
    """An operator-visible warning; ``kind`` is one of the aggregator's alert kinds
    (absent in entries written before alerts had kinds)."""

    detail: str
    time: float
    kind: str = ""


class ArchivePrunedEntry(_Body, frozen=True):
    """Archive objects of rounds past retention, deleted after this entry is committed.

    ``before_round``: every round below it is pruned; ``rounds``: those this entry
    newly prunes, sorted; ``objects``: the sha256 names it deletes, sorted, no repeats;
    ``retention_rounds``: the setting that chose them.  The retention rules are
    :mod:`fedsec.archive`'s.
    """

    retention_rounds: int
    before_round: int
    rounds: list[int]
    objects: list[str]


class ChallengeEntry(_Body, frozen=True):
    """An auditor's challenge of one member's contribution, drawn from a head's beacon."""

    round: int
    attempt: int
    member: str
    auditor: str
    beacon_index: int
    beacon: str  # sha256 hex of the head line at beacon_index
    rate: Probability


class RevealEntry(_Body, frozen=True):
    """A member's sealed answer to a challenge, relayed (and archived)."""

    round: int
    attempt: int
    member: str
    auditor: str
    sha256: str  # of the sealed ciphertext: the archive object's name
    bytes: int


class QuarantineEntry(_Body, frozen=True, omit_defaults=True):
    """A member suspended from future cohorts after the control-sample audit failed its
    contribution to ``round``.attempt (the first failed round).  ``issuer``: ``admin`` or
    the auditor; ``order``: the issuer's signed order as received (absent when the
    aggregator quarantined on an auditor's failed verdict by itself,
    ``audit.quarantine_on_failure``).  ``rollback_to``: the last model version before
    that round, offered to the operator."""

    member: str
    round: int
    attempt: int
    issuer: str
    failed: list[str]
    reason: str
    rollback_to: int
    order: QuarantineOrder | None = None


class HeadEntry(_Body, frozen=True):
    """The aggregator's signature over the chain up to the entry before this one."""

    federation_id: str
    signed_index: int
    signed_hash: str
    signature: str  # hex Ed25519, domain log-head


LogBody: TypeAlias = (
    GenesisEntry
    | RosterEntry
    | RoundOpenEntry
    | RoundSpec
    | AcceptedEntry
    | RefusedEntry
    | PrivacyReport
    | AggregateEntry
    | ModelVersionEntry
    | RoundAbortedEntry
    | RollbackEntry
    | AlertEntry
    | ArchivePrunedEntry
    | ChallengeEntry
    | RevealEntry
    | HeContextStatement
    | DecryptionStatement
    | DataSummary
    | QuarantineEntry
    | HeadEntry
)

#: Every entry kind and the struct of its body: the one definition of the kinds.
ENTRY_TYPES: Final[Mapping[str, type[msgspec.Struct]]] = {
    "genesis": GenesisEntry,
    "roster": RosterEntry,
    "round_open": RoundOpenEntry,
    "round_spec": RoundSpec,
    "accepted": AcceptedEntry,
    "refused": RefusedEntry,
    "privacy_report": PrivacyReport,
    "aggregate": AggregateEntry,
    "model_version": ModelVersionEntry,
    "round_aborted": RoundAbortedEntry,
    "rollback": RollbackEntry,
    "alert": AlertEntry,
    "archive_pruned": ArchivePrunedEntry,
    "challenge": ChallengeEntry,
    "reveal": RevealEntry,
    "he_context": HeContextStatement,
    "he_decryption": DecryptionStatement,
    "data_summary": DataSummary,
    "quarantine": QuarantineEntry,
    "head": HeadEntry,
}
_KIND_OF: Final[Mapping[type[msgspec.Struct], str]] = {t: k for k, t in ENTRY_TYPES.items()}


def kind_of(body: LogBody | type[LogBody]) -> str:
    """The entry kind of a body (or of a body struct).

    Raises:
        TypeError: not a log entry body.
    """
    cls = body if isinstance(body, type) else type(body)
    try:
        return _KIND_OF[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not a log entry body") from None


def encode_body(body: LogBody) -> dict[str, Any]:
    """The JSON-ready object a log line carries as ``body``."""
    encoded: dict[str, Any] = msgspec.to_builtins(body)
    return encoded


def check_finite_body(kind: str, body: Mapping[str, Any]) -> None:
    """Refuse a body holding NaN or an infinity, which standard JSON, and so the log, has
    no place for (docs/audit-log.md): the aggregator refuses them on arrival, so one in
    the log was written by hand or by an aggregator without that check.

    Raises:
        IntegrityError: naming the kind, the member the body is about (if it names
            one) and the field.
    """
    found = non_finite(dict(body))
    if found is not None:
        path, number = found
        member = body.get("member")
        whose = f" of {str(member)[:64]}" if isinstance(member, str) else ""
        raise IntegrityError(
            f"{kind} body{whose} holds {number} at `{path}`, not a finite number (a log "
            "line is standard JSON, which has no NaN or Infinity)"
        )


def decode_body(kind: str, body: Mapping[str, Any]) -> LogBody:
    """The struct of a logged ``body`` of ``kind``.

    Raises:
        IntegrityError: an unknown kind, a number that is not finite
            (:func:`check_finite_body`), or a body that is not exactly what the
            aggregator writes for it (unknown, missing or mistyped fields, a value out
            of its field's range, an optional field given at its default).
    """
    cls = ENTRY_TYPES.get(kind)
    if cls is None:
        raise IntegrityError(f"unknown entry kind {kind!r}")
    check_finite_body(kind, body)
    try:
        decoded = cast(LogBody, msgspec.convert(body, cls))
    except msgspec.ValidationError as exc:
        raise IntegrityError(f"{kind} body does not match its schema: {exc}") from None
    if encode_body(decoded) != body:
        raise IntegrityError(
            f"{kind} body is not in the form the aggregator writes (an optional field is "
            "given at its default)"
        )
    return decoded
