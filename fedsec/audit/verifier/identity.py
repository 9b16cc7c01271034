"""Who may sign what: the genesis keys, signed heads, the roster as it stood at each
point of the log, and quarantine orders."""

from __future__ import annotations

from fedsec.audit.verifier import EntryProblem
from fedsec.errors import SignatureError
from fedsec.protocol import wire
from fedsec.protocol.log import LogEntry, verify_head
from fedsec.protocol.log_entries import GenesisEntry, HeadEntry, QuarantineEntry
from fedsec.protocol.roster import RosterEntry, verify_roster_entry


class Identities:
    """The federation's keys and roster, as the log has set them so far.

    Every signature other than the roster's own is checked against the roster *at
    that point of the log*: a key added later, or revoked earlier, does not count.
    """

    def __init__(self, pinned_key: bytes | None = None) -> None:
        self.pinned_key = pinned_key  # the aggregator key the auditor was told to expect
        self.genesis: GenesisEntry | None = None
        self.federation_id = ""
        self.aggregator_key = b""
        self.admin_key = b""
        self.roster: dict[str, RosterEntry] = {}
        self.heads = 0

    def on_genesis(self, body: GenesisEntry) -> None:
        """Raises: EntryProblem: it names an aggregator key other than the pinned one."""
        self.genesis = body
        self.federation_id = body.federation_id
        self.aggregator_key = bytes.fromhex(body.aggregator_public_key)
        self.admin_key = bytes.fromhex(body.admin_public_key)
        if self.pinned_key is not None and self.pinned_key != self.aggregator_key:
            raise EntryProblem("genesis names an aggregator key other than the pinned one")

    def on_head(self, head: HeadEntry, signed: LogEntry) -> None:
        """Raises: IntegrityError: the head does not sign ``signed``, the entry before it."""
        verify_head(head, self.aggregator_key, signed)
        self.heads += 1

    def on_roster(self, roster_entry: RosterEntry) -> None:
        """Raises: FedsecError: not signed by the admin key for this federation."""
        verify_roster_entry(roster_entry, self.admin_key, self.federation_id)
        self.roster[roster_entry.agent_id] = roster_entry

    @property
    def min_agents(self) -> int:
        """The federation's ``round.min_agents`` (the genesis entry is checked first)."""
        assert self.genesis is not None
        return int(self.genesis.round.get("min_agents", 1))

    def member_key(self, member: str) -> bytes:
        """Raises: EntryProblem: ``member`` is not an active roster member here."""
        known = self.roster.get(member)
        if known is None or not known.is_active:
            raise EntryProblem(f"{member} is not an active roster member at this point")
        return known.public_key_bytes

    def custodian_key(self, custodian: str) -> bytes:
        """The roster key of ``custodian``, an active member of role custodian here.

        Raises:
            EntryProblem: not active here, or of another role.
        """
        key = self.member_key(custodian)
        known = self.roster[custodian]
        if known.role != "custodian":
            raise EntryProblem(f"{custodian} has roster role {known.role}, not custodian")
        return key

    def verify_custodian(
        self, statement: wire.HeContextStatement | wire.DecryptionStatement, what: str
    ) -> None:
        """Raises: EntryProblem: another federation's, or not signed by its custodian."""
        if statement.federation_id != self.federation_id:
            raise EntryProblem(f"{what} of federation {statement.federation_id}")
        known = self.roster.get(statement.custodian)
        key = self.custodian_key(statement.custodian)
        try:
            statement.verify(key)
        except SignatureError:
            key_id = known.key_id if known is not None else "?"
            raise EntryProblem(
                f"the signature of {what} does not verify under custodian "
                f"{statement.custodian}'s roster key {key_id} (forged, or altered after signing)"
            ) from None

    def reader_member(self, public: bytes) -> str | None:
        """The active roster member whose key is ``public``, if any."""
        return next(
            (m for m, e in self.roster.items() if e.public_key_bytes == public and e.is_active),
            None,
        )

    def on_quarantine(self, body: QuarantineEntry) -> None:
        """A quarantine carried out on an order: the order is the named member's, of
        this federation, signed by the admin or by the auditor it names.

        Raises:
            EntryProblem, SignatureError: the order does not hold.
        """
        order = body.order
        if order is None:
            return  # on an auditor's failed verdict (audit.quarantine_on_failure)
        if (order.federation_id, order.member, order.issuer) != (
            self.federation_id,
            body.member,
            body.issuer,
        ):
            raise EntryProblem("the order names another federation, member or issuer")
        key = self.admin_key if order.issuer == "admin" else self.member_key(order.issuer)
        order.verify(key)
