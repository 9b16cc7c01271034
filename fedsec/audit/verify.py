"""``fedsec audit verify``: check a federation's transparency log without trusting its operator.

What is checked, stopping at the first problem:

- first, over the whole file, the chain: canonical lines, consecutive indexes, each
  ``prev`` the hash of the line before (any flipped byte, deleted, reordered or
  inserted entry breaks it).  The whole chain is checked before any entry is judged
  because a later ``archive_pruned`` entry decides how earlier entries are: their
  archive objects may be gone;

then entry by entry:

- every ``head`` signature (aggregator key from the genesis entry, or pinned with
  ``aggregator_key``);
- roster entries signed by the admin key; every other signature checked against
  the roster *as it was at that point of the log* (a key added later, or revoked
  earlier, does not count);
- round specs signed by the aggregator, cohorts drawn from active agents;
- every accepted message: its archived bytes exist and hash to the logged digest
  (a swapped archive file is caught), masked inputs carry a valid signed
  contribution statement.  An object may be missing only if a later, head-signed
  ``archive_pruned`` entry lists it for a round it prunes;
- every ``archive_pruned`` entry: signed by a later head, and keeping to the
  retention rules (:meth:`fedsec.archive.ArchiveIndex.problem_with`): it spares
  the newest ``retention_rounds`` closed rounds and every object they refer to;
- every ``he_context`` statement signed by its key custodian (roster role
  ``custodian``); every ``he_decryption`` statement signed by the round's custodian,
  naming exactly the attempt's accepted masked inputs, each once, at least
  ``min_agents`` of them, under the context the signed spec names; the archived
  ciphertexts re-added under the archived public context and the sum's digest
  compared; the archived plaintext's length and hash checked;
- every aggregate recomputed from the archive by :func:`fedsec.summation.replay`, the
  computation the aggregator's session and crash resume use: the SecAgg+ round replayed
  through the same server state machine from the archived advertisements, shares, masked
  inputs and unmask reveals, and the unmasked sum's sha256 compared (a trusted-mode
  round with an aggregation rule: the signed spec's rule re-applied to the archived
  updates, :mod:`fedsec.learning.robust`; an FLTrust round's inputs are checked, but
  its reference is trained on the aggregator's own root dataset, so it is listed in
  ``underived_rounds`` instead); then the
  model version recomputed from its parent file with the logged server optimiser
  and its safetensors sha256 compared bit for bit (a homomorphic round's model from
  the decrypted integer sum the custodian released, dequantized as a SecAgg+ ring
  sum).  Rounds pruned by retention are not re-run but listed (``pruned_rounds``);
  with FedAdam no later model version can be re-derived either, as the optimiser's
  moments depend on every earlier round;
- model manifests signed by the aggregator and matching their files;
- privacy reports signed by their member, ε non-decreasing per member and
  dataset, and ε recomputed from the logged DP parameters with an independent
  accountant (:mod:`fedsec.audit.accountant`) within 1%;
- receipts presented: signed by the aggregator and naming a logged contribution;
- the task package each spec pins, listed (``task_pins``); with ``check_task_pin``,
  every spec must pin the package installed here (:mod:`fedsec.audit.verifier.task_pins`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, assert_never

import msgspec

from fedsec.archive import Archive
from fedsec.audit.log import read_log
from fedsec.audit.verifier.aggregates import Aggregates
from fedsec.audit.verifier.attempts import Attempts, Consulted
from fedsec.audit.verifier.homomorphic import HeContexts
from fedsec.audit.verifier.identity import Identities
from fedsec.audit.verifier.models import Models
from fedsec.audit.verifier.modes import open_mode
from fedsec.audit.verifier.privacy import Privacy
from fedsec.audit.verifier.retention import ArchiveRecords
from fedsec.audit.verifier.task_pins import LocalPin, TaskPins
from fedsec.errors import FedsecError, IntegrityError
from fedsec.protocol import wire
from fedsec.protocol.log import LogEntry
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
    RoundOpenEntry,
)
from fedsec.protocol.roster import RosterEntry


class VerificationFailed(IntegrityError):
    """The log, archive, models or receipts do not hold up; names the first bad entry."""

    code = "verification_failed"


@dataclass
class VerifyResult:
    ok: bool = True
    entries: int = 0
    heads: int = 0
    rounds_verified: int = 0
    # rounds whose archive objects retention deleted: {"round", "log_entry", "detail"}
    pruned_rounds: list[dict[str, Any]] = field(default_factory=list)
    models_verified: int = 0
    receipts_checked: int = 0
    privacy_reports: int = 0
    data_summaries: int = 0  # members' signed data summaries checked
    # hidden models (he.model_visible_to_aggregator = false) not re-derived: verify was
    # not given a recipient's key to open them (nor, then, any later version)
    hidden_unopened: int = 0
    # trusted-mode rounds whose rule's inputs were checked but whose aggregate cannot be
    # re-derived (FLTrust's reference comes from the aggregator's root dataset, which the
    # log does not hold): {"round", "attempt", "rule", "detail"}
    underived_rounds: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    epsilon: dict[str, float] = field(default_factory=dict)
    # each distinct task pin of the specs, with its rounds ({"pin", "rounds"}; pin None:
    # specs signed before pinning), and whether they were compared with this installation
    task_pins: list[dict[str, Any]] = field(default_factory=list)
    task_pin_checked: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "entries": self.entries,
            "heads": self.heads,
            "rounds_verified": self.rounds_verified,
            "pruned_rounds": self.pruned_rounds,
            "models_verified": self.models_verified,
            "receipts_checked": self.receipts_checked,
            "privacy_reports": self.privacy_reports,
            "data_summaries": self.data_summaries,
            "hidden_unopened": self.hidden_unopened,
            "underived_rounds": self.underived_rounds,
            "epsilon": self.epsilon,
            "task_pins": self.task_pins,
            "task_pin_checked": self.task_pin_checked,
            "problem": self.problem,
        }


class Verifier:
    """Walks the log and routes each entry to the checker of its concern
    (:mod:`fedsec.audit.verifier`); a checker's problem is named by the entry's index
    and kind."""

    def __init__(
        self,
        archive: Archive | None,
        models_root: Path | None,
        aggregator_key: bytes | None = None,
        reader: tuple[bytes, bytes] | None = None,
        local_pin: LocalPin | None = None,
    ) -> None:
        self.identities = Identities(aggregator_key)
        self.task_pins = TaskPins(local_pin)
        self._pin_checked = local_pin is not None
        self.records = ArchiveRecords(archive)
        self.models = Models(self.identities, models_root, reader)
        self.contexts = HeContexts(self.identities, self.records)
        consulted = Consulted(self.identities, self.records, self.contexts, self.models)
        self.attempts = Attempts(
            self.identities, self.records, lambda attempt: open_mode(attempt, consulted)
        )
        self.aggregates = Aggregates(self.attempts, self.records, self.models)
        self.privacy = Privacy(self.identities)
        self.entries = 0
        self._prev: LogEntry | None = None

    def run(self, log_path: Path, receipts: Iterable[Path] = ()) -> VerifyResult:
        """Check ``log_path``, then ``receipts``; the result names the first problem."""
        try:
            self.records.read_ahead(log_path)
            for entry in read_log(log_path):
                self._check(entry)
                self._prev = entry
                self.entries += 1
            if self.entries == 0:
                raise VerificationFailed(f"{log_path} holds no entries")
            if self.models.pending:
                rounds = sorted(self.models.pending)
                raise VerificationFailed(
                    f"the aggregate of round(s) {rounds} was never published as a logged model "
                    "version"
                )
            for path in receipts:
                self.attempts.check_receipt(path)
        except FedsecError as exc:
            return self._result(exc.detail)
        return self._result(None)

    def _result(self, problem: str | None) -> VerifyResult:
        return VerifyResult(
            ok=problem is None,
            entries=self.entries,
            heads=self.identities.heads,
            rounds_verified=self.aggregates.verified,
            pruned_rounds=self.records.pruned_rounds,
            models_verified=self.models.verified,
            receipts_checked=self.attempts.receipts_checked,
            privacy_reports=self.privacy.checked,
            data_summaries=self.privacy.data_summaries,
            hidden_unopened=self.models.hidden_unopened,
            underived_rounds=self.aggregates.underived,
            problem=problem,
            epsilon=self.privacy.epsilon,
            task_pins=self.task_pins.as_list(),
            task_pin_checked=self._pin_checked,
        )

    def _check(self, entry: LogEntry) -> None:
        try:
            body = entry.decode()
            if (entry.index == 0) != isinstance(body, GenesisEntry):
                raise VerificationFailed(
                    "the first entry must be the genesis entry"
                    if entry.index == 0
                    else f"kind {entry.kind} may not appear after genesis"
                )
            self._dispatch(entry, body)
            self.records.observe(entry.index, body)
        # whatever an entry's content makes a check raise (ArithmeticError: numbers the
        # schema let through that the accountant cannot use) is that entry's fault
        except (
            FedsecError,
            KeyError,
            ValueError,
            TypeError,
            ArithmeticError,
            msgspec.ValidationError,
        ) as exc:
            detail = exc.detail if isinstance(exc, FedsecError) else repr(exc)
            raise VerificationFailed(f"log entry {entry.index} ({entry.kind}): {detail}") from None

    def _dispatch(self, entry: LogEntry, body: LogBody) -> None:
        index = entry.index
        match body:
            case GenesisEntry():
                self.identities.on_genesis(body)
            case HeadEntry():
                assert self._prev is not None  # the genesis entry comes first
                self.identities.on_head(body, self._prev)
            case RosterEntry():
                self.identities.on_roster(body)
            case QuarantineEntry():
                self.identities.on_quarantine(body)
            case wire.RoundSpec():
                self.attempts.on_round_spec(body)
                self.task_pins.on_round_spec(body)
            case AcceptedEntry():
                self.attempts.on_accepted(index, body)
            case ArchivePrunedEntry():
                self.records.on_pruned(index, body)
            case wire.PrivacyReport():
                self.privacy.on_privacy_report(body)
            case wire.DataSummary():
                self.privacy.on_data_summary(body)
            case AggregateEntry():
                self.aggregates.on_aggregate(index, body)
            case ModelVersionEntry():
                self.models.on_model_version(body)
            case wire.HeContextStatement():
                self.contexts.on_he_context(index, body)
            case wire.DecryptionStatement():
                _, mode = self.attempts.of(body)
                mode.on_decryption(index, body)
            case (
                RoundOpenEntry()
                | RefusedEntry()
                | RoundAbortedEntry()
                | RollbackEntry()
                | AlertEntry()
                | ChallengeEntry()
                | RevealEntry()
            ):
                pass  # informational: nothing to check beyond the chain and the schema
            case _:
                assert_never(body)


def verify_log(
    log_path: Path,
    archive_dir: Path | None = None,
    models_root: Path | None = None,
    receipts: Iterable[Path] = (),
    aggregator_key: bytes | None = None,
    reader: tuple[bytes, bytes] | None = None,
    check_task_pin: bool = False,
) -> VerifyResult:
    """Verify a transparency log; see the module docstring for what is checked.

    ``reader``: (Ed25519 public key, X25519 secret) of a hidden models' recipient (the
    auditor), to re-derive the versions the aggregator cannot read.
    ``check_task_pin``: every spec must pin the task package installed here
    (:func:`fedsec.task.digest.loaded_task_pin` of the task it names).
    """
    from fedsec.task.digest import loaded_task_pin

    archive = Archive(archive_dir) if archive_dir is not None else None
    local = loaded_task_pin if check_task_pin else None
    return Verifier(archive, models_root, aggregator_key, reader, local).run(log_path, receipts)
