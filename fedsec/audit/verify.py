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
- every aggregate recomputed from the archive: the SecAgg+ round replayed through
  the same server state machine from the archived advertisements, shares, masked
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
- receipts presented: signed by the aggregator and naming a logged contribution.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import msgspec
import numpy as np

from fedsec.archive import Archive, ArchiveIndex, check_pruning
from fedsec.audit import accountant
from fedsec.audit.log import read_log
from fedsec.crypto.quantize import ring_from_integers
from fedsec.crypto.secagg import (
    ServerSession,
)
from fedsec.derive import derive_model
from fedsec.errors import (
    BadVector,
    FedsecError,
    IntegrityError,
    NotFound,
    PayloadError,
    SignatureError,
)
from fedsec.learning import robust
from fedsec.learning.optimizers import AdamMoments, FedAdam, FedAvg, ServerRule
from fedsec.modelfile import ModelManifest, verify_manifest
from fedsec.protocol import he_release, wire
from fedsec.protocol.log import LogEntry, verify_head
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
    encode_body,
    kind_of,
)
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.roster import RosterEntry, verify_roster_entry
from fedsec.protocol.stages import SECAGG_STAGES
from fedsec.protocol.update_codec import codec_for

if TYPE_CHECKING:
    from fedsec.crypto.he import PublicContext

#: Trusted-mode rules whose inputs the log does not hold entirely, and why.
_UNDERIVABLE_RULES: dict[str, str] = {
    "fltrust": "FLTrust weighs each update against a reference the aggregator trains on its "
    "own root dataset, which neither the log nor the archive holds",
}

EPSILON_TOLERANCE = 0.01  # the bar: independent recomputation within 1%


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
            "problem": self.problem,
        }


@dataclass
class _Attempt:
    spec: wire.RoundSpec
    messages: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, member, sha)
    # accepted masked inputs: (log index, member, sha256)
    inputs: list[tuple[int, str, str]] = field(default_factory=list)
    # homomorphic rounds: the custodian's decryption and, re-derived from its plaintext
    # (None without the archive, or pruned), the ring sum's sha256 and (Σ w·Δ, Σ w)
    decryption: wire.DecryptionStatement | None = None
    he_sums: tuple[str, Any] | None = None
    # homomorphic rounds: member -> the ciphertext sha256 it committed to (stage commit)
    commitments: dict[str, str] = field(default_factory=dict)


