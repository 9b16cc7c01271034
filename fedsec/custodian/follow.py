"""The custodian's view of the transparency log, read incrementally and verified as read.

:class:`LogFollower` takes the log's lines as the aggregator serves them, in as many
pieces as it likes, and keeps what the custodian's check needs: the genesis (the
federation's ``min_agents``), the roster, the ``he_context`` statements, the signed round
specs, the ciphertext commitments and accepted masked inputs of every attempt (each
member's commitment and contribution statement checked against its admin-signed roster
key as of that point of the log, the statement with the digest of the attempt's
commitments logged before it), the attempts already closed, and the decryption
statements.

Every line must chain to the one before it, across calls (the follower remembers the last
hash, so a line it has seen cannot be served differently later), and every ``head``
must be signed by the aggregator key the custodian pinned.  A break is final: the first
:class:`~fedsec.errors.IntegrityError` poisons the follower, and every later call raises
it again, because nothing the aggregator says afterwards can be trusted.

An accepted entry that cannot be a member's genuine contribution (no spec, a member
outside the cohort or the roster, a statement that does not verify) is not a break of the
log: it is recorded with what is wrong with it, so that the check refuses an offer
counting it, and the custodian keeps serving the other rounds.

Sans-I/O: no file, no socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

from fedsec.errors import FedsecError, IntegrityError, SignatureError
from fedsec.protocol.log import GENESIS_PREV, LogEntry, parse_line, verify_head
from fedsec.protocol.log_entries import (
    AcceptedEntry,
    AggregateEntry,
    GenesisEntry,
    HeadEntry,
    RoundAbortedEntry,
)
from fedsec.protocol.roster import RosterEntry, verify_roster_entry
from fedsec.protocol.wire import (
    CiphertextCommitment,
    ContributionStatement,
    DecryptionStatement,
    HeContextStatement,
    RoundSpec,
    commitments_digest,
)
from fedsec.summation import mode_of

__all__ = ["LogFollower", "LoggedCommitment", "LoggedContribution", "Problem"]

#: Why an accepted entry cannot be counted: a member the round does not know, a
#: statement (or commitment) its member did not sign (with, in he, the commitments
#: logged before it), or a homomorphic contribution that is not the ciphertext its
#: member committed to.
Problem = Literal["unknown_contributor", "forged_contribution", "not_committed"]
# A line still waiting for its newline across calls is a line: bounded like one.
_MAX_PENDING_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class LoggedContribution:
    """An accepted masked input of one attempt, as the log records it."""

    index: int  # the log entry's index
    member: str
    sha256: str  # of the uploaded (framed ciphertext) body: the archive object's name
    bytes: int
    problem: Problem | None = None
    detail: str = ""
    # he: the digest of the attempt's commitments logged before it, which its statement binds
    commitments_sha256: str = ""


@dataclass(frozen=True, slots=True)
class LoggedCommitment:
    """A member's signed commitment to its ciphertext's hash (he stage commit)."""

    index: int
    member: str
    vector_sha256: str
    problem: Problem | None = None
    detail: str = ""


def custodian_decrypts(spec: RoundSpec) -> bool:
    """Whether ``spec``'s mode has a key custodian decrypt its sums (and its members bind
    the attempt's commitment set into their statements); False for an unknown mode."""
    try:
        return mode_of(spec).custodian_decrypts
    except FedsecError:
        return False


