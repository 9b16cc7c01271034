"""The agent's main loop: follow the aggregator's rounds, train under DP, contribute securely.

The decisions live in two sans-I/O machines: :class:`fedsec.agent.follow.Follower`
(which round states to join, skip or take part in) and
:class:`fedsec.agent.round.AgentRound` (one attempt: charge, train, advertise, send
shares, send the masked input, unmask).  This module is the short driver that
performs what they ask — through the aggregator client, the privacy ledger, the vault
(:mod:`fedsec.agent.perform`) and the training executor (:mod:`fedsec.agent.trainer`)
— and hands back the answers::

    loop { action = machine.next(); answer = perform(action); machine.receive(answer) }

Local training runs in the background while SecAgg+'s key stages proceed: the two
round trips and the aggregator's stage changes then cost no wall time after
training, which is what made secure summation ~1.5x slower than plain summation
when rounds are short.  The aggregator's masked_input deadline includes the
training time.

The agent long-polls ``GET /round`` with the last token it saw and reacts to each
state; if the attempt is aborted or a new one starts, the half-done session is
dropped and the agent follows the newest state.

Privacy: the ledger is charged (checked and recorded durably, in one locked step)
*before* training, so a crash can never spend privacy off the books.  A retried
attempt of the same round reuses the update already trained on the same model
with the same settings instead of training (and spending) again.  Rounds that ask
for training without DP are refused: this agent's promise to its data owner is
DP-SGD on every round.

Failures are split in three (:mod:`fedsec.agent.refusals`).  Temporary refusals
(429 rate limited, 503 busy, 408 body timeout, 401 replayed) are retried by the
client; when its retries run out the agent still outlives them: a poll of the round
state waits and asks again, anything else drops this agent from the attempt.
Round-local ones (a stage missed, a 409 from the aggregator, a relayed key list that
does not verify) drop this agent from the attempt with a warning and it waits for
the next.  Everything else (spec or manifest signatures that do not verify, a task
mismatch, an exhausted budget, an unreachable aggregator, a key that is not on the
roster or may not do this, a clock the aggregator still refuses after the client
corrected it) ends :meth:`AgentRuntime.run` with the error, whose sentence the CLI
prints.

Logs are ``event key=value``; they never carry keys, shares, seeds or vectors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import torch

from fedsec.agent import actions as act
from fedsec.agent.actions import RoundOutcome
from fedsec.agent.charging import Carryover
from fedsec.agent.device import resolve_device
from fedsec.agent.evaluation import MemberEvaluator, held_out_split
from fedsec.agent.follow import Follower
from fedsec.agent.hidden_model import HiddenModels
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.local_data import LocalData, load_local_data, task_options
from fedsec.agent.member import Member
from fedsec.agent.perform import (
    MIN_REPOLL_S,
    ActionPerformer,
    FederationPin,
    Stopped,
    temporary_wait,
)
from fedsec.agent.pinned_roster import ADMIN_KEY_FILE, PinnedRoster
from fedsec.agent.refusals import is_round_local, is_temporary
from fedsec.agent.spec import check_spec_task, member_weight, training_params, verify_round_spec
from fedsec.agent.trainer import MODEL_HEADER_SLACK_BYTES, LocalTrainer
from fedsec.agent.vault import Vault
from fedsec.aggregator_client import AggregatorClient
from fedsec.aio import cancel_and_wait
from fedsec.config import AgentConfig
from fedsec.crypto.commitment import seal_reveal
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import BudgetExhausted, ConfigError, DuplicateMessage, FedsecError
from fedsec.faults import NO_FAULTS, Faults
from fedsec.protocol.limits import LONG_POLL_S
from fedsec.protocol.wire import RevealBody, RevealPayload
from fedsec.tasks.params import param_count

__all__ = [
    "ADMIN_KEY_FILE",
    "IDENTITY_FILE",
    "MIN_REPOLL_S",
    "MODEL_HEADER_SLACK_BYTES",
    "AgentRuntime",
    "LocalData",
    "RoundOutcome",
    "check_spec_task",
    "load_local_data",
    "member_weight",
    "training_params",
    "verify_round_spec",
]

log = logging.getLogger(__name__)

#: The agent's signing key, in its state directory (written 0600 by ``fedsec agent init``).
IDENTITY_FILE: Final = "identity.key"
#: Long-poll wait asked of the aggregator: the longest it holds one.
POLL_TIMEOUT_S: Final = LONG_POLL_S
# Masks for a vector this small (~1 ms for the MNIST-1D CNN's 5,210 parameters) are
# computed on the event loop: a worker thread costs two GIL hand-offs and a wake-up,
# measured 0.05 s a round slower with 50 agents sharing one process.
INLINE_MASKING_MAX_DIM = 100_000

# the refusal classes, by their former names here
_is_temporary = is_temporary
_is_round_local = is_round_local
_temporary_wait = temporary_wait


class AgentRuntime:
    """Runs one data owner's agent against its aggregator.

    Args:
        config: the validated ``agent.toml``.
        identity: the agent's signing key (its public half must be the roster's).
        progress: show a progress bar while training.
        client: an aggregator client to use (tests); default one built from config.
        poll_timeout_s: long-poll wait asked of the aggregator.
        slowdown: simulations only: this member trains slowdown x slower.
        training_executor: where local training runs (default: asyncio's default
            executor).  Simulations that host many agents in one process pass one
            pool with a thread per core: more training threads than cores only
            contend for the GIL with the event loop that runs every agent's protocol.
        faults: crash points and the unsafe deterministic seed for chaos tests
            (:mod:`fedsec.faults`); none in production.
    """

    def __init__(
        self,
        config: AgentConfig,
        identity: SigningIdentity,
        *,
        progress: bool = False,
        client: AggregatorClient | None = None,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        slowdown: float = 1.0,
        training_executor: concurrent.futures.Executor | None = None,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.config = config
        self.identity = identity
        self.member = config.agent.id
        self.progress = progress
        self.poll_timeout_s = poll_timeout_s
        self.slowdown = slowdown
        self.state_dir = Path(config.agent.state_dir)
        self.aggregator_public = config.agent.aggregator_public_key_bytes
        self.dataset_id = config.data.effective_dataset_id()
        self.ledger = PrivacyLedger(self.state_dir)
        self.vault = Vault(self.state_dir)
        self._training_executor = training_executor
        self._faults = faults
        self._client = client
        self._stop = asyncio.Event()
        self._local: LocalData | None = None
        self._device: torch.device | None = None
        self._trainer: LocalTrainer | None = None
        self._evaluator: MemberEvaluator | None = None  # federated evaluation, once asked
        self._roster = PinnedRoster(self.state_dir, self.member, identity)
        self._pin = FederationPin()
        # across attempts and runs; released updates are the ledger's, across restarts
        self._carry = Carryover(self.ledger.releases(self.dataset_id))

    # -- set-up ---------------------------------------------------------------------

    def prepare(self) -> LocalData:
        """Load data, resolve the device and set the ledger budget; refuse a spent budget.

        Idempotent; :meth:`run` calls it first.

        Raises:
            ConfigError: bad data settings, device, or a budget delta change after spending.
            BudgetExhausted: nothing of the budget is left.
        """
        if self._local is None:
            self._device = resolve_device(self.config.agent.device)
            self._local = load_local_data(self.config.data, self.state_dir, self.member)
            privacy = self.config.privacy
            known = self.dataset_id in self.ledger.datasets()
            budget = self.ledger.budget(self.dataset_id) if known else None
            if budget is None or (budget.epsilon, budget.delta) != (privacy.epsilon, privacy.delta):
                self.ledger.set_budget(self.dataset_id, privacy.epsilon, privacy.delta)
            summary = self._local.summary
            if summary is not None and summary.count_epsilon > 0:
                # charged before the summary can leave (at the first join)
                self.ledger.charge_pure(
                    self.dataset_id, summary.count_epsilon, "noised counts of the data summary"
                )
            spent = self.ledger.spent(self.dataset_id)
            if spent >= privacy.epsilon:
                raise BudgetExhausted(
                    f"dataset '{self.dataset_id}': epsilon {spent:.2f} of the budget "
                    f"{privacy.epsilon:g} is already spent; refusing to train"
                )
            log.info(
                "agent_ready member=%s task=%s samples=%d dataset=%s spent=%.3f budget=%g "
                "device=%s",
                self.member,
                self._local.task.name,
                self._local.samples,
                self.dataset_id,
                spent,
                privacy.epsilon,
                self._device,
            )
        return self._local

    def make_client(self) -> AggregatorClient:
        net = self.config.network
        return AggregatorClient(
            self.config.agent.aggregator_url,
            self.identity,
            self.aggregator_public,
            timeout_s=net.timeout_s,
            retry_max=net.retry_max,
            backoff_initial_s=net.backoff_initial_s,
            backoff_max_s=net.backoff_max_s,
        )

    def _member(self) -> Member:
        local = self.prepare()
        return Member(
            id=self.member,
            identity=self.identity,
            aggregator_public=self.aggregator_public,
            dataset_id=self.dataset_id,
            task=local.task,
            samples=local.samples,
            dim=param_count(local.task.build_model(0)),
            privacy_delta=self.config.privacy.delta,
            require_dp=self.config.privacy.require_dp,
            privacy_epsilon=self.config.privacy.epsilon,
            allow_distributed=self.config.privacy.allow_distributed,
            min_survivors=self.config.privacy.min_survivors,
            tolerated_corrupt=self.config.privacy.tolerated_corrupt_neighbours,
            data_summary=local.summary,
            extra_epsilon=self.ledger.pure_spent(self.dataset_id),
        )

    # -- main loop ------------------------------------------------------------------

    async def run(
        self, max_rounds: int | None = None, stop: asyncio.Event | None = None
    ) -> list[RoundOutcome]:
        """Follow the federation until it finishes, ``max_rounds`` rounds closed with
        our contribution, or ``stop`` is set.

        Returns:
            One outcome per round attempt in whose cohort this agent was.

        Raises:
            FedsecError: a fatal error (see module docstring), e.g. BudgetExhausted,
                TaskMismatch, SignatureError, AggregatorUnreachable.
        """
        if stop is not None:
            self._stop = stop
        await asyncio.to_thread(self.prepare)
        client = self._client or self.make_client()
        follower = Follower(
            self._member(),
            self._carry,
            long_poll_s=self.poll_timeout_s,
            max_rounds=max_rounds,
            seeded_bytes=self._faults.seeded_bytes,
        )
        perform = ActionPerformer(
            client,
            self._stop,
            ledger=self.ledger,
            vault=self.vault,
            roster=self._roster,
            dataset_id=self.dataset_id,
            pin=self._pin,
            poll_timeout_s=self.poll_timeout_s,
            faults=self._faults,
        )
        try:
            await self._follow(perform, follower)
        except Stopped:
            log.info("agent_stopped member=%s", self.member)
        finally:
            if self._client is None:
                await client.close()
        return follower.outcomes

    async def _follow(self, perform: ActionPerformer, follower: Follower) -> None:
        """Perform what the follower asks until it finishes."""
        training: asyncio.Future[act.Event] | None = None
        while not isinstance(action := follower.next(), act.Finish):
            event: act.Event
            if isinstance(action, act.Participate):
                event = await self._drive_round(perform, action.round)
            elif isinstance(action, act.AnswerChallenges):
                await self._answer_quietly(perform.client, action.federation_id)
                event = act.Passed()
            elif isinstance(action, act.Train):
                training = asyncio.ensure_future(self._train(perform.client, action))
                event = act.TrainingStarted()
            elif isinstance(action, act.AwaitTraining):
                assert training is not None
                event = await training
            else:
                event = await perform.perform(action)
            follower.receive(event)

    async def _drive_round(
        self, perform: ActionPerformer, round_: act.RoundMachine
    ) -> act.Participated:
        """Run one attempt's machine to its end, training in the background."""
        training: asyncio.Future[act.Event] | None = None
        try:
            while (finish := round_.finished) is None:
                action = round_.next()
                if isinstance(action, act.Train):
                    training = asyncio.ensure_future(self._train(perform.client, action))
                    round_.receive(act.TrainingStarted())
                elif isinstance(action, act.AwaitTraining):
                    assert training is not None
                    round_.receive(await training)
                elif isinstance(action, act.Evaluate):
                    round_.receive(await self._evaluate(perform.client, action))
                else:
                    event = await self._alongside(perform, action, round_, training)
                    if event is not None:
                        round_.receive(event)
            assert finish.outcome is not None  # a round always finishes with its outcome
            return act.Participated(finish.outcome, finish.following)
        except Stopped:
            if training is not None and round_.training:
                round_.receive(await training)  # keep the update for a later run
            raise
        finally:
            if training is not None and not training.done():
                training.cancel()

    async def _alongside(
        self,
        perform: ActionPerformer,
        action: act.Action,
        round_: act.RoundMachine,
        training: asyncio.Future[act.Event] | None,
    ) -> act.Event | None:
        """Perform ``action``; should training end first, hand its result to the round
        at once, and drop the action (None) when that ended the round."""
        if isinstance(action, act.Mask):
            return await _mask(action)
        request = asyncio.ensure_future(perform.perform(action))
        try:
            if training is not None and round_.training:
                done, _ = await asyncio.wait(
                    {request, training}, return_when=asyncio.FIRST_COMPLETED
                )
                if request not in done:
                    round_.receive(training.result())
                    if round_.finished is not None:
                        return None
            return await request
        finally:
            await cancel_and_wait(request)

    async def _train(self, client: AggregatorClient, action: act.Train) -> act.Event:
        if self._trainer is None:
            assert self._device is not None
            self._trainer = LocalTrainer(
                self.member,
                self.aggregator_public,
                self.prepare(),
                self._device,
                self._training_executor,
                progress=self.progress,
                slowdown=self.slowdown,
                faults=self._faults,
                hidden=HiddenModels(self._roster, self.member, self.identity),
                workers=self.config.training.settings,
                state_dir=self.state_dir,
                task_options=task_options(self.config.data),
            )
        try:
            self._check_sources_unchanged()
            return act.Trained(await self._trainer.train(client, action.spec, action.charge))
        except FedsecError as exc:
            return act.TrainingFailed(exc)

    async def _evaluate(self, client: AggregatorClient, action: act.Evaluate) -> act.Event:
        """Score the model a closed attempt produced and report it (federated evaluation)."""
        try:
            if self._evaluator is None:
                local = self.prepare()
                assert self._device is not None
                self._evaluator = MemberEvaluator(
                    self.member,
                    self.identity,
                    self.aggregator_public,
                    local.task,
                    held_out_split(local.task, self.config.data),
                    self._device,
                    self._training_executor,
                )
            await self._evaluator.report(
                client,
                action.federation_id,
                action.round,
                action.attempt,
                action.model_version,
                action.max_records,
            )
            return act.Passed()
        except FedsecError as exc:
            return act.Refused(exc)

    def _check_sources_unchanged(self) -> None:
        """Refuse to train on records loaded from files that have changed since: the
        summary the federation holds would no longer describe them.

        Raises:
            ConfigError: naming the source that changed.
        """
        local = self.prepare()
        if not local.fingerprint:
            return
        from fedsec.data.sources import open_source
        from fedsec.data.table import sources_fingerprint

        for spec in self.config.data.sources:
            source = open_source(spec)
            now = sources_fingerprint([source])
            if now not in local.fingerprint.split("|"):
                raise ConfigError(
                    f"{source.name} changed since the agent read it (size or modification "
                    "time differ): restart the agent so its data map, summary and training "
                    "agree"
                )

    # -- audit challenges -------------------------------------------------------------

    async def answer_challenges(self, client: AggregatorClient, federation_id: str) -> int:
        """Open every pending audit challenge: seal the kept update and its salt to the
        challenging auditor's key (from the admin-signed roster) and send it.

        Returns:
            How many challenges were answered.

        Raises:
            IntegrityError: the vault no longer holds a challenged update.
        """
        pending = await client.challenges()
        if not pending.challenges:
            return 0
        auditors = await self._roster.keys(client, federation_id, role="auditor")
        distributed = {(r.round, r.attempt) for r in self.vault.records() if r.dp_mode != "local"}
        answered = 0
        for ch in pending.challenges:
            key = auditors.get(ch.auditor)
            if key is None:
                log.warning("challenge_ignored auditor=%s reason=not_an_active_auditor", ch.auditor)
                continue
            if (ch.round, ch.attempt) in distributed:
                # the kept update carries only our share of the noise: revealing it would
                # spend far more privacy than the round's epsilon accounts for
                log.warning(
                    "challenge_refused round=%d attempt=%d reason=distributed_dp",
                    ch.round,
                    ch.attempt,
                )
                continue
            kept = self.vault.load_update(ch.round, ch.attempt)
            payload = RevealPayload(
                federation_id=federation_id,
                round=ch.round,
                attempt=ch.attempt,
                member=self.member,
                update=np.ascontiguousarray(kept.update)
                .astype(kept.update.dtype.newbyteorder("<"))
                .tobytes()
                .hex(),
                salt=kept.salt.hex(),
            )
            sealed = seal_reveal(key, msgspec.json.encode(payload))
            try:
                await client.reveal(RevealBody(ch.round, ch.attempt, ch.auditor, sealed.hex()))
            except DuplicateMessage:
                log.info("request_duplicate_ignored")
            answered += 1
            log.info("challenge_answered round=%d auditor=%s", ch.round, ch.auditor)
        return answered

    async def _answer_quietly(self, client: AggregatorClient, federation_id: str) -> None:
        try:
            await self.answer_challenges(client, federation_id)
        except FedsecError as exc:
            log.warning("challenges_unanswered reason=%r", exc.detail)


async def _mask(action: act.Mask) -> act.Event:
    try:
        if action.dim <= INLINE_MASKING_MAX_DIM:
            return act.Masked(action.compute())
        # keep the event loop responsive while a large vector is masked
        return act.Masked(await asyncio.to_thread(action.compute))
    except FedsecError as exc:
        return act.Refused(exc)