class Verifier:
    def __init__(
        self,
        archive: Archive | None,
        models_root: Path | None,
        aggregator_key: bytes | None = None,
        reader: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.archive = archive
        # (Ed25519 public key, X25519 secret) of a recipient of hidden models: the auditor's
        self.reader = reader
        # hidden versions re-derived here: sealed file sha256 -> the model in the clear
        self.clear_models: dict[str, bytes] = {}
        self.sealed_pending: dict[int, tuple[wire.DecryptionStatement, bytes]] = {}
        self.hidden_gap = False  # a hidden version was not opened: later parents unknown
        self.models_root = models_root
        self.pinned_key = aggregator_key
        self.result = VerifyResult()
        self.federation_id = ""
        self.aggregator_key = b""
        self.admin_key = b""
        self.roster: dict[str, RosterEntry] = {}
        self.attempts: dict[tuple[int, int], _Attempt] = {}
        self.contributions: dict[int, AcceptedEntry] = {}  # log index -> accepted masked input
        # homomorphic summation: context sha256 -> the custodian's logged statement, and
        # the public contexts loaded from the archive (each parsed once)
        self.he_contexts: dict[str, tuple[int, wire.HeContextStatement]] = {}
        self._public_contexts: dict[str, PublicContext] = {}
        self.reports: dict[tuple[str, str], list[wire.PrivacyReport]] = defaultdict(list)
        # (member, dataset) -> every training charged, one entry per charge (_charge_key)
        self.charges: dict[tuple[str, str], dict[tuple[str, int], _Charged]] = defaultdict(dict)
        # member -> epsilon of the noised counts of its logged data summaries
        self.noised_counts: dict[str, float] = {}
        self.manifests: dict[int, ModelManifest] = {}
        self.pending_model: dict[int, str] = {}  # version -> recomputed sha256 awaiting manifest
        self.genesis: GenesisEntry | None = None
        self.adam: AdamMoments | None = None  # FedAdam's moments, carried along the log
        self.adam_unknown = False  # a FedAdam round was pruned: later moments cannot be known
        self._prev: LogEntry | None = None
        self.archived = ArchiveIndex()  # the log so far: what refers to which object
        self.ahead = ArchiveIndex()  # the whole log, read first: which objects were pruned
        self.last_head = -1

    # -- entry point ----------------------------------------------------------------------------

    def run(self, log_path: Path, receipts: Iterable[Path] = ()) -> VerifyResult:
        try:
            self._read_ahead(log_path)
            for entry in read_log(log_path):
                self._check(entry)
                self._prev = entry
                self.result.entries += 1
            if self.result.entries == 0:
                raise VerificationFailed(f"{log_path} holds no entries")
            if self.pending_model:
                rounds = sorted(self.pending_model)
                raise VerificationFailed(
                    f"the aggregate of round(s) {rounds} was never published as a logged model "
                    "version"
                )
            for path in receipts:
                self._check_receipt(path)
        except FedsecError as exc:
            self.result.ok = False
            self.result.problem = exc.detail
        return self.result

    def _read_ahead(self, log_path: Path) -> None:
        """First pass: the chain, the last head, and the head-signed prunings."""
        head, pruned = kind_of(HeadEntry), kind_of(ArchivePrunedEntry)
        prunings: list[LogEntry] = []
        for entry in read_log(log_path):
            if entry.kind == head:
                self.last_head = entry.index
            if entry.kind == pruned:
                prunings.append(entry)
            else:
                with contextlib.suppress(FedsecError):  # named in the second pass
                    self.ahead.observe(entry.index, entry.decode())
        for entry in prunings:
            if entry.index < self.last_head:  # an unsigned one explains nothing
                with contextlib.suppress(FedsecError):
                    self.ahead.observe(entry.index, entry.decode())

    # -- per entry --------------------------------------------------------------------------------

    def _fail(self, entry: LogEntry, why: str) -> VerificationFailed:
        return VerificationFailed(f"log entry {entry.index} ({entry.kind}): {why}")

    def _check(self, entry: LogEntry) -> None:
        try:
            body = entry.decode()
            if (entry.index == 0) != isinstance(body, GenesisEntry):
                raise self._fail(
                    entry,
                    "the first entry must be the genesis entry"
                    if entry.index == 0
                    else f"kind {entry.kind} may not appear after genesis",
                )
            self._dispatch(entry, body)
            self.archived.observe(entry.index, body)
        except VerificationFailed:
            raise
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
            raise self._fail(entry, detail) from None

    def _dispatch(self, entry: LogEntry, body: LogBody) -> None:
        match body:
            case GenesisEntry():
                self._genesis(entry, body)
            case HeadEntry():
                self._on_head(body)
            case RosterEntry():
                self._on_roster(body)
            case wire.RoundSpec():
                self._on_round_spec(entry, body)
            case AcceptedEntry():
                self._on_accepted(entry, body)
            case ArchivePrunedEntry():
                self._on_archive_pruned(entry, body)
            case wire.PrivacyReport():
                self._on_privacy_report(entry, body)
            case wire.DataSummary():
                # the member's own statement about its data: its signature is checked, and
                # noised counts must show up in its privacy reports' pure epsilon
                body.verify(self._member_key(entry, body.member))
                self.noised_counts[body.member] = (
                    self.noised_counts.get(body.member, 0.0) + body.count_epsilon
                )
                self.result.data_summaries += 1
            case AggregateEntry():
                self._on_aggregate(entry, body)
            case ModelVersionEntry():
                self._on_model_version(entry, body)
            case wire.HeContextStatement():
                self._on_he_context(entry, body)
            case wire.DecryptionStatement():
                self._on_he_decryption(entry, body)
            case QuarantineEntry():
                self._on_quarantine(entry, body)
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

    def _genesis(self, entry: LogEntry, body: GenesisEntry) -> None:
        self.genesis = body
        self.federation_id = body.federation_id
        self.aggregator_key = bytes.fromhex(body.aggregator_public_key)
        self.admin_key = bytes.fromhex(body.admin_public_key)
        if self.pinned_key is not None and self.pinned_key != self.aggregator_key:
            raise self._fail(entry, "genesis names an aggregator key other than the pinned one")

    def _model_bytes(self, entry: LogEntry, digest: str) -> bytes:
        """The model file named ``digest`` (checked to be a sha256 hex, so it stays in models/)."""
        assert self.models_root is not None
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise self._fail(entry, f"model reference {digest!r} is not a sha256 hex digest")
        if digest in self.clear_models:
            return self.clear_models[digest]
        path = self.models_root / "models" / f"{digest}.safetensors"
        try:
            return path.read_bytes()
        except OSError as exc:
            raise self._fail(entry, f"model file {path} cannot be read ({exc.strerror})") from None

    def _on_head(self, head: HeadEntry) -> None:
        assert self._prev is not None
        verify_head(head, self.aggregator_key, self._prev)
        self.result.heads += 1

    def _on_roster(self, roster_entry: RosterEntry) -> None:
        verify_roster_entry(roster_entry, self.admin_key, self.federation_id)
        self.roster[roster_entry.agent_id] = roster_entry

    def _member_key(self, entry: LogEntry, member: str) -> bytes:
        known = self.roster.get(member)
        if known is None or not known.is_active:
            raise self._fail(entry, f"{member} is not an active roster member at this point")
        return known.public_key_bytes

    def _on_quarantine(self, entry: LogEntry, body: QuarantineEntry) -> None:
        """A quarantine carried out on an order: the order is the named member's, of
        this federation, signed by the admin or by the auditor it names."""
        order = body.order
        if order is None:
            return  # on an auditor's failed verdict (audit.quarantine_on_failure)
        if (order.federation_id, order.member, order.issuer) != (
            self.federation_id,
            body.member,
            body.issuer,
        ):
            raise self._fail(entry, "the order names another federation, member or issuer")
        key = self.admin_key if order.issuer == "admin" else self._member_key(entry, order.issuer)
        order.verify(key)

    def _on_round_spec(self, entry: LogEntry, spec: wire.RoundSpec) -> None:
        spec.verify(self.aggregator_key)
        if spec.federation_id != self.federation_id:
            raise self._fail(entry, f"spec of federation {spec.federation_id}")
        for member in spec.cohort:
            self._member_key(entry, member)
        self.attempts[(spec.round, spec.attempt)] = _Attempt(spec)

    def _attempt(
        self, entry: LogEntry, body: AcceptedEntry | AggregateEntry | wire.DecryptionStatement
    ) -> _Attempt:
        key = (body.round, body.attempt)
        if key not in self.attempts:
            raise self._fail(entry, f"round {key[0]} attempt {key[1]} has no signed spec before it")
        return self.attempts[key]

    def _on_accepted(self, entry: LogEntry, body: AcceptedEntry) -> None:
        attempt = self._attempt(entry, body)
        member, stage, digest = body.member, body.stage, body.sha256
        spec = attempt.spec
        if stage == "decrypt" and spec.secure_sum == "he" and member == spec.custodian:
            # the custodian's decryption, kept as a message of the attempt
            self._custodian_key(entry, member)
            if self.archive is not None:
                self._check_archived(entry, spec.round, f"decrypt from {member}", digest)
            return
        if member not in attempt.spec.cohort:
            raise self._fail(entry, f"{member} is not in the cohort of this round")
        public = self._member_key(entry, member)
        if self.archive is not None:
            self._check_archived(entry, attempt.spec.round, f"{stage} from {member}", digest)
        if stage == "commit" and spec.secure_sum == "he":
            self._on_commitment(entry, body, attempt, public)
        if stage == "masked_input":
            if body.commitment is None or body.signature is None:
                raise self._fail(entry, "a masked input without its contribution statement")
            wire.ContributionStatement(
                federation_id=self.federation_id,
                round=attempt.spec.round,
                attempt=attempt.spec.attempt,
                member=member,
                vector_sha256=digest,
                commitment=body.commitment,
                signature=body.signature,
                commitments_sha256=self._committed(entry, attempt, member, digest),
            ).verify(public)
            self.contributions[entry.index] = body
            attempt.inputs.append((entry.index, member, digest))
        attempt.messages.append((stage, member, digest))

    def _on_commitment(
        self, entry: LogEntry, body: AcceptedEntry, attempt: _Attempt, public: bytes
    ) -> None:
        """A member's signed commitment to its ciphertext's hash, logged before any
        ciphertext of the attempt (a later one could be made from them)."""
        if attempt.inputs:
            raise self._fail(entry, "a ciphertext commitment logged after a ciphertext")
        if body.member in attempt.commitments:
            raise self._fail(entry, f"a second ciphertext commitment of {body.member}")
        if body.commitment is None or body.signature is None:
            raise self._fail(entry, "a ciphertext commitment without its hash and signature")
        wire.CiphertextCommitment(
            federation_id=self.federation_id,
            round=body.round,
            attempt=body.attempt,
            member=body.member,
            vector_sha256=body.commitment,
            signature=body.signature,
        ).verify(public)
        attempt.commitments[body.member] = body.commitment

    def _committed(self, entry: LogEntry, attempt: _Attempt, member: str, digest: str) -> str:
        """he: the commitment set's digest a masked input's statement binds, once its
        ciphertext is the one its member committed to ("" in the other modes)."""
        if attempt.spec.secure_sum != "he":
            return ""
        if attempt.commitments.get(member) != digest:
            raise self._fail(
                entry, f"{member}'s ciphertext is not one it committed to before the ciphertexts"
            )
        return wire.commitments_digest(attempt.commitments.items())

    def _check_archived(self, entry: LogEntry, round_: int, what: str, digest: str) -> None:
        """The object exists and hashes to ``digest``, or a signed pruning deleted it."""
        assert self.archive is not None
        try:
            self.archive.get(digest)
        except NotFound:
            if self.ahead.deleted_by(digest, round_, entry.index) is not None:
                return
            pruned = self.ahead.pruned_by(round_)
            why = (
                f"round {round_} was pruned by log entry {pruned}, which does not list it"
                if pruned is not None
                else "no archive_pruned entry records its deletion"
            )
            raise self._fail(
                entry, f"round {round_}: archive object {digest} ({what}) is missing; {why}"
            ) from None

    def _on_archive_pruned(self, entry: LogEntry, pruning: ArchivePrunedEntry) -> None:
        check_pruning(pruning)
        if entry.index > self.last_head:
            raise self._fail(
                entry,
                "no head signs it (the aggregator writes it at a round close, before that "
                "close's head)",
            )
        problem = self.archived.problem_with(pruning)
        if problem is not None:
            raise self._fail(entry, problem)
        for round_ in pruning.rounds:
            self.result.pruned_rounds.append(
                {
                    "round": round_,
                    "log_entry": entry.index,
                    "detail": f"pruned by retention (log entry {entry.index})",
                }
            )

    def _on_privacy_report(self, entry: LogEntry, report: wire.PrivacyReport) -> None:
        report.verify(self._member_key(entry, report.member))
        history = self.reports[(report.member, report.dataset_id)]
        if history and report.epsilon < history[-1].epsilon - 1e-9:
            raise self._fail(
                entry,
                f"{report.member} reports epsilon {report.epsilon:.4f} on {report.dataset_id}, "
                f"less than the {history[-1].epsilon:.4f} it reported before",
            )
        try:
            report.check_charges()
        except PayloadError as exc:
            raise self._fail(entry, exc.detail) from None
        # one entry per charge: a retried attempt, or a buffered member contributing an
        # update trained earlier, reports the same training again; a charge whose own
        # report never reached the log is declared by a later report
        charged = dict(self.charges[(report.member, report.dataset_id)])
        own = _Charged(
            _trained_round(report), report.noise_multiplier, report.sample_rate, report.steps
        )
        declared = [(_charge_key(c.index, -1), _Charged.of(c)) for c in report.unreported]
        for key, charge in [*declared, (_charge_key(report.charge, own.round), own)]:
            # a charge is given one way only; a report naming no charge replaces the
            # last report of its round
            known = charged.get(key)
            if key[0] == "charge" and known is not None and known != charge:
                raise self._fail(
                    entry,
                    f"{report.member} gives charge {key[1]} on {report.dataset_id} as "
                    f"{charge}, but an earlier report gave it as {known}",
                )
            charged[key] = charge
        rounds = [(c.noise_multiplier, c.sample_rate, c.steps) for c in charged.values()]
        noised = self.noised_counts.get(report.member, 0.0)
        if report.extra_epsilon < noised - 1e-9:
            raise self._fail(
                entry,
                f"{report.member} accounts epsilon {report.extra_epsilon:.4f} for pure "
                f"releases, less than the {noised:.4f} of its logged noised data summaries",
            )
        if report.noise_multiplier:
            self._check_epsilon(entry, report, rounds)
        history.append(report)
        self.charges[(report.member, report.dataset_id)] = charged
        self.result.privacy_reports += 1
        self.result.epsilon[report.member] = report.epsilon

    def _check_epsilon(
        self, entry: LogEntry, report: wire.PrivacyReport, rounds: list[tuple[float, float, int]]
    ) -> None:
        """The reported ε lies between the independent PLD and RDP values, within
        EPSILON_TOLERANCE (:mod:`fedsec.audit.accountant`)."""
        sgd = report.epsilon - report.extra_epsilon  # basic composition: the rest is DP-SGD's
        tight, loose = accountant.epsilon_range(rounds, report.delta)
        low, high = tight * (1 - EPSILON_TOLERANCE), loose * (1 + EPSILON_TOLERANCE)
        if not low <= sgd <= max(high, 1e-9):
            independent = tight if sgd < low else loose
            raise self._fail(
                entry,
                f"{report.member} reports epsilon {sgd:.4f}"
                + (" for DP-SGD" if report.extra_epsilon else "")
                + f", but its logged DP parameters give {independent:.4f} (independent "
                "accountant)",
            )

    def _on_aggregate(self, entry: LogEntry, body: AggregateEntry) -> None:
        attempt = self._attempt(entry, body)
        if body.parent_version != attempt.spec.model_version:
            raise self._fail(
                entry,
                f"round {attempt.spec.round} was applied to version {body.parent_version}, "
                f"but its signed spec names version {attempt.spec.model_version}",
            )
        spec = attempt.spec
        if spec.secure_sum == "he":
            self._check_he_survivors(entry, body, attempt)
        if self.archive is None:
            return
        fedadam = body.optimizer == "fedadam"
        if self.ahead.pruned_by(spec.round) is not None:
            self.adam_unknown = self.adam_unknown or fedadam
            return  # listed in pruned_rounds when its archive_pruned entry is checked
        if spec.secure_sum == "he":
            weight = self._he_sum(entry, body, attempt)
        elif spec.aggregation is not None and spec.aggregation.rule in _UNDERIVABLE_RULES:
            self._check_underived(entry, body, attempt)
            self.adam_unknown = self.adam_unknown or fedadam
            return
        else:
            survivors, total, weight = self._replay(entry, attempt)
            if sorted(survivors) != sorted(body.survivors):
                raise self._fail(entry, f"the archive gives survivors {sorted(survivors)}")
            digest = hashlib.sha256(total).hexdigest()
            if digest != body.sum_sha256:
                raise self._fail(
                    entry, "the sum recomputed from the archived inputs and reveals differs"
                )
        if weight is None:
            return  # a hidden model not opened: counted in hidden_unopened
        self.result.rounds_verified += 1
        known = not (fedadam and self.adam_unknown) and not self.hidden_gap
        if self.models_root is not None and known:
            self._recompute_model(entry, body, spec, weight)

    # -- homomorphic summation ------------------------------------------------------------------

    def _custodian_key(self, entry: LogEntry, custodian: str) -> bytes:
        """The roster key of ``custodian``, an active member of role custodian here."""
        key = self._member_key(entry, custodian)  # active at this point
        known = self.roster[custodian]
        if known.role != "custodian":
            raise self._fail(entry, f"{custodian} has roster role {known.role}, not custodian")
        return key

    def _verify_custodian(
        self,
        entry: LogEntry,
        statement: wire.HeContextStatement | wire.DecryptionStatement,
        what: str,
    ) -> None:
        if statement.federation_id != self.federation_id:
            raise self._fail(entry, f"{what} of federation {statement.federation_id}")
        known = self.roster.get(statement.custodian)
        key = self._custodian_key(entry, statement.custodian)
        try:
            statement.verify(key)
        except SignatureError:
            key_id = known.key_id if known is not None else "?"
            raise self._fail(
                entry,
                f"the signature of {what} does not verify under custodian "
                f"{statement.custodian}'s roster key {key_id} (forged, or altered after signing)",
            ) from None

    def _on_he_context(self, entry: LogEntry, statement: wire.HeContextStatement) -> None:
        self._verify_custodian(entry, statement, "the CKKS context statement")
        self.he_contexts[statement.context_sha256] = (entry.index, statement)

    def _on_he_decryption(self, entry: LogEntry, statement: wire.DecryptionStatement) -> None:
        attempt = self._attempt(entry, statement)
        spec = attempt.spec
        where = f"round {spec.round} attempt {spec.attempt}"
        if spec.secure_sum != "he":
            raise self._fail(
                entry, f"{where} is a secure_sum = {spec.secure_sum} round; nothing is decrypted"
            )
        if attempt.decryption is not None:
            raise self._fail(entry, f"{where} was decrypted already")
        if statement.custodian != spec.custodian:
            raise self._fail(
                entry,
                f"the decryption is by {statement.custodian}, but the signed spec of {where} "
                f"names custodian {spec.custodian or '(none)'}",
            )
        self._verify_custodian(entry, statement, "the decryption statement")
        logged = self.he_contexts.get(spec.he_context_sha256)
        if logged is None:
            raise self._fail(
                entry,
                f"the signed spec of {where} names CKKS context {spec.he_context_sha256[:16]}…, "
                "which no earlier he_context entry publishes",
            )
        context_index, context = logged
        if context.custodian != statement.custodian:
            raise self._fail(
                entry,
                f"CKKS context {context.context_sha256[:16]}… was published by "
                f"{context.custodian} (log entry {context_index}), not by the decrypting "
                f"custodian {statement.custodian}",
            )
        self._check_contributors(entry, attempt, statement)
        attempt.decryption = statement
        if self.archive is None or self.ahead.pruned_by(spec.round) is not None:
            return  # a pruned round is listed when its archive_pruned entry is checked
        attempt.he_sums = self._rederive_he(entry, attempt, statement, logged)

    def _check_contributors(
        self, entry: LogEntry, attempt: _Attempt, statement: wire.DecryptionStatement
    ) -> None:
        """``contributors`` are the attempt's accepted masked inputs, each once, and enough."""
        spec = attempt.spec
        where = f"round {spec.round} attempt {spec.attempt}"
        named = statement.contributors
        twice = sorted({m for m in named if named.count(m) > 1})
        if twice:
            raise self._fail(
                entry,
                f"it counts {', '.join(twice)} more than once; each accepted contribution of "
                f"{where} enters the sum once",
            )
        at: dict[str, list[int]] = defaultdict(list)
        for index, member, _ in attempt.inputs:
            at[member].append(index)
        for member, indexes in sorted(at.items()):
            if len(indexes) > 1:
                raise self._fail(
                    entry,
                    f"{member} has {len(indexes)} accepted masked inputs in {where} "
                    f"(log entries {indexes}); a sum holds one per member",
                )
        strangers = sorted(set(named) - set(at))
        if strangers:
            raise self._fail(
                entry,
                f"it names contributor(s) {', '.join(strangers)}, who have no accepted "
                f"masked input in {where}",
            )
        left_out = sorted(set(at) - set(named))
        if left_out:
            raise self._fail(
                entry,
                f"the accepted masked input(s) of {', '.join(left_out)} (log entries "
                f"{sorted(i for m in left_out for i in at[m])}) are not among its contributors",
            )
        assert self.genesis is not None  # entry 0, checked first
        least = int(self.genesis.round.get("min_agents", 1))
        if len(named) < least:
            raise self._fail(
                entry,
                f"it decrypts a sum of {len(named)} contribution(s), fewer than the "
                f"federation's round.min_agents = {least}",
            )

    def _archived(self, entry: LogEntry, round_: int, what: str, digest: str) -> bytes:
        """The archived object ``digest`` of a round that is not pruned."""
        assert self.archive is not None
        try:
            return self.archive.get(digest)
        except NotFound:
            pass
        except IntegrityError as exc:
            raise self._fail(entry, f"round {round_}: {what}: {exc.detail}") from None
        self._check_archived(entry, round_, what, digest)  # says why it is missing
        raise self._fail(entry, f"round {round_}: archive object {digest} ({what}) is missing")

    def _rederive_he(
        self,
        entry: LogEntry,
        attempt: _Attempt,
        statement: wire.DecryptionStatement,
        logged: tuple[int, wire.HeContextStatement],
    ) -> tuple[str, Any] | None:
        """Re-add the archived ciphertexts, compare the digest, read the plaintext.

        Returns:
            (sha256 of the ring sum, (Σ w·Δ, Σ w)) from the released plaintext; None for
            a hidden model no key here opens.
        """
        try:
            from fedsec.crypto import he
        except ModuleNotFoundError:
            raise self._fail(
                entry,
                "re-adding a homomorphic round's ciphertexts needs TenSEAL: install fedsec "
                "with the he extra",
            ) from None
        spec = attempt.spec
        context_index, context = logged
        params = he.HeParams(
            context.poly_modulus_degree, tuple(context.coeff_mod_bit_sizes), context.scale_bits
        )
        public = self._public_contexts.get(context.context_sha256)
        if public is None:
            what = f"public CKKS context of log entry {context_index}"
            data = self._archived(entry, spec.round, what, context.context_sha256)
            try:
                public = he.load_public_context(data, params, params.context_max_bytes(False))
            except FedsecError as exc:
                raise self._fail(
                    entry, f"the archived {what} does not load: {exc.detail}"
                ) from None
            self._public_contexts[context.context_sha256] = public
        values = spec.dim + 1
        total = he.CiphertextSum(public, params, values)
        for index, member, digest in attempt.inputs:
            raw = self._archived(entry, spec.round, f"masked_input from {member}", digest)
            try:
                total.add(he.unframe_chunks(raw, params, values))
            except FedsecError as exc:
                raise self._fail(
                    entry,
                    f"the archived ciphertext of {member} (log entry {index}) does not add "
                    f"under the federation's context: {exc.detail}",
                ) from None
        digest = total.digest()
        if digest != statement.sum_sha256:
            raise self._fail(
                entry,
                f"re-adding the {total.count} archived ciphertexts of round {spec.round} "
                f"attempt {spec.attempt} gives sum digest {digest[:16]}…, but the custodian "
                f"decrypted a sum with digest {statement.sum_sha256[:16]}…",
            )
        if statement.sealed:
            opened = self._open_hidden(entry, spec, statement)
            if opened is None:
                return None
            plaintext = opened
        else:
            what = "plaintext of the custodian's decryption"
            plaintext = self._archived(entry, spec.round, what, statement.plaintext_sha256)
        what = "plaintext of the custodian's decryption"
        if len(plaintext) != values * 8:
            raise self._fail(
                entry,
                f"the archived {what} is {len(plaintext)} bytes; {values} int64 values are "
                f"{values * 8}",
            )
        quant = spec.quant_spec()
        ints = np.frombuffer(plaintext, dtype="<i8")
        # (ints & ring_mask) as the ring's dtype, as the aggregator turns it into a ring sum
        # (bit for bit the same for any int64, negative ones and a 64-bit ring included)
        ring = ring_from_integers(ints, quant)
        sums = codec_for(spec).decode_sum(ring, len(statement.contributors))
        return hashlib.sha256(ring.tobytes()).hexdigest(), sums

    def _open_hidden(
        self, entry: LogEntry, spec: wire.RoundSpec, statement: wire.DecryptionStatement
    ) -> bytes | None:
        """The plaintext of a hidden model's release, opened with the reader's key (None
        without one: the version and every later one are then not re-derived)."""
        assert statement.sealed_sha256 is not None  # a sealed statement names it
        what = "sealed release of the custodian's decryption"
        rest = self._archived(entry, spec.round, what, statement.sealed_sha256)
        if self.reader is None:
            self.result.hidden_unopened += 1
            self.hidden_gap = True
            return None
        public, secret = self.reader
        member = next(
            (m for m, e in self.roster.items() if e.public_key_bytes == public and e.is_active),
            None,
        )
        if member is None:
            raise self._fail(
                entry, "the key given to open hidden models is on no active roster entry"
            )
        try:
            opened = he_release.open_sealed(statement, rest, member, secret, spec.dim + 1)
        except FedsecError as exc:
            raise self._fail(entry, f"the archived {what} does not open: {exc.detail}") from None
        self.sealed_pending[spec.round] = (statement, opened.model)
        return opened.plaintext

    def _check_he_survivors(self, entry: LogEntry, body: AggregateEntry, attempt: _Attempt) -> None:
        spec, decryption = attempt.spec, attempt.decryption
        if decryption is None:
            raise self._fail(
                entry,
                f"round {spec.round} attempt {spec.attempt} sums ciphertexts (secure_sum = he), "
                "but no he_decryption entry of the attempt precedes its aggregate",
            )
        if sorted(body.survivors) != sorted(decryption.contributors):
            raise self._fail(
                entry,
                f"it names survivors {sorted(body.survivors)}, but the custodian decrypted the "
                f"sum of {sorted(decryption.contributors)}",
            )

    def _he_sum(self, entry: LogEntry, body: AggregateEntry, attempt: _Attempt) -> Any:
        """(Σ w·Δ, Σ w) of a homomorphic round, from its decryption's plaintext."""
        if attempt.he_sums is None:  # a hidden model no key here opens
            return None
        ring_digest, sums = attempt.he_sums
        if body.sum_sha256 != ring_digest:
            raise self._fail(
                entry,
                f"sum_sha256 {body.sum_sha256[:16]}… is not the ring sum of the decrypted "
                f"plaintext ({ring_digest[:16]}…)",
            )
        return sums

    def _replay(self, entry: LogEntry, attempt: _Attempt) -> tuple[list[str], bytes, Any]:
        assert self.archive is not None
        spec = attempt.spec
        if spec.secure_sum == "none" and spec.aggregation is not None:
            return self._replay_rule(attempt, spec.aggregation)
        if spec.secure_sum == "none":
            encoding = codec_for(spec)
            plain = np.zeros(spec.dim, dtype=np.float64)
            weights = 0.0
            members = []
            from fedsec.crypto.quantize import unpack

            for stage, member, digest in attempt.messages:
                if stage != "masked_input":
                    continue
                vector = unpack(self.archive.get(digest), encoding.length, spec.ring_bits)
                update, w = encoding.decode_one(vector)
                plain += update
                weights += w
                members.append(member)
            return members, plain.astype("<f8").tobytes(), (plain, weights)
        keys = {m: self._member_key(entry, m) for m in spec.cohort}
        # a round logged before the consistency stage existed carries no graph commitments
        # (both came in one protocol change); its unmask followed masked input directly
        legacy = not spec.graph_commitments
        session = ServerSession(spec.secagg_params(), keys, consistency=not legacy)
        order = tuple(s for s in SECAGG_STAGES if not (legacy and s == "consistency"))
        current = 0
        for stage, member, digest in attempt.messages:
            target = order.index(stage)
            while current < target:
                _close(session, order[current])
                current += 1
            raw = self.archive.get(digest)
            feed_accepted(session, stage, member, raw)
        while current < len(order) - 1:
            _close(session, order[current])
            current += 1
        result = session.finalize()
        decoded = codec_for(spec).decode_sum(result.ring_sum, len(result.survivors))
        return list(result.survivors), result.ring_sum.tobytes(), decoded

    # -- trusted mode: robust aggregation rules -------------------------------------------------

    def _trusted_inputs(self, attempt: _Attempt) -> list[tuple[str, Any]]:
        """(member, ring vector) of each archived masked input, in member order (the order
        the aggregator's session applies the rule in)."""
        assert self.archive is not None
        spec = attempt.spec
        from fedsec.crypto.quantize import unpack

        encoding = codec_for(spec)
        inputs = []
        for _, member, digest in sorted(attempt.inputs, key=lambda i: i[1]):
            vector = unpack(self.archive.get(digest), encoding.length, spec.ring_bits)
            try:
                encoding.check_input(vector)
            except BadVector as exc:
                raise IntegrityError(
                    f"round {spec.round}: the archived update of {member} has {exc.detail}, "
                    "which the aggregator must have refused"
                ) from None
            inputs.append((member, vector))
        return inputs

    def _replay_rule(
        self, attempt: _Attempt, rule: wire.AggregationSpec
    ) -> tuple[list[str], bytes, Any]:
        """The signed spec's rule re-applied to the archived updates, as the aggregator's
        session applies it (:func:`fedsec.learning.robust.aggregate`), bit for bit."""
        encoding = codec_for(attempt.spec)
        inputs = self._trusted_inputs(attempt)
        rows = [encoding.decode_one(vector) for _, vector in inputs]
        weights = np.array([w for _, w in rows])
        result = robust.aggregate(rule, np.stack([u for u, _ in rows]), weights)
        weighted, weight = robust.as_weighted_sum(result, weights)
        survivors = [inputs[i][0] for i in result.accepted]
        return survivors, weighted.astype("<f8").tobytes(), (weighted, weight)

    def _check_underived(self, entry: LogEntry, body: AggregateEntry, attempt: _Attempt) -> None:
        """A rule whose inputs the log does not hold all of (FLTrust's reference): check
        what it does hold, and list the round as not re-derived."""
        spec = attempt.spec
        assert spec.aggregation is not None
        inputs = dict(self._trusted_inputs(attempt))
        strangers = sorted(set(body.survivors) - set(inputs))
        if strangers:
            raise self._fail(
                entry,
                f"it names survivor(s) {', '.join(strangers)} without an accepted masked "
                f"input in round {spec.round} attempt {spec.attempt}",
            )
        assert self.genesis is not None  # entry 0, checked first
        least = int(self.genesis.round.get("min_agents", 1))
        if len(inputs) < least or not body.survivors:
            raise self._fail(
                entry,
                f"it aggregates {len(body.survivors)} of {len(inputs)} archived update(s); a "
                f"round closes with at least round.min_agents = {least} and applies one or more",
            )
        self.result.underived_rounds.append(
            {
                "round": spec.round,
                "attempt": spec.attempt,
                "rule": spec.aggregation.rule,
                "detail": f"inputs checked ({len(inputs)} archived updates, "
                f"{len(body.survivors)} applied), aggregate and model version not re-derived: "
                f"{_UNDERIVABLE_RULES[spec.aggregation.rule]}",
            }
        )

    def _recompute_model(
        self, entry: LogEntry, body: AggregateEntry, spec: wire.RoundSpec, sums: Any
    ) -> None:
        assert self.models_root is not None
        parent = self.manifests.get(body.parent_version)
        if parent is None:
            raise self._fail(entry, f"parent version {body.parent_version} was never logged")
        data = self._model_bytes(entry, parent.sha256)
        weighted, weights = sums
        assert self.genesis is not None  # entry 0, checked first
        rule = _logged_rule(body, self.genesis.server)
        model, self.adam = derive_model(spec.task, data, weighted, weights, rule, self.adam)
        digest = hashlib.sha256(model).hexdigest()
        hidden = self.sealed_pending.get(spec.round)
        if hidden is not None:
            statement, released = hidden
            if digest != statement.model_sha256 or model != released:
                raise self._fail(
                    entry,
                    f"re-deriving the hidden model of round {spec.round} gives {digest[:16]}…, "
                    f"but the custodian sealed model {str(statement.model_sha256)[:16]}…",
                )
            digest = statement.model_sha256
        self.pending_model[spec.round] = digest

    def _on_model_version(self, entry: LogEntry, body: ModelVersionEntry) -> None:
        manifest = ModelManifest.from_json(json.dumps(encode_body(body)).encode())
        data = None
        if self.models_root is not None:
            data = self._model_bytes(entry, manifest.sha256)
        verify_manifest(manifest, self.aggregator_key, data, federation_id=self.federation_id)
        if manifest.kind == "sealed" and manifest.round in self.pending_model:
            self._check_sealed_version(entry, manifest, data)
        elif manifest.kind == "aggregate" and manifest.round in self.pending_model:
            expected = self.pending_model.pop(manifest.round)
            if expected != manifest.sha256:
                raise self._fail(
                    entry,
                    f"model version {manifest.version} has sha256 {manifest.sha256[:16]}…, but "
                    f"re-deriving it from version {manifest.parent} and the round's sum gives "
                    f"{expected[:16]}…",
                )
            self.result.models_verified += 1
        if manifest.kind == "rollback":
            parent = self.manifests.get(manifest.parent or -1)
            if parent is None or parent.sha256 != manifest.sha256:
                raise self._fail(entry, "a rollback must carry exactly the weights of its target")
        self.manifests[manifest.version] = manifest

    def _check_sealed_version(
        self, entry: LogEntry, manifest: ModelManifest, data: bytes | None
    ) -> None:
        """A hidden version: its file is the logged release, and the model inside is the
        one re-derived (kept in the clear as the parent of the next version)."""
        assert manifest.round is not None  # in pending_model
        expected = self.pending_model.pop(manifest.round)
        statement, model = self.sealed_pending.pop(manifest.round)
        if data is not None:
            try:
                stored, rest = he_release.unframe(data, he_release.MAX_STATEMENT_BYTES)
            except FedsecError as exc:
                raise self._fail(
                    entry, f"sealed version {manifest.version}: {exc.detail}"
                ) from None
            if stored != statement or hashlib.sha256(rest).hexdigest() != statement.sealed_sha256:
                raise self._fail(
                    entry,
                    f"sealed version {manifest.version} is not the release the custodian's "
                    "logged decryption names",
                )
        assert expected == statement.model_sha256
        self.clear_models[manifest.sha256] = model
        self.result.models_verified += 1

    # -- receipts ----------------------------------------------------------------------------------

    def _check_receipt(self, path: Path) -> None:
        try:
            receipt = msgspec.json.decode(path.read_bytes(), type=wire.Receipt)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise VerificationFailed(f"receipt {path}: unreadable ({exc})") from None
        try:
            receipt.verify(self.aggregator_key)
        except FedsecError:
            raise VerificationFailed(
                f"receipt {path}: not signed by the federation's aggregator key"
            ) from None
        logged = self.contributions.get(receipt.log_index)
        if logged is None:
            raise VerificationFailed(
                f"receipt {path}: log entry {receipt.log_index} is not an accepted contribution "
                "(the contribution was dropped from the log)"
            )
        if (logged.member, logged.round, logged.attempt) != (
            receipt.member,
            receipt.round,
            receipt.attempt,
        ) or logged.sha256 != receipt.contribution_sha256:
            raise VerificationFailed(
                f"receipt {path}: log entry {receipt.log_index} records a different contribution"
            )
        self.result.receipts_checked += 1


def _logged_rule(body: AggregateEntry, server: dict[str, Any]) -> ServerRule:
    """The server optimiser an aggregate entry names; FedAdam's settings are the genesis ones."""
    lr = float(body.server_lr)
    if body.optimizer == "fedadam":
        beta1, beta2, tau = server["adam_beta1"], server["adam_beta2"], server["adam_tau"]
        return FedAdam(lr, float(beta1), float(beta2), float(tau))
    return FedAvg(lr)


def _trained_round(report: wire.PrivacyReport) -> int:
    return report.trained_round if report.trained_round >= 0 else report.round


@dataclass(frozen=True)
class _Charged:
    """One training as a member's privacy reports give it."""

    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int

    @classmethod
    def of(cls, record: wire.ChargeRecord) -> _Charged:
        return cls(record.round, record.noise_multiplier, record.sample_rate, record.steps)

    def __str__(self) -> str:
        return (
            f"round {self.round} (noise {self.noise_multiplier:g}, sample rate "
            f"{self.sample_rate:g}, {self.steps} steps)"
        )


def _charge_key(index: int, trained_round: int) -> tuple[str, int]:
    """A charge's identity: its index in the member's ledger, or (reports that name
    none) the round it was trained for."""
    return ("charge", index) if index >= 0 else ("round", trained_round)


def _close(session: ServerSession, stage: str) -> None:
    if stage == "advertise":
        session.close_advertise()
    elif stage == "share_keys":
        session.close_share_keys()
    elif stage == "masked_input":
        session.close_masked_input()
    elif stage == "consistency":
        session.close_consistency()


def verify_log(
    log_path: Path,
    archive_dir: Path | None = None,
    models_root: Path | None = None,
    receipts: Iterable[Path] = (),
    aggregator_key: bytes | None = None,
    reader: tuple[bytes, bytes] | None = None,
) -> VerifyResult:
    """Verify a transparency log; see the module docstring for what is checked.

    ``reader``: (Ed25519 public key, X25519 secret) of a hidden models' recipient (the
    auditor), to re-derive the versions the aggregator cannot read.
    """
    archive = Archive(archive_dir) if archive_dir is not None else None
    return Verifier(archive, models_root, aggregator_key, reader).run(log_path, receipts)
