"""Each round's aggregate, re-derived from the archive by the attempt's mode, and the
model version it makes handed on to be re-derived.

Rounds pruned by retention are not re-run (:mod:`.retention` lists them); a round
whose rule's inputs the log does not hold entirely is listed in ``underived_rounds``.
"""

from __future__ import annotations

from typing import Any

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.attempts import Attempts
from fedsec.audit.verifier.models import Models
from fedsec.audit.verifier.retention import ArchiveRecords
from fedsec.protocol.log_entries import AggregateEntry


class Aggregates:
    """The aggregates checked so far."""

    def __init__(self, attempts: Attempts, records: ArchiveRecords, models: Models) -> None:
        self.attempts = attempts
        self.records = records
        self.models = models
        self.verified = 0  # rounds re-aggregated
        # trusted-mode rounds whose rule's inputs were checked but whose aggregate cannot
        # be re-derived: {"round", "attempt", "rule", "detail"}
        self.underived: list[dict[str, Any]] = []

    def on_aggregate(self, index: int, body: AggregateEntry) -> None:
        """Raises: EntryProblem, FedsecError: applied to another version than its spec
        names, or survivors or a sum the archive does not give."""
        attempt, mode = self.attempts.of(body)
        spec = attempt.spec
        if body.parent_version != spec.model_version:
            raise EntryProblem(
                f"round {spec.round} was applied to version {body.parent_version}, "
                f"but its signed spec names version {spec.model_version}"
            )
        mode.check_survivors(body)
        if self.records.archive is None:
            return
        if self.records.pruned(spec.round):
            self.models.sum_unknown(body)
            return  # listed in pruned_rounds when its archive_pruned entry is checked
        rederived = mode.rederive(index, body)
        if rederived.underived is not None:
            self.underived.append(rederived.underived)
            self.models.sum_unknown(body)
            return
        if rederived.sums is None:
            return  # a hidden model not opened: counted in hidden_unopened
        self.verified += 1
        if self.models.rederivable(body):
            self.models.rederive(body, spec, rederived.sums)
