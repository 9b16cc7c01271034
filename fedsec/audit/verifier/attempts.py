"""Round attempts: the signed spec, the messages accepted under it, and the receipts
members hold for them.

What a summation mode adds to these checks (the homomorphic mode's commitments and
the custodian's decryption) is the attempt's :class:`ModeAudit`, chosen by the
dispatcher from :data:`fedsec.audit.verifier.modes.AUDITS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.identity import Identities
from fedsec.audit.verifier.retention import ArchiveRecords
from fedsec.errors import FedsecError
from fedsec.protocol import wire
from fedsec.protocol.log_entries import AcceptedEntry, AggregateEntry

if TYPE_CHECKING:
    from fedsec.audit.verifier.homomorphic import HeContexts
    from fedsec.audit.verifier.models import Models


@dataclass
class Attempt:
    """One round attempt as the log has recorded it so far."""

    spec: wire.RoundSpec
    messages: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, member, sha)
    # accepted masked inputs: (log index, member, sha256)
    inputs: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"round {self.spec.round} attempt {self.spec.attempt}"


@dataclass(frozen=True)
class Rederived:
    """What re-deriving an attempt's aggregate from the archive gave.

    ``sums``: (Σ w·Δ, Σ w), the model's input; None when the aggregate was checked but
    the model cannot be re-derived here (a hidden model no key here opens).
    ``underived``: set instead when the rule's inputs were checked but the aggregate
    itself cannot be re-derived (FLTrust): ``{"round", "attempt", "rule", "detail"}``.
    """

    sums: Any = None
    underived: dict[str, Any] | None = None


@dataclass(frozen=True)
class Consulted:
    """The checkers a mode's audit consults: their state is theirs, read through them."""

    identities: Identities
    records: ArchiveRecords
    contexts: HeContexts
    models: Models


class ModeAudit:
    """What an attempt's summation mode adds to the checks.  This base is a mode whose
    log holds no entries of its own; subclasses say how the aggregate is re-derived."""

    def __init__(self, attempt: Attempt, consulted: Consulted) -> None:
        self.attempt = attempt
        self.consulted = consulted

    def own_message(self, index: int, body: AcceptedEntry) -> bool:
        """Take an accepted message that is the mode's own rather than a cohort
        member's; False when it is a member's (checked as such)."""
        return False

    def on_message(self, body: AcceptedEntry, public: bytes) -> None:
        """A cohort member's accepted message, archived and signed by ``public``."""

    def binding(self, member: str, digest: str) -> str:
        """What a masked input's contribution statement binds beyond its own hash."""
        return ""

    def on_decryption(self, index: int, statement: wire.DecryptionStatement) -> None:
        """Raises: EntryProblem: only a homomorphic round is decrypted."""
        spec = self.attempt.spec
        raise EntryProblem(
            f"{self.attempt.where} is a secure_sum = {spec.secure_sum} round; nothing is decrypted"
        )

    def check_survivors(self, body: AggregateEntry) -> None:
        """What the aggregate's survivors must agree with before any archive is read."""

    def rederive(self, index: int, body: AggregateEntry) -> Rederived:
        """Re-derive the aggregate from the archive and compare it with ``body``.

        Raises:
            EntryProblem: the archive gives other survivors or another sum.
        """
        raise NotImplementedError


class Attempts:
    """Every attempt's spec and accepted messages; the contributions receipts name."""

    def __init__(
        self,
        identities: Identities,
        records: ArchiveRecords,
        open_mode: Callable[[Attempt], ModeAudit],
    ) -> None:
        self.identities = identities
        self.records = records
        self.open_mode = open_mode
        self.attempts: dict[tuple[int, int], tuple[Attempt, ModeAudit]] = {}
        self.contributions: dict[int, AcceptedEntry] = {}  # log index -> accepted masked input
        self.receipts_checked = 0

    def on_round_spec(self, spec: wire.RoundSpec) -> None:
        """Raises: FedsecError: not the aggregator's, another federation's, or a cohort
        member not active here."""
        spec.verify(self.identities.aggregator_key)
        if spec.federation_id != self.identities.federation_id:
            raise EntryProblem(f"spec of federation {spec.federation_id}")
        for member in spec.cohort:
            self.identities.member_key(member)
        attempt = Attempt(spec)
        self.attempts[(spec.round, spec.attempt)] = (attempt, self.open_mode(attempt))

    def of(
        self, body: AcceptedEntry | AggregateEntry | wire.DecryptionStatement
    ) -> tuple[Attempt, ModeAudit]:
        """Raises: EntryProblem: no signed spec of the attempt precedes ``body``."""
        key = (body.round, body.attempt)
        if key not in self.attempts:
            raise EntryProblem(f"round {key[0]} attempt {key[1]} has no signed spec before it")
        return self.attempts[key]

    def on_accepted(self, index: int, body: AcceptedEntry) -> None:
        """Raises: EntryProblem, FedsecError: a stranger's, unarchived, or a masked input
        without a valid contribution statement."""
        attempt, mode = self.of(body)
        if mode.own_message(index, body):
            return
        member, stage, digest = body.member, body.stage, body.sha256
        spec = attempt.spec
        if member not in spec.cohort:
            raise EntryProblem(f"{member} is not in the cohort of this round")
        public = self.identities.member_key(member)
        if self.records.archive is not None:
            self.records.check(index, spec.round, f"{stage} from {member}", digest)
        mode.on_message(body, public)
        if stage == "masked_input":
            if body.commitment is None or body.signature is None:
                raise EntryProblem("a masked input without its contribution statement")
            wire.ContributionStatement(
                federation_id=self.identities.federation_id,
                round=spec.round,
                attempt=spec.attempt,
                member=member,
                vector_sha256=digest,
                commitment=body.commitment,
                signature=body.signature,
                commitments_sha256=mode.binding(member, digest),
            ).verify(public)
            self.contributions[index] = body
            attempt.inputs.append((index, member, digest))
        attempt.messages.append((stage, member, digest))

    def check_receipt(self, path: Path) -> None:
        """A receipt presented: signed by the aggregator, naming a logged contribution.

        Raises:
            EntryProblem: unreadable, not the aggregator's, or naming no such contribution.
        """
        try:
            receipt = msgspec.json.decode(path.read_bytes(), type=wire.Receipt)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EntryProblem(f"receipt {path}: unreadable ({exc})") from None
        try:
            receipt.verify(self.identities.aggregator_key)
        except FedsecError:
            raise EntryProblem(
                f"receipt {path}: not signed by the federation's aggregator key"
            ) from None
        logged = self.contributions.get(receipt.log_index)
        if logged is None:
            raise EntryProblem(
                f"receipt {path}: log entry {receipt.log_index} is not an accepted contribution "
                "(the contribution was dropped from the log)"
            )
        if (logged.member, logged.round, logged.attempt) != (
            receipt.member,
            receipt.round,
            receipt.attempt,
        ) or logged.sha256 != receipt.contribution_sha256:
            raise EntryProblem(
                f"receipt {path}: log entry {receipt.log_index} records a different contribution"
            )
        self.receipts_checked += 1
