"""Where this agent's attempt is: the newest round state seen, and the steps that wait
for a stage of it (sans-I/O: they yield Poll and fetch actions)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from fedsec.agent.actions import Action, E, Poll, RoundObserved, Step, UploadAnswered, ask
from fedsec.errors import DuplicateMessage, WrongStage
from fedsec.protocol.stages import Stage, stage_index
from fedsec.protocol.wire import Accepted, RoundState

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")


class AttemptOver(Exception):
    """The attempt we were in ended (aborted, replaced, or the round moved on)."""

    def __init__(self, state: RoundState) -> None:
        super().__init__(f"round {state.round} attempt {state.attempt} stage {state.stage}")
        self.state = state


class StageMissed(Exception):
    """The attempt is already past the stage we wanted."""

    def __init__(self, state: RoundState, wanted: str) -> None:
        super().__init__(f"stage {wanted} already passed (now {state.stage})")
        self.state = state


class AttemptTracker:
    """The attempt (round, attempt) of ``state`` as this agent follows it.

    Args:
        state: the round state the attempt was first seen in.
        long_poll_s: how long the aggregator may hold an answer for the next stage.
    """

    def __init__(self, state: RoundState, long_poll_s: float) -> None:
        self.state = state  # the newest round state seen
        self.key = (state.round, state.attempt)
        self.long_poll_s = long_poll_s

    def wait_for(self, stages: Iterable[Stage]) -> Step[RoundState]:
        """Poll until this attempt reaches one of ``stages``.

        Raises:
            AttemptOver: the attempt was aborted or another round/attempt began.
            StageMissed: the attempt is already past every stage in ``stages``.
        """
        wanted = tuple(stages)
        latest = max(stage_index(s) for s in wanted)
        while True:
            current = self.state
            if (current.round, current.attempt) != self.key or current.stage == "aborted":
                raise AttemptOver(current)
            if current.stage in wanted:
                return current
            if stage_index(current.stage) > latest:
                raise StageMissed(current, "/".join(wanted))
            self.state = (yield from ask(Poll(current.token), RoundObserved)).state

    def stage_data(
        self, stage: Stage, fetch: Callable[[float], Action], answer: type[E]
    ) -> Step[E]:
        """The data of ``stage`` for this member: long-polled in one request (``fetch``
        with a wait); when that answers before the stage (a 409 wrong stage: the wait
        is over, the attempt aborted), poll the round state, then fetch at once."""
        try:
            return (yield from ask(fetch(self.long_poll_s), answer))
        except WrongStage:
            yield from self.wait_for((stage,))
            return (yield from ask(fetch(0.0), answer))


def upload(action: Action) -> Step[Accepted | None]:
    """A SecAgg+ upload's answer; None for a 409 duplicate (an earlier, retried try
    already landed)."""
    try:
        return (yield from ask(action, UploadAnswered)).answer
    except DuplicateMessage:
        log.info("request_duplicate_ignored")
        return None
