"""Members' signed privacy reports (ε spent), one per member and attempt, taken in any
stage after open, alone or with the member's shares."""

from __future__ import annotations

import math

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import RoundContext
from fedsec.aggregator.rounds.events import PrivacyReported
from fedsec.errors import PayloadError, WrongStage
from fedsec.protocol import wire


def check_report(
    report: wire.PrivacyReport, federation_id: str, member: str, round_: int, attempt: int
) -> None:
    """What a privacy report must say to be ``member``'s for that attempt, whichever
    process takes it (the leader, or a group server: :mod:`fedsec.aggregator.groups`);
    its signature is checked next, by the caller, against the member's roster key.

    Raises:
        PayloadError: the report names another member, round or federation, an ε that
            is not a finite number >= 0, or earlier charges it cannot declare
            (:meth:`~fedsec.protocol.wire.PrivacyReport.check_charges`).
    """
    if (report.member, report.round, report.attempt, report.federation_id) != (
        member,
        round_,
        attempt,
        federation_id,
    ):
        raise PayloadError(f"{member}: privacy report names another member, round or federation")
    if not (math.isfinite(report.epsilon) and report.epsilon >= 0):
        raise PayloadError(f"{member}: privacy report epsilon must be a finite number >= 0")
    report.check_charges()


class PrivacyReports:
    """Checks and stores privacy reports."""

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx

    def check(
        self, live: Attempt, member: str, round_: int, attempt: int, report: wire.PrivacyReport
    ) -> bytes | None:
        """Validate a privacy report without changing anything; return its encoding, or
        None when the same report is already stored.

        Raises:
            WrongStage: the attempt is not in progress (or has no cohort yet).
            UnknownMember: ``member`` is not in the cohort.
            PayloadError: the report names another member, round or federation, an
                ε that is not a finite number >= 0, or earlier charges it cannot declare
                (:meth:`~fedsec.protocol.wire.PrivacyReport.check_charges`).
            SignatureError: the report's signature is not the member's.
            DuplicateMessage: a different report is stored for this attempt.
        """
        ws = self._ctx.ws
        if not live.is_current(round_, attempt) or live.spec is None:
            raise WrongStage(f"{member}: privacy report for a round that is not in progress")
        live.in_cohort(member)
        check_report(report, ws.federation_id, member, round_, attempt)
        return self._ctx.signed_once(
            member,
            report,
            lambda: ws.state.reports.get(round_, attempt, member),
            f"{member} already reported a different epsilon this round",
        )

    def store(self, report: wire.PrivacyReport, body: bytes) -> None:
        """Store a checked report and log it, in one transaction."""
        ctx = self._ctx
        with ctx.ws.state.transaction():
            ctx.ws.state.reports.add(
                report.round, report.attempt, report.member, report.epsilon, body
            )
            ctx.trail.append(report)
        ctx.emit(privacy_reported(report))


def privacy_reported(report: wire.PrivacyReport) -> PrivacyReported:
    """The event of a stored report (the leader's own, or one a group server stored)."""
    budget = report.epsilon_budget if report.epsilon_budget > 0 else None
    return PrivacyReported(report.round, report.attempt, report.member, report.epsilon, budget)
