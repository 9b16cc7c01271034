"""Quarantine: a member the control-sample audit failed is suspended from future cohorts.

Three ways in, one outcome:

- an auditor posts a :class:`~fedsec.protocol.wire.QuarantineOrder` it signed, or one
  the federation's admin signed (``POST /audit/quarantine``);
- the operator drops an admin-signed order into the workspace's ``quarantine/``
  directory (``fedsec aggregator quarantine``), picked up at the next tick;
- with ``audit.quarantine_on_failure``, an auditor's failed verdict (``POST
  /audit/verdicts``) quarantines its member at once.

The outcome: a ``quarantine`` entry in the transparency log (who ordered it, the
member's first failed round, the failed checks, the model version to roll back to),
a ``member_quarantined`` alert that offers the rollback, a :class:`MemberQuarantined`
event, and from then on a 403 ``quarantined`` answer to the member's joins; a cohort no
longer waits for it.  The log is the record: a restarted aggregator rebuilds the set
from its ``quarantine`` entries.  An order is checked completely (federation, issuer's
signature, member, an accepted contribution in the named round) before anything
changes; one for a member already quarantined changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.aggregator.rounds.events import MemberQuarantined
from fedsec.aggregator.storage.interfaces import VerdictRow
from fedsec.errors import ForbiddenError, NotFound, PayloadError, Quarantined, SignatureError
from fedsec.protocol import wire
from fedsec.protocol.log import entry_from_line
from fedsec.protocol.log_entries import QuarantineEntry, kind_of

#: The workspace directory the operator's admin-signed orders are dropped into.
ORDERS_DIR: Final = "quarantine"
#: Largest order file read: an order is a dozen short fields and a reason of at most
#: 1,000 characters; 16 KiB bounds what a stray file there makes the aggregator read.
MAX_ORDER_BYTES: Final = 16 * 1024
#: The issuer name of an order signed with the federation's admin key.
ADMIN: Final = "admin"

# how a quarantine entry's kind reads in a canonical log line (no spaces, keys sorted)
_QUARANTINE_KIND: Final = b'"kind":"' + kind_of(QuarantineEntry).encode() + b'"'


def quarantine_detail(entry: QuarantineEntry) -> str:
    """The sentence a quarantined member's join is refused with."""
    failed = ", ".join(entry.failed) or "unspecified checks"
    why = f" ({entry.reason})" if entry.reason else ""
    return (
        f"{entry.member} is quarantined: the control-sample audit failed its contribution "
        f"to round {entry.round} attempt {entry.attempt} ({failed}), ordered by "
        f"{entry.issuer}{why}; it may not join any cohort: ask the consortium admin"
    )


