"""What the audit report shows, gathered from the log's entries and a verdicts file.

The log is read leniently for display (a malformed line is counted, not fatal, and an
entry with unexpected fields is listed as not understood), because a tampered log
must still produce a report that says FAILED; only what
:func:`fedsec.audit.verify.verify_log` accepted is vouched for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from fedsec.errors import ConfigError, FedsecError
from fedsec.protocol import wire
from fedsec.protocol.log import MAX_LINE_BYTES
from fedsec.protocol.log_entries import (
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
    decode_body,
    encode_body,
)
from fedsec.protocol.roster import RosterEntry

# A verdicts file lists one verdict per challenged (member, round); 64 MiB is far more
# than any real audit produces and bounds what a wrong file can cost to parse.
MAX_VERDICTS_BYTES = 64 << 20


#: The entries that belong to one round attempt (``round``, ``attempt``).
RoundKeyed = (
    wire.RoundSpec
    | AcceptedEntry
    | RefusedEntry
    | wire.PrivacyReport
    | AggregateEntry
    | RoundAbortedEntry
)


@dataclass
class RoundRow:
    """One round attempt as the log records it."""

    round: int
    attempt: int
    status: str = "open"  # open | closed | aborted
    cohort: int = 0
    survivors: int | None = None
    dropped: list[str] = field(default_factory=list)
    accepted: int = 0  # contributions (masked inputs) accepted
    refused: int = 0  # contributions refused
    model_version: int | None = None
    accuracy: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # its model's manifest's
    epsilon_max: float | None = None
    spec_time: float | None = None
    last_message_time: float | None = None
    close_time: float | None = None
    detail: str = ""

    @property
    def duration_s(self) -> float | None:
        """Cohort fixed (signed spec) to round closed or aborted."""
        if self.spec_time is None or self.close_time is None:
            return None
        return self.close_time - self.spec_time

    @property
    def aggregation_s(self) -> float | None:
        """Last accepted message to the aggregate entry: unmasking, model update, validation."""
        if self.status != "closed" or self.last_message_time is None or self.close_time is None:
            return None
        return self.close_time - self.last_message_time


@dataclass
class LogSummary:
    """What the report shows, gathered from the log entries."""

    entries: int = 0
    unreadable: int = 0  # lines that are not a JSON log entry
    first_time: float | None = None
    last_time: float | None = None
    genesis: GenesisEntry | None = None
    roster: dict[str, RosterEntry] = field(default_factory=dict)
    rounds: dict[tuple[int, int], RoundRow] = field(default_factory=dict)
    # member -> round -> (epsilon, dataset, delta), the last report of each round
    epsilon: dict[str, dict[int, tuple[float, str, float]]] = field(default_factory=dict)
    dp: dict[str, Any] = field(default_factory=dict)  # from the latest round spec
    data_summaries: dict[str, wire.DataSummary] = field(default_factory=dict)  # latest each
    challenges: list[ChallengeEntry] = field(default_factory=list)
    quarantines: list[QuarantineEntry] = field(default_factory=list)
    reveals: set[tuple[int, int, str, str]] = field(default_factory=set)
    events: list[tuple[int, str, str]] = field(default_factory=list)  # (index, kind, text)
    last_head: tuple[int, str] | None = None  # (index, signed hash)
    latest_version: int | None = None
    task: str = ""  # the task the round specs name

    def primary_metric(self) -> tuple[str, bool]:
        """The task's primary metric and whether higher is better, from the task
        installed here; accuracy where it is not (or needs options to load)."""
        from fedsec.task import load_task

        try:
            task = load_task(self.task)
        except FedsecError:
            return "accuracy", True
        return task.primary_metric, task.higher_is_better


def num(value: Any) -> float | None:
    """A finite number as the log gives it, or None (booleans and strings included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def read_entries(log_path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every line of the log that parses as an entry, and how many did not."""
    docs: list[dict[str, Any]] = []
    unreadable = 0
    with Path(log_path).open("rb") as fh:
        for raw in fh:
            if len(raw) > MAX_LINE_BYTES:
                unreadable += 1
                continue
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                unreadable += 1
                continue
            if isinstance(doc, dict) and isinstance(doc.get("body"), dict) and "kind" in doc:
                docs.append(doc)
            else:
                unreadable += 1
    return docs, unreadable


def summarize(docs: Iterable[dict[str, Any]]) -> LogSummary:
    """Gather the report's figures; an entry with unexpected fields is skipped."""
    s = LogSummary()
    for doc in docs:
        s.entries += 1
        t = num(doc.get("time"))
        if t is not None:
            s.first_time = t if s.first_time is None else min(s.first_time, t)
            s.last_time = t if s.last_time is None else max(s.last_time, t)
        try:
            _add(s, doc, t)
        except (FedsecError, KeyError, TypeError, ValueError, AttributeError):
            s.events.append((_index(doc), "unreadable", f"{doc.get('kind')} entry not understood"))
    return s


def _index(doc: dict[str, Any]) -> int:
    value = doc.get("index")
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _row(s: LogSummary, body: RoundKeyed) -> RoundRow:
    key = (body.round, body.attempt)
    if key not in s.rounds:
        s.rounds[key] = RoundRow(*key)
    return s.rounds[key]


def _add(s: LogSummary, doc: dict[str, Any], t: float | None) -> None:
    """Take one entry into the summary.

    Raises:
        IntegrityError: its body does not match its kind (or the kind is unknown).
    """
    kind = str(doc["kind"])
    body = decode_body(kind, doc["body"])
    if not _add_round_entry(s, body, t):
        _add_record(s, body, _index(doc))
    text = _event_text(body)
    if text is not None:
        s.events.append((_index(doc), kind, text))


def _add_round_entry(s: LogSummary, body: LogBody, t: float | None) -> bool:
    """Take an entry of a round attempt into its row; False for any other entry."""
    match body:
        case wire.RoundSpec() as spec:
            s.task = spec.task
            row = _row(s, spec)
            row.cohort = len(spec.cohort)
            row.spec_time = t
            s.dp = {
                **msgspec.to_builtins(spec.dp),
                "training": msgspec.to_builtins(spec.training),
                "secure_sum": spec.secure_sum,
                "quant_bits": spec.quant_bits,
                "clip_norm": spec.clip_norm,
            }
        case AcceptedEntry() as accepted:
            row = _row(s, accepted)
            row.last_message_time = t
            if accepted.stage == "masked_input":
                row.accepted += 1
        case RefusedEntry() as refused:
            # an aggregate entry stands for the `suppressed` refusals not logged one by one
            _row(s, refused).refused += 1 if refused.suppressed is None else refused.suppressed
        case wire.PrivacyReport() as report:
            _add_privacy_report(s, report)
        case AggregateEntry() as aggregate:
            row = _row(s, aggregate)
            row.status, row.close_time = "closed", t
            row.survivors = len(aggregate.survivors)
            row.dropped = list(aggregate.dropped)
        case RoundAbortedEntry() as aborted:
            row = _row(s, aborted)
            row.status, row.close_time, row.detail = "aborted", t, aborted.detail
        case _:
            return False
    return True


def _add_record(s: LogSummary, body: LogBody, index: int) -> None:
    """Take an entry about the federation rather than one attempt into the summary."""
    match body:
        case GenesisEntry() as genesis:
            s.genesis = genesis
        case RosterEntry() as member:
            s.roster[member.agent_id] = member
        case wire.DataSummary() as data:
            s.data_summaries[data.member] = data
        case ModelVersionEntry() as manifest:
            _add_model_version(s, manifest)
        case ChallengeEntry() as challenge:
            s.challenges.append(challenge)
        case QuarantineEntry() as quarantine:
            s.quarantines.append(quarantine)
        case RevealEntry() as reveal:
            s.reveals.add((reveal.round, reveal.attempt, reveal.member, reveal.auditor))
        case HeadEntry() as head:
            s.last_head = (index, head.signed_hash)


def _event_text(body: LogBody) -> str | None:
    """What the events table says of an entry (None: it is not an event)."""
    match body:
        case RoundAbortedEntry() as aborted:
            return f"round {aborted.round} attempt {aborted.attempt} aborted"
        case RollbackEntry() as rollback:
            return (
                f"version {rollback.version} rolls back to the weights of "
                f"version {rollback.weights_of}: {rollback.note}"
            )
        case AlertEntry() as alert:
            return json.dumps(encode_body(alert), sort_keys=True)
        case ArchivePrunedEntry() as pruning:
            return (
                f"archive of round(s) {pruning.rounds} deleted under retention "
                f"({pruning.retention_rounds} rounds kept; {len(pruning.objects)} objects); "
                "these rounds can no longer be re-aggregated"
            )
        case QuarantineEntry() as quarantine:
            return (
                f"{quarantine.member} quarantined by {quarantine.issuer} since round "
                f"{quarantine.round}.{quarantine.attempt}; rollback offered to version "
                f"{quarantine.rollback_to}"
            )
        case wire.HeContextStatement() as context:
            return (
                f"key custodian {context.custodian} published the public CKKS context "
                f"{context.context_sha256[:16]}… (N = {context.poly_modulus_degree}, moduli "
                f"{list(context.coeff_mod_bit_sizes)} bits, scale 2^{context.scale_bits})"
            )
        case wire.DecryptionStatement() as decryption:
            return (
                f"key custodian {decryption.custodian} decrypted the sum of "
                f"{len(decryption.contributors)} contributions of round {decryption.round} "
                f"attempt {decryption.attempt} ({', '.join(decryption.contributors)}); "
                f"plaintext {decryption.plaintext_sha256[:16]}…"
            )
    return None


def _add_privacy_report(s: LogSummary, report: wire.PrivacyReport) -> None:
    row = _row(s, report)
    eps = num(report.epsilon)
    if eps is not None:
        row.epsilon_max = eps if row.epsilon_max is None else max(row.epsilon_max, eps)
        delta = num(report.delta) or 0.0
        s.epsilon.setdefault(report.member, {})[row.round] = (eps, report.dataset_id, delta)


def _add_model_version(s: LogSummary, manifest: ModelVersionEntry) -> None:
    version = manifest.version
    s.latest_version = version if s.latest_version is None else max(s.latest_version, version)
    if manifest.kind == "aggregate" and manifest.round is not None:
        closed = [
            r for r in s.rounds.values() if r.round == manifest.round and r.status == "closed"
        ]
        if closed:
            row = max(closed, key=lambda r: r.attempt)
            row.model_version = version
            row.accuracy = num(manifest.metrics.get("accuracy"))
            row.metrics = {
                name: value
                for name, raw in manifest.metrics.items()
                if (value := num(raw)) is not None
            }


def read_verdicts(path: Path) -> list[dict[str, Any]]:
    """Verdicts of ``fedsec audit check``: a JSON list of objects, or ``{"verdicts": [...]}``.

    Each verdict names ``member`` and ``round`` (``attempt`` optional), says ``passed``
    and lists the ``failed`` tests, with optional ``scores`` (test -> number).

    Raises:
        ConfigError: unreadable, too large, or not in that shape (the file is named).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"verdicts file {path}: cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_VERDICTS_BYTES:
        raise ConfigError(f"verdicts file {path}: over {MAX_VERDICTS_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"verdicts file {path}: not JSON ({exc})") from None
    items = doc.get("verdicts") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not all(
        isinstance(v, dict) and "member" in v and "round" in v and "passed" in v for v in items
    ):
        raise ConfigError(
            f"verdicts file {path}: expected a list of objects with member, round and passed"
        )
    return items
