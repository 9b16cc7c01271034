"""Following the aggregator's rounds: which to join, which to skip, when to stop.

:class:`Follower` is sans-I/O like :class:`fedsec.agent.round.AgentRound`: it says
what to do next and takes the answers.  For each round state observed it decides:

- the federation finished: Finish;
- an open attempt we have not joined (and that has no spec yet): join it, after
  training on the signed plan first in buffered mode (a temporary refusal of that
  training defers it to the next change of round state);
- a spec with us in the cohort, an attempt not yet handled and not over: take part
  (Participate, with a fresh AgentRound), then answer pending audit challenges;
- anything else (not in the cohort, already handled, over): skip it and long-poll.

Catching up after missed rounds needs nothing special: every round names the model
version to start from and the agent downloads exactly that one.
"""

from __future__ import annotations

import logging
import os

import msgspec

from fedsec.agent.actions import (
    Action,
    AnswerChallenges,
    AwaitTraining,
    BudgetChecked,
    CheckBudget,
    Event,
    Finish,
    Join,
    JoinAnswered,
    Participate,
    Participated,
    Passed,
    Poll,
    Refused,
    RoundObserved,
    RoundOutcome,
    Step,
    Train,
    Trained,
    TrainingStarted,
    ask,
)
from fedsec.agent.charging import Carryover, TrainedUpdate, charge_step
from fedsec.agent.member import Member
from fedsec.agent.refusals import is_round_local, is_temporary
from fedsec.agent.round import AgentRound
from fedsec.agent.spec import check_spec_task, verify_round_spec
from fedsec.crypto.secagg.messages import GRAPH_NONCE_BYTES, graph_commitment
from fedsec.errors import DuplicateMessage, FedsecError, StaleUpdate, WrongStage
from fedsec.faults import NO_FAULTS, SeededBytes
from fedsec.protocol.wire import DataSummary, JoinRequest, RoundState
from fedsec.task.digest import loaded_task_pin

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")