class QuarantineDesk:
    """Who is quarantined; takes orders and failed verdicts.

    Args:
        ctx: the round engine's shared context; its ``quarantined`` map is kept here.
    """

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx
        self._orders_seen: dict[str, int] = {}  # order file name -> its mtime_ns when read
        for _, line in ctx.ws.state.log.log_lines():
            if _QUARANTINE_KIND in line:
                body = entry_from_line(line).decode()
                if isinstance(body, QuarantineEntry):
                    ctx.quarantined.setdefault(body.member, body)

    def check_join(self, member: str) -> None:
        """Raises Quarantined: ``member`` is quarantined."""
        entry = self._ctx.quarantined.get(member)
        if entry is not None:
            raise Quarantined(quarantine_detail(entry))

    # -- orders ----------------------------------------------------------------------------------

    def order(self, caller: str | None, order: wire.QuarantineOrder) -> wire.QuarantineAnswer:
        """Carry out a signed quarantine order.

        Args:
            caller: the auditor that posted it (None: the operator's ``quarantine/``
                directory, where only admin orders count).
            order: the order.

        Returns:
            What became of it; ``quarantined`` False when the member already was.

        Raises:
            ForbiddenError: another federation's order, or an issuer that is neither
                the admin nor the calling auditor.
            SignatureError: the signature does not verify under the issuer's key.
            NotFound: the member is not an agent of the roster, or holds no accepted
                contribution to the named round attempt.
        """
        ctx = self._ctx
        if order.federation_id != ctx.ws.federation_id:
            raise ForbiddenError(
                f"quarantine order for federation {order.federation_id!r}, this is "
                f"{ctx.ws.federation_id!r}"
            )
        order.verify(self._issuer_key(caller, order.issuer))
        self._check_member(order.member, order.round, order.attempt)
        existing = ctx.quarantined.get(order.member)
        if existing is not None:
            return self._answer(existing, False)
        entry = self._entry(
            order.member,
            order.round,
            order.attempt,
            order.issuer,
            order.failed,
            order.reason,
            order,
        )
        return self._answer(self._apply(entry), True)

    def _issuer_key(self, caller: str | None, issuer: str) -> bytes:
        ws = self._ctx.ws
        if issuer == ADMIN:
            return ws.admin_public
        entry = ws.roster.get(issuer)
        if caller is None or issuer != caller or entry is None or entry.role != "auditor":
            raise ForbiddenError(
                f"a quarantine order is signed by the admin or by the auditor who posts it; "
                f"this one names issuer {issuer!r}"
                + ("" if caller is None else f" and was posted by {caller}")
            )
        return entry.public_key_bytes

    def _check_member(self, member: str, round_: int, attempt: int) -> None:
        ws = self._ctx.ws
        entry = ws.roster.get(member)
        if entry is None or entry.role != "agent":
            raise NotFound(f"quarantine of {member}, who is not an agent of the roster")
        if not ws.state.receipts.has(round_, attempt, member):
            raise NotFound(
                f"quarantine of {member} for round {round_} attempt {attempt}, to which it "
                "made no accepted contribution"
            )

    # -- verdicts (audit.quarantine_on_failure) --------------------------------------------------

    def failed_verdicts(
        self, auditor: str, verdicts: Iterable[wire.AuditVerdict]
    ) -> list[wire.QuarantineAnswer]:
        """With ``audit.quarantine_on_failure``: quarantine each member an auditor's
        (already stored) verdicts failed, unless it already is; otherwise nothing."""
        if not self._ctx.cfg.audit.quarantine_on_failure:
            return []
        answers = []
        for v in sorted(verdicts, key=lambda v: (v.round, v.attempt)):
            if v.passed or v.member in self._ctx.quarantined:
                continue
            self._check_member(v.member, v.round, v.attempt)
            entry = self._entry(
                v.member, v.round, v.attempt, auditor, v.failed, "failed verdict", None
            )
            answers.append(self._answer(self._apply(entry), True))
        return answers

    # -- the operator's directory ----------------------------------------------------------------

    def poll_orders(self) -> None:
        """Carry out the admin orders newly dropped into ``quarantine/`` (each file read
        once per change); one that does not check out is logged and left there."""
        folder = self._ctx.ws.root / ORDERS_DIR
        try:
            files = sorted(folder.glob("*.json"))
        except OSError:
            return
        for path in files:
            try:
                stamp = path.stat().st_mtime_ns
            except OSError:
                continue
            if self._orders_seen.get(path.name) == stamp:
                continue
            self._orders_seen[path.name] = stamp
            try:
                answer = self.order(None, _read_order(path))
            except (PayloadError, SignatureError, ForbiddenError, NotFound) as exc:
                log.warning("event=quarantine_order_refused file=%s reason=%r", path, exc.detail)
                continue
            log.info("event=quarantine_order file=%s detail=%r", path, answer.detail)

    # -- the outcome -----------------------------------------------------------------------------

    def _entry(
        self,
        member: str,
        round_: int,
        attempt: int,
        issuer: str,
        failed: Iterable[str],
        reason: str,
        order: wire.QuarantineOrder | None,
    ) -> QuarantineEntry:
        """The log entry: its round is the member's first failed one (the named round,
        or an earlier one an auditor's stored verdict failed), and the rollback offered
        is to the version that round started from."""
        first = (round_, attempt)
        for row in self._ctx.ws.state.verdicts.by_member().get(member, []):
            if not row.passed and (row.round, row.attempt) < first:
                first = (row.round, row.attempt)
                failed = _failed_checks(row)
        return QuarantineEntry(
            member=member,
            round=first[0],
            attempt=first[1],
            issuer=issuer,
            failed=sorted(set(failed)),
            reason=reason,
            rollback_to=self._version_before(*first),
            order=order,
        )

    def _version_before(self, round_: int, attempt: int) -> int:
        """The model version ``round_``.``attempt`` started from (its spec's)."""
        row = self._ctx.ws.state.rounds.get(round_, attempt)
        if row is None or row.spec is None:
            raise NotFound(f"round {round_} attempt {attempt} has no round spec")
        return msgspec.json.decode(row.spec, type=wire.RoundSpec).model_version

    def _apply(self, entry: QuarantineEntry) -> QuarantineEntry:
        ctx = self._ctx
        ctx.trail.append(entry)
        ctx.quarantined[entry.member] = entry
        log.warning(
            "event=member_quarantined member=%s round=%d attempt=%d issuer=%s rollback_to=%d",
            entry.member,
            entry.round,
            entry.attempt,
            entry.issuer,
            entry.rollback_to,
        )
        ctx.alert(
            "member_quarantined",
            f"member {entry.member}",
            f"{entry.member} is quarantined from future cohorts ({entry.issuer}): the "
            f"control-sample audit failed its contribution to round {entry.round} attempt "
            f"{entry.attempt} ({', '.join(entry.failed) or 'unspecified checks'}); version "
            f"{entry.rollback_to} is the last model before it: roll back with `fedsec "
            f"aggregator rollback --workspace … --to {entry.rollback_to}`",
        )
        ctx.emit(
            MemberQuarantined(
                entry.member, entry.round, entry.attempt, entry.issuer, entry.rollback_to
            )
        )
        ctx.changed()
        return entry

    def _answer(self, entry: QuarantineEntry, new: bool) -> wire.QuarantineAnswer:
        already = "" if new else "already "
        return wire.QuarantineAnswer(
            member=entry.member,
            quarantined=new,
            since_round=entry.round,
            rollback_to=entry.rollback_to,
            detail=(
                f"{entry.member} is {already}quarantined since round {entry.round} "
                f"(ordered by {entry.issuer}); the last model before it is version "
                f"{entry.rollback_to}: `fedsec aggregator rollback --to {entry.rollback_to}`"
            ),
        )


def _failed_checks(row: VerdictRow) -> list[str]:
    return [name for name in row.failed.split(",") if name]


def _read_order(path: Path) -> wire.QuarantineOrder:
    """Raises PayloadError: unreadable, too large, or not an order."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_ORDER_BYTES + 1)
    except OSError as exc:
        raise PayloadError(f"quarantine order {path} cannot be read: {exc}") from None
    if len(raw) > MAX_ORDER_BYTES:
        raise PayloadError(f"quarantine order {path} is over {MAX_ORDER_BYTES} bytes")
    return wire.decode(raw, wire.QuarantineOrder, max_bytes=MAX_ORDER_BYTES, what="order")
