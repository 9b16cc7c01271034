"""The round attempt in progress, in memory (rebuilt from the state store on resume),
and the checks a member's message for it must pass before any state changes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsec.crypto.secagg import ServerSession
from fedsec.errors import UnknownMember, WrongStage
from fedsec.protocol import wire
from fedsec.protocol.stages import ACTIVE_STAGES, stage_index
from fedsec.summation.plain import PlainSession
from fedsec.summation.secagg import SecAggPlusSession
from fedsec.summation.session import SummationSession


@dataclass
class Attempt:
    """One attempt of one round: where it stands and its summation session."""

    round: int
    attempt: int
    stage: str
    opened_at: float
    stage_started_at: float
    spec: wire.RoundSpec | None = None
    summation: SummationSession | None = None  # from the cohort's fixing on
    plan: wire.RoundSpec | None = None  # buffered mode: what members train by before joining
    # the spec's cohort as a set, with the spec it was made from (every accepted message
    # asks whether its sender is in the cohort: a list scan was O(n) each)
    _cohort: tuple[wire.RoundSpec, frozenset[str]] | None = field(
        default=None, repr=False, compare=False
    )

    def is_current(self, round_: int, attempt: int) -> bool:
        return (round_, attempt) == (self.round, self.attempt)

    def reached(self, stage: str) -> bool:
        """True while the attempt accepts messages and is at or past ``stage``."""
        return self.stage in ACTIVE_STAGES and not self.precedes(self.stage, stage)

    def precedes(self, first: str, then: str) -> bool:
        """True when ``first`` comes before ``then`` in this attempt: open, then its
        summation mode's stages in the mode's order.  A stage the mode does not pass
        through is placed by the order of every stage (:data:`fedsec.protocol.stages.STAGES`).

        Raises:
            ValueError: either is not a stage.
        """
        order = ("open", *(self.summation.stages if self.summation is not None else ()))
        if first in order and then in order:
            return order.index(first) < order.index(then)
        return stage_index(first) < stage_index(then)

    def expect(self, member: str, round_: int, attempt: int, stage: str) -> None:
        """Raises WrongStage: the message is not for this attempt, or not for its stage."""
        if not self.is_current(round_, attempt):
            raise WrongStage(
                f"{member}: message for round {round_} attempt {attempt}, but the current "
                f"round is {self.round} attempt {self.attempt} (stage {self.stage})"
            )
        if self.stage != stage:
            raise WrongStage(
                f"{member}: {stage} message refused: round {self.round} is in stage {self.stage}"
            )

    def expect_at_least(self, member: str, round_: int, attempt: int, stage: str) -> None:
        """Raises WrongStage: the request is not for this attempt, or it has not reached
        ``stage`` (or is over)."""
        if not self.is_current(round_, attempt):
            raise WrongStage(
                f"{member}: request for round {round_} attempt {attempt}, but the current round "
                f"is {self.round} attempt {self.attempt}"
            )
        if not self.reached(stage):
            raise WrongStage(f"{member}: round {self.round} has not reached stage {stage} yet")

    def in_cohort(self, member: str) -> wire.RoundSpec:
        """The spec, once ``member`` is checked to be in its cohort.

        Raises:
            UnknownMember: it is not.
        """
        spec = self.spec
        assert spec is not None
        cohort = self._cohort
        if cohort is None or cohort[0] is not spec:
            cohort = self._cohort = (spec, frozenset(spec.cohort))
        if member not in cohort[1]:
            raise UnknownMember(f"{member} is not in the cohort of round {self.round}")
        return spec

    def summing(self) -> SummationSession:
        """The summation session (the cohort is fixed whenever a stage message is taken)."""
        assert self.summation is not None
        return self.summation

    # Read-only views of the mode's own state, for tests and debugging; the round engine
    # itself goes through the SummationSession interface only.

    @property
    def session(self) -> ServerSession | None:
        """The SecAgg+ server state machine, in a secure attempt."""
        s = self.summation
        return s.server if isinstance(s, SecAggPlusSession) else None

    @property
    def plain(self) -> PlainSession | None:
        """The running plain sum, in an attempt without secure summation."""
        s = self.summation
        return s if isinstance(s, PlainSession) else None

    @property
    def plain_members(self) -> list[str] | None:
        return self.plain.members if self.plain is not None else None

    @property
    def plain_sum(self) -> np.ndarray | None:
        return self.plain.total if self.plain is not None else None

    @property
    def plain_weight(self) -> float:
        return self.plain.weight if self.plain is not None else 0.0