class Follower:
    """Decides, round state by round state, what this agent does in the federation.

    Args:
        member: who we are and what we hold.
        carry: what attempts leave to the next (shared with every AgentRound).
        long_poll_s: passed to each AgentRound.
        max_rounds: finish once this many rounds closed with our contribution.
        seeded_bytes: passed to each AgentRound (:mod:`fedsec.faults`).
    """

    def __init__(
        self,
        member: Member,
        carry: Carryover,
        *,
        long_poll_s: float,
        max_rounds: int | None = None,
        seeded_bytes: SeededBytes = NO_FAULTS.seeded_bytes,
    ) -> None:
        self.member = member
        self.carry = carry
        self.outcomes: list[RoundOutcome] = []
        self._long_poll_s = long_poll_s
        self._max_rounds = max_rounds
        self._seeded_bytes = seeded_bytes
        self._joined = carry.joined
        # (round, attempt) -> the graph nonce committed to when joining it, until used
        self._graph_nonces: dict[tuple[int, int], bytes] = {}
        self._summary: DataSummary | None = None  # signed once per federation
        # the round state's challenges_issued when the member last looked for open
        # challenges (None: not yet this run, so challenges left from before are found)
        self._challenges_seen: int | None = None
        self._handled = carry.handled
        self._steps = self._follow()
        self._pending: Action = next(self._steps)

    def next(self) -> Action:
        """What to do now; the same action until :meth:`receive` answers it."""
        return self._pending

    def receive(self, event: Event) -> None:
        """Take the answer to :meth:`next`'s action.

        Raises:
            WrongStage: ``event`` does not answer it (nothing changes).
            FedsecError: an error that ends the agent.
        """
        pending = self._pending
        if isinstance(pending, Finish) or not isinstance(event, pending.answer | Refused):
            raise WrongStage(f"{type(event).__name__} does not answer {type(pending).__name__}")
        try:
            self._pending = self._steps.send(event)
        except StopIteration:
            self._pending = Finish()

    # -- the loop ------------------------------------------------------------------

    def _follow(self) -> Step[None]:
        state = yield from self._observe(None)
        while True:
            if state.finished:
                log.info("federation_finished rounds_completed=%d", state.rounds_completed)
                return
            key = (state.round, state.attempt)
            following: RoundState | None = None
            if state.stage == "open" and key not in self._joined and state.spec is None:
                if state.mode == "buffered":
                    if not (yield from self._train_for_buffer_outliving_refusals(state)):
                        # not joined untrained: try again once the round state changes
                        state = yield from self._observe(state.token)
                        continue
                    state = yield from self._observe(None)  # training took a while
                    key = (state.round, state.attempt)
                fresh = state.stage == "open" and key not in self._joined
                if fresh and state.spec is None and not (yield from self._join(state)):
                    # refused as stale: retrain on the newest model now, rather than
                    # wait for the next change of round state
                    state = yield from self._observe(None)
                    continue
            if self._takes_part(state, key):
                self._handled.add(key)
                following = yield from self._participate(state)
                if self._enough():
                    return
            state = following or (yield from self._observe(state.token))

    def _observe(self, token: int | None) -> Step[RoundState]:
        return (yield from ask(Poll(token), RoundObserved)).state

    def _takes_part(self, state: RoundState, key: tuple[int, int]) -> bool:
        spec = state.spec
        return (
            spec is not None
            and key not in self._handled
            and self.member.id in spec.cohort
            and state.stage not in ("closed", "aborted")
        )

    def _enough(self) -> bool:
        # a round whose rule refused our receipted update closed with us in it all the same
        closed = sum(1 for o in self.outcomes if o.status in ("closed", "refused"))
        return self._max_rounds is not None and closed >= self._max_rounds

    def _participate(self, state: RoundState) -> Step[RoundState | None]:
        """Take part in the attempt; return the newest state it saw."""
        assert state.spec is not None
        round_ = AgentRound(
            state,
            self.member,
            self.carry,
            long_poll_s=self._long_poll_s,
            seeded_bytes=self._seeded_bytes,
            graph_nonce=self._graph_nonces.pop((state.round, state.attempt), b""),
        )
        done = yield from ask(Participate(round_), Participated)
        self.outcomes.append(done.outcome)
        # a challenge issued after the newest state seen shows in a later one: looked
        # for then, at the end of the next round taken part in
        issued = (done.following or state).challenges_issued
        if issued != self._challenges_seen:
            yield from ask(AnswerChallenges(state.spec.federation_id), Passed)
            self._challenges_seen = issued
        return done.following

    # -- joining -------------------------------------------------------------------

    def _signed_summary(self, federation_id: str) -> DataSummary | None:
        """The member's data summary for this federation, signed (None without one)."""
        summary = self.member.data_summary
        if summary is None:
            return None
        if self._summary is None or self._summary.federation_id != federation_id:
            bound = msgspec.structs.replace(summary, federation_id=federation_id)
            self._summary = bound.sign(self.member.identity)
        return self._summary

    def _join(self, state: RoundState) -> Step[bool]:
        """Ask for a seat in the cohort; False when the update must be retrained first."""
        key = (state.round, state.attempt)
        self._joined.add(key)
        if self.carry.last_cost is not None:
            # The last round's cost is the best guess of this one's: do not take a cohort
            # seat that the budget could not pay for.
            yield from ask(CheckBudget(state.round, self.carry.last_cost), BudgetChecked)
        update = self.carry.update
        nonce = os.urandom(GRAPH_NONCE_BYTES)  # our share of the SecAgg+ graph's randomness
        self._graph_nonces[key] = nonce
        commitment = graph_commitment(state.federation_id, state.round, self.member.id, nonce)
        request = JoinRequest(
            dataset_schema=self.member.task.schema.fingerprint(),
            task_version=self.member.task.version,
            samples=self.member.samples,
            base_version=(
                update.base_version if state.mode == "buffered" and update is not None else None
            ),
            data_summary=self._signed_summary(state.federation_id),
            graph_commitment=commitment.hex(),
            task_pin=loaded_task_pin(self.member.task.name),
        )
        try:
            answer = (yield from ask(Join(*key, request), JoinAnswered)).answer
        except DuplicateMessage:
            log.info("round_join_duplicate round=%d attempt=%d", *key)
            return True
        except StaleUpdate as exc:
            log.warning("round_join_stale round=%d attempt=%d reason=%r", *key, exc.detail)
            self.carry.update = None  # retrain on the newest model
            self._joined.discard(key)
            return False
        except FedsecError as exc:
            if not is_round_local(exc):
                raise
            log.warning("round_join_refused round=%d attempt=%d reason=%r", *key, exc.detail)
            return True
        if answer.accepted:
            log.info("round_joined round=%d attempt=%d samples=%d", *key, self.member.samples)
        else:
            log.warning("round_join_rejected round=%d attempt=%d reason=%r", *key, answer.detail)
        return True

    # -- buffered mode: train before joining ---------------------------------------

    def _train_for_buffer_outliving_refusals(self, state: RoundState) -> Step[bool]:
        """:meth:`_train_for_buffer`; False when a temporary refusal (of the model
        download) left the agent without an update to join with."""
        try:
            yield from self._train_for_buffer(state)
        except FedsecError as exc:
            if not is_temporary(exc):
                raise
            log.warning("buffer_training_deferred round=%d reason=%r", state.round, exc.detail)
            return False
        return True

    def _train_for_buffer(self, state: RoundState) -> Step[None]:
        """Buffered mode: train on the newest signed plan before joining, unless an
        update is already waiting."""
        if self.carry.update is not None or state.plan is None:
            return
        plan, m = state.plan, self.member
        verify_round_spec(plan, m.aggregator_public)
        check_spec_task(plan, m.task, m.dim)
        charge = yield from charge_step(plan, self.carry, m)
        if isinstance(charge, TrainedUpdate):
            return
        yield from ask(Train(plan, charge), TrainingStarted)
        trained = yield from ask(AwaitTraining(), Trained)  # TrainingFailed raises here
        self.carry.trained(plan, charge, trained.delta)