class LogFollower:
    """The verified log, fed line by line (see the module docstring).

    Args:
        federation_id: the federation the custodian serves; the genesis must name it.
        aggregator_public_key: the aggregator's Ed25519 key the custodian pins; the
            genesis must name it and every head must verify under it.
        admin_public_key: the consortium admin's key, when the custodian pins it too
            (else the genesis's is taken): roster entries must verify under it.
        source: how error messages name the log.
    """

    def __init__(
        self,
        federation_id: str,
        aggregator_public_key: bytes,
        *,
        admin_public_key: bytes | None = None,
        source: str = "the aggregator's log",
    ) -> None:
        self.federation_id = federation_id
        self._aggregator = bytes(aggregator_public_key)
        self._admin_pin = admin_public_key
        self._source = source
        self._pending = b""
        self._last: LogEntry | None = None
        self.broken: IntegrityError | None = None
        self.genesis: GenesisEntry | None = None
        self.roster: dict[str, RosterEntry] = {}
        self.contexts: list[HeContextStatement] = []
        self.specs: dict[tuple[int, int], RoundSpec] = {}
        self.accepted: dict[tuple[int, int], list[LoggedContribution]] = {}
        self.commitments: dict[tuple[int, int], list[LoggedCommitment]] = {}
        self.closed: dict[tuple[int, int], str] = {}  # attempt -> the kind that closed it
        self.decryptions: dict[tuple[int, int], DecryptionStatement] = {}
        self.last_head = -1

    # -- reading ---------------------------------------------------------------------------

    @property
    def next_index(self) -> int:
        """Entries read so far: the index the next line must carry."""
        return 0 if self._last is None else self._last.index + 1

    def feed(self, data: bytes) -> int:
        """Read the log lines in ``data`` (a trailing partial line waits for the next call).

        Returns:
            How many entries were read.

        Raises:
            IntegrityError: a line that is malformed, out of order, unchained, or a head
                the pinned key did not sign; or one raised earlier (the follower stays
                broken).  Entries before the bad line are kept; the bad line changes
                nothing.
        """
        if self.broken is not None:
            raise self.broken
        buffer = self._pending + data
        *complete, rest = buffer.split(b"\n")
        if len(rest) > _MAX_PENDING_BYTES:
            self._break(f"{self._source}: a line of more than {_MAX_PENDING_BYTES} bytes")
        self._pending = rest
        for raw in complete:
            self._read(raw)
        return len(complete)

    def _break(self, detail: str) -> None:
        self.broken = IntegrityError(detail)
        raise self.broken

    def _read(self, raw: bytes) -> None:
        index = self.next_index
        try:
            entry = parse_line(raw, index + 1, self._source)
            where = f"{self._source}, entry {index} ({entry.kind})"
            if entry.index != index:
                raise IntegrityError(
                    f"{where}: carries index {entry.index} (an entry was deleted, inserted "
                    "or reordered)"
                )
            expected = GENESIS_PREV if self._last is None else self._last.hash
            if entry.prev != expected:
                raise IntegrityError(
                    f"{where}: does not chain to the entry before it (an earlier entry was "
                    "altered, or the log was rewritten since it was last read)"
                )
            self._apply(entry, where)
        except IntegrityError as exc:
            self._break(exc.detail)
        self._last = entry

    # -- what each kind tells ------------------------------------------------------------------

    def _apply(self, entry: LogEntry, where: str) -> None:
        """Check ``entry`` against everything read before it, then keep what it says.

        Raises:
            IntegrityError: the entry breaks a rule of the log (nothing is kept).
        """
        body = entry.decode()
        if (entry.index == 0) != isinstance(body, GenesisEntry):
            raise IntegrityError(f"{where}: the genesis entry must be entry 0, and only it")
        try:
            if isinstance(body, GenesisEntry):
                self._on_genesis(body, where)
            elif isinstance(body, HeadEntry):
                self._on_head(body, where)
            elif isinstance(body, RosterEntry):
                verify_roster_entry(body, self._admin_key(), self.federation_id)
                self.roster[body.agent_id] = body
            elif isinstance(body, RoundSpec):
                self._on_spec(body, where)
            elif isinstance(body, AcceptedEntry):
                self._on_accepted(entry.index, body)
            elif isinstance(body, RoundAbortedEntry | AggregateEntry):
                self.closed.setdefault((body.round, body.attempt), entry.kind)
            elif isinstance(body, HeContextStatement):
                self.contexts.append(body)
            elif isinstance(body, DecryptionStatement):
                self.decryptions[(body.round, body.attempt)] = body
        except SignatureError as exc:
            raise IntegrityError(f"{where}: {exc.detail}") from None

    def _on_genesis(self, body: GenesisEntry, where: str) -> None:
        if body.federation_id != self.federation_id:
            raise IntegrityError(
                f"{where}: the log is federation {body.federation_id!r}, not {self.federation_id!r}"
            )
        if body.aggregator_public_key != self._aggregator.hex():
            raise IntegrityError(f"{where}: names an aggregator key other than the pinned one")
        if self._admin_pin is not None and body.admin_public_key != self._admin_pin.hex():
            raise IntegrityError(f"{where}: names an admin key other than the pinned one")
        self.genesis = body

    def _admin_key(self) -> bytes:
        assert self.genesis is not None  # entry 0, checked first
        return bytes.fromhex(self.genesis.admin_public_key)

    def _on_head(self, head: HeadEntry, where: str) -> None:
        assert self._last is not None  # a head is never entry 0
        if head.federation_id != self.federation_id:
            raise IntegrityError(f"{where}: signs federation {head.federation_id!r}")
        try:
            verify_head(head, self._aggregator, self._last)
        except IntegrityError as exc:
            raise IntegrityError(f"{where}: {exc.detail}") from None
        self.last_head = self._last.index + 1

    def _on_spec(self, spec: RoundSpec, where: str) -> None:
        try:
            spec.verify(self._aggregator)
        except FedsecError:
            raise IntegrityError(
                f"{where}: round {spec.round} attempt {spec.attempt}'s spec is not signed by "
                "the pinned aggregator key"
            ) from None
        if spec.federation_id != self.federation_id:
            raise IntegrityError(f"{where}: a spec of federation {spec.federation_id!r}")
        self.specs[(spec.round, spec.attempt)] = spec

    def _on_accepted(self, index: int, body: AcceptedEntry) -> None:
        key = (body.round, body.attempt)
        if body.stage == "commit":
            problem, detail = self._commitment_problem(body)
            committed = LoggedCommitment(index, body.member, body.commitment or "", problem, detail)
            self.commitments.setdefault(key, []).append(committed)
            return
        if body.stage != "masked_input":
            return
        spec = self.specs.get(key)
        bound = ""
        if spec is not None and custodian_decrypts(spec):
            bound = commitments_digest(
                (c.member, c.vector_sha256) for c in self.commitments.get(key, ())
            )
        problem, detail = self._contribution_problem(body, bound)
        logged = LoggedContribution(
            index, body.member, body.sha256, body.bytes, problem, detail, bound
        )
        self.accepted.setdefault(key, []).append(logged)

    def _member_problem(self, body: AcceptedEntry) -> tuple[Problem | None, str]:
        """What makes ``body``'s member one that cannot send it."""
        spec = self.specs.get((body.round, body.attempt))
        member = self.roster.get(body.member)
        if spec is None:
            return "unknown_contributor", "no signed spec of the attempt precedes it"
        if body.member not in spec.cohort:
            return "unknown_contributor", f"{body.member} is not in the attempt's cohort"
        if member is None or not member.is_active or member.role != "agent":
            return "unknown_contributor", f"{body.member} is not an active agent of the roster"
        if body.commitment is None or body.signature is None:
            return "forged_contribution", f"{body.member}'s entry carries no signed statement"
        return None, ""

    def _commitment_problem(self, body: AcceptedEntry) -> tuple[Problem | None, str]:
        """What makes ``body`` something other than its member's signed commitment."""
        problem, detail = self._member_problem(body)
        if problem is not None:
            return problem, detail
        assert body.commitment is not None and body.signature is not None
        try:
            CiphertextCommitment(
                federation_id=self.federation_id,
                round=body.round,
                attempt=body.attempt,
                member=body.member,
                vector_sha256=body.commitment,
                signature=body.signature,
            ).verify(self.roster[body.member].public_key_bytes)
        except FedsecError:
            return "forged_contribution", (
                f"{body.member}'s ciphertext commitment does not verify under its roster key"
            )
        return None, ""

    def _contribution_problem(self, body: AcceptedEntry, bound: str) -> tuple[Problem | None, str]:
        """What makes ``body`` something other than its member's genuine contribution
        (``bound``: he, the digest of the commitments logged before it)."""
        problem, detail = self._member_problem(body)
        if problem is not None:
            return problem, detail
        assert body.commitment is not None and body.signature is not None
        member = self.roster[body.member]
        if bound:
            problem, detail = self._committed(body)
            if problem is not None:
                return problem, detail
        statement = ContributionStatement(
            federation_id=self.federation_id,
            round=body.round,
            attempt=body.attempt,
            member=body.member,
            vector_sha256=body.sha256,
            commitment=body.commitment,
            signature=body.signature,
            commitments_sha256=bound,
        )
        try:
            statement.verify(member.public_key_bytes)
        except FedsecError:
            shown = (
                f", binding the commitment set logged before it ({bound[:16]}…)" if bound else ""
            )
            return "forged_contribution", (
                f"{body.member}'s contribution statement does not verify under its roster "
                f"key{shown}: not its statement, or it was shown another set"
            )
        return None, ""

    def _committed(self, body: AcceptedEntry) -> tuple[Problem | None, str]:
        """he: ``body``'s ciphertext is the one its member committed to, before it."""
        mine = [
            c
            for c in self.commitments.get((body.round, body.attempt), ())
            if c.member == body.member
        ]
        if len(mine) != 1 or mine[0].problem is not None:
            return "not_committed", (
                f"no signed commitment of {body.member} to its ciphertext precedes it"
            )
        if mine[0].vector_sha256 != body.sha256:
            return "not_committed", (
                f"{body.member}'s ciphertext {body.sha256[:16]}… is not the one it committed to "
                f"(log entry {mine[0].index})"
            )
        return None, ""

    # -- what the check asks -------------------------------------------------------------------

    @property
    def min_agents(self) -> int:
        """The genesis's ``round.min_agents`` (0 when it names none or no genesis is read)."""
        if self.genesis is None:
            return 0
        value: Any = self.genesis.round.get("min_agents", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def contributions(self, round: int, attempt: int, below: int) -> Iterator[LoggedContribution]:
        """The attempt's accepted masked inputs logged before entry ``below``."""
        return (c for c in self.accepted.get((round, attempt), ()) if c.index < below)

    def commitments_of(self, round: int, attempt: int, below: int) -> list[LoggedCommitment]:
        """The attempt's ciphertext commitments logged before entry ``below``."""
        return [c for c in self.commitments.get((round, attempt), ()) if c.index < below]
