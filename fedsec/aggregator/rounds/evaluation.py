"""Federated evaluation: members' signed metric reports on the model a round produced,
validated completely before one is stored, pooled into the federation's value.

A report is taken for a closed attempt whose cohort named the member, for the model
version that attempt produced, once per member (the same report again is idempotent, a
different one a 409). Reports are kept, signed, as messages of stage ``evaluation`` of
their attempt (its ``UNIQUE (round, attempt, stage, member)`` makes "one per member"
the store's rule too); they change no model and no privacy ledger, so they are not
entries of the transparency log.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import msgspec

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.aggregator.rounds.events import ModelEvaluated
from fedsec.aggregator.storage.interfaces import RoundRow
from fedsec.errors import PayloadError, UnknownMember, WrongStage
from fedsec.protocol import wire
from fedsec.protocol.evaluation import LOSS_METRIC, PooledScores, check_report, pool

#: The message stage reports are stored under (not a round stage: no round waits on it).
EVALUATION_STAGE = "evaluation"
#: Attempts whose pools stay in memory: reports come for the newest rounds' models; an
#: older one's pool is rebuilt from the store when a late report needs it.
POOLS_KEPT = 16


class FederatedEvaluation:
    """Checks, stores and pools members' evaluation reports."""

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx
        # (round, attempt) -> ((model version, survivors), pool): reports arrive one at a
        # time, and re-reading every stored one per arrival would cost a cohort's square
        self._pools: OrderedDict[
            tuple[int, int], tuple[tuple[int, frozenset[str]], PooledScores]
        ] = OrderedDict()
        task = ctx.task
        self._known = {name: metric.bounds for name, metric in task.metrics.items()}
        self._known[LOSS_METRIC] = (-math.inf, math.inf)
        self._counted = [LOSS_METRIC, *(n for n, m in task.metrics.items() if m.weight is None)]

    def check(
        self, member: str, round_: int, attempt: int, report: wire.EvaluationReport
    ) -> bytes | None:
        """Validate a report without changing anything; return its encoding, or None
        when the same report is already stored.

        Raises:
            WrongStage: federated evaluation is off, or the attempt has not closed with
                the model version the report names.
            UnknownMember: ``member`` was not in the attempt's cohort.
            PayloadError: the report names another member, round or federation, holds
                more records than the member declared for the round or than the spec's
                ``max_weight_samples``, or its sums are unsound
                (:func:`fedsec.protocol.evaluation.check_report`).
            SignatureError: the report's signature is not the member's.
            DuplicateMessage: a different report of the member is stored for the attempt.
        """
        ws = self._ctx.ws
        if not ws.config.validation.federated:
            raise WrongStage("federated evaluation is off (validation.federated = false)")
        if (report.member, report.round, report.attempt, report.federation_id) != (
            member,
            round_,
            attempt,
            ws.federation_id,
        ):
            raise PayloadError(
                f"{member}: evaluation report names another member, round or federation"
            )
        spec = self._closed_spec(round_, attempt, report.model_version)
        if member not in spec.cohort:
            raise UnknownMember(f"{member} was not in the cohort of round {round_}.{attempt}")
        # A member weighs in the pooled value as its records do: at most what it declared
        # for the round, and at most the spec's max_weight_samples, the count at which its
        # weight in the model's sum stops growing (declaring more records costs nothing,
        # so the declaration alone would not bound it)
        declared = ws.state.joins.samples(round_, attempt).get(member, 0)
        bound = min(declared, spec.max_weight_samples)
        if report.records > bound:
            raise PayloadError(
                f"{member}: evaluation report counts {report.records} held-out records, "
                f"more than {bound} (the {declared} it declared for round {round_}, at most "
                f"round.max_weight_samples = {spec.max_weight_samples})"
            )
        check_report(report, self._known, self._counted)
        return self._ctx.signed_once(
            member,
            report,
            lambda: ws.state.messages.get(round_, attempt, EVALUATION_STAGE, member),
            f"{member} already reported its evaluation of round {round_}",
        )

    def store(self, report: wire.EvaluationReport, body: bytes) -> None:
        """Store a checked report and announce the attempt's pooled values."""
        ctx = self._ctx
        with ctx.ws.state.transaction():
            ctx.ws.state.messages.add(
                report.round, report.attempt, EVALUATION_STAGE, report.member, body
            )
        scores = self._pool(report.round, report.attempt, report.member)
        if scores is not None:
            scores[1].add(report)
        evaluated = self.pooled(report.round, report.attempt)
        if evaluated is not None:
            log.info(
                "event=model_evaluated round=%d attempt=%d version=%d members=%d records=%d",
                report.round,
                report.attempt,
                report.model_version,
                evaluated.members,
                evaluated.records,
            )
            ctx.emit(evaluated)

    def pooled(self, round_: int, attempt: int) -> ModelEvaluated | None:
        """The stored reports of a closed attempt, pooled; None without any."""
        found = self._pool(round_, attempt)
        if found is None or not found[1].members:
            return None
        (version, survivors), scores = found
        return ModelEvaluated(
            round_,
            attempt,
            version,
            scores.values(),
            len(scores.members),
            scores.records,
            complete=survivors <= scores.members,
        )

    def _pool(
        self, round_: int, attempt: int, pending: str = ""
    ) -> tuple[tuple[int, frozenset[str]], PooledScores] | None:
        """A closed attempt's (model version, survivors) and pool, kept in memory once
        built from the stored reports (``pending``: a member whose report was just stored
        and is added by the caller, not read back)."""
        key = (round_, attempt)
        if key in self._pools:
            self._pools.move_to_end(key)
            return self._pools[key]
        row = self._ctx.ws.state.rounds.get(round_, attempt)
        if row is None or row.stage != "closed" or row.model_version is None:
            return None
        stored = self._ctx.ws.state.messages.of_stage(round_, attempt, EVALUATION_STAGE)
        scores = pool(
            msgspec.json.decode(body, type=wire.EvaluationReport)
            for member, body in stored
            if member != pending
        )
        self._pools[key] = ((row.model_version, frozenset(_survivors(row))), scores)
        while len(self._pools) > POOLS_KEPT:
            self._pools.popitem(last=False)
        return self._pools[key]

    def _closed_spec(self, round_: int, attempt: int, version: int) -> wire.RoundSpec:
        row = self._ctx.ws.state.rounds.get(round_, attempt)
        if row is None or row.stage != "closed" or row.spec is None:
            raise WrongStage(f"round {round_}.{attempt} has not closed: nothing to evaluate")
        if row.model_version != version:
            raise WrongStage(
                f"round {round_}.{attempt} produced model v{row.model_version}, not v{version}"
            )
        return msgspec.json.decode(row.spec, type=wire.RoundSpec)


def _survivors(row: RoundRow) -> set[str]:
    """The members whose contributions are in a closed attempt's sum."""
    if row.spec is None or row.summary is None:
        return set()
    cohort = msgspec.json.decode(row.spec, type=wire.RoundSpec).cohort
    dropped = msgspec.json.decode(row.summary, type=wire.RoundSummary).dropped
    return set(cohort) - set(dropped)
