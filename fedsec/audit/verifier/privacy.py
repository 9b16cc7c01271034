"""Privacy accounting: members' signed privacy reports and data summaries.

ε never decreases per member and dataset; each training is charged once, given one
way; the pure ε of noised data summaries is accounted; and the DP-SGD ε is
recomputed from the logged parameters with an independent accountant
(:mod:`fedsec.audit.accountant`) within :data:`EPSILON_TOLERANCE`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fedsec.audit import accountant
from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.identity import Identities
from fedsec.errors import PayloadError
from fedsec.protocol import wire

EPSILON_TOLERANCE = 0.01  # the bar: independent recomputation within 1%


@dataclass(frozen=True)
class Charged:
    """One training as a member's privacy reports give it."""

    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int

    @classmethod
    def of(cls, record: wire.ChargeRecord) -> Charged:
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


def _trained_round(report: wire.PrivacyReport) -> int:
    return report.trained_round if report.trained_round >= 0 else report.round


class Privacy:
    """Every member's reports and charges per dataset, and its noised counts."""

    def __init__(self, identities: Identities) -> None:
        self.identities = identities
        self.reports: dict[tuple[str, str], list[wire.PrivacyReport]] = defaultdict(list)
        # (member, dataset) -> every training charged, one entry per charge (_charge_key)
        self.charges: dict[tuple[str, str], dict[tuple[str, int], Charged]] = defaultdict(dict)
        # member -> epsilon of the noised counts of its logged data summaries
        self.noised_counts: dict[str, float] = {}
        self.checked = 0
        self.data_summaries = 0
        self.epsilon: dict[str, float] = {}  # member -> the ε it last reported

    def on_data_summary(self, body: wire.DataSummary) -> None:
        """The member's own statement about its data: its signature is checked, and
        noised counts must show up in its privacy reports' pure epsilon.

        Raises:
            FedsecError: not signed by an active member.
        """
        body.verify(self.identities.member_key(body.member))
        self.noised_counts[body.member] = (
            self.noised_counts.get(body.member, 0.0) + body.count_epsilon
        )
        self.data_summaries += 1

    def on_privacy_report(self, report: wire.PrivacyReport) -> None:
        """Raises: EntryProblem, FedsecError: unsigned, ε lowered, a charge given two
        ways, pure releases under-accounted, or ε the logged parameters do not give."""
        report.verify(self.identities.member_key(report.member))
        history = self.reports[(report.member, report.dataset_id)]
        if history and report.epsilon < history[-1].epsilon - 1e-9:
            raise EntryProblem(
                f"{report.member} reports epsilon {report.epsilon:.4f} on {report.dataset_id}, "
                f"less than the {history[-1].epsilon:.4f} it reported before"
            )
        try:
            report.check_charges()
        except PayloadError as exc:
            raise EntryProblem(exc.detail) from None
        charged = self._charged(report)
        noised = self.noised_counts.get(report.member, 0.0)
        if report.extra_epsilon < noised - 1e-9:
            raise EntryProblem(
                f"{report.member} accounts epsilon {report.extra_epsilon:.4f} for pure "
                f"releases, less than the {noised:.4f} of its logged noised data summaries"
            )
        if report.noise_multiplier:
            rounds = [(c.noise_multiplier, c.sample_rate, c.steps) for c in charged.values()]
            _check_epsilon(report, rounds)
        history.append(report)
        self.charges[(report.member, report.dataset_id)] = charged
        self.checked += 1
        self.epsilon[report.member] = report.epsilon

    def _charged(self, report: wire.PrivacyReport) -> dict[tuple[str, int], Charged]:
        """Every training charged once ``report`` is taken in (not stored yet).

        One entry per charge: a retried attempt, or a buffered member contributing an
        update trained earlier, reports the same training again; a charge whose own
        report never reached the log is declared by a later report.

        Raises:
            EntryProblem: a charge given otherwise than an earlier report gave it.
        """
        charged = dict(self.charges[(report.member, report.dataset_id)])
        own = Charged(
            _trained_round(report), report.noise_multiplier, report.sample_rate, report.steps
        )
        declared = [(_charge_key(c.index, -1), Charged.of(c)) for c in report.unreported]
        for key, charge in [*declared, (_charge_key(report.charge, own.round), own)]:
            # a charge is given one way only; a report naming no charge replaces the
            # last report of its round
            known = charged.get(key)
            if key[0] == "charge" and known is not None and known != charge:
                raise EntryProblem(
                    f"{report.member} gives charge {key[1]} on {report.dataset_id} as "
                    f"{charge}, but an earlier report gave it as {known}"
                )
            charged[key] = charge
        return charged


def _check_epsilon(report: wire.PrivacyReport, rounds: list[tuple[float, float, int]]) -> None:
    """The reported ε lies between the independent PLD and RDP values, within
    EPSILON_TOLERANCE (:mod:`fedsec.audit.accountant`).

    Raises:
        EntryProblem: it does not.
    """
    sgd = report.epsilon - report.extra_epsilon  # basic composition: the rest is DP-SGD's
    tight, loose = accountant.epsilon_range(rounds, report.delta)
    low, high = tight * (1 - EPSILON_TOLERANCE), loose * (1 + EPSILON_TOLERANCE)
    if not low <= sgd <= max(high, 1e-9):
        independent = tight if sgd < low else loose
        raise EntryProblem(
            f"{report.member} reports epsilon {sgd:.4f}"
            + (" for DP-SGD" if report.extra_epsilon else "")
            + f", but its logged DP parameters give {independent:.4f} (independent "
            "accountant)"
        )
