"""How each I/O action of the round machines is carried out: through the member's
message seam (:mod:`fedsec.agent.seam`; the aggregator client for everything else),
the privacy ledger and the vault.  No decisions here beyond the transport's
own: a round-state poll outlives temporary refusals, and a stop cuts long polls and
SecAgg+ uploads short (never the masked input, whose receipt must be kept)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from fedsec.agent import actions as act
from fedsec.agent.charges import PrivacyCharge
from fedsec.agent.he import HeContexts, encrypt_update
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.pinned_roster import PinnedRoster
from fedsec.agent.refusals import is_temporary
from fedsec.agent.seam import MemberSeam, StarSeam
from fedsec.agent.vault import Vault
from fedsec.aggregator_client import AggregatorClient
from fedsec.aio import unless_stopped
from fedsec.errors import BudgetExhausted, FedsecError, IntegrityError, RetryLater
from fedsec.faults import NO_FAULTS, Faults
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_UNREPORTED_CHARGES
from fedsec.protocol.wire import RoundState

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")

T = TypeVar("T")

#: A server that answers a long poll at once with an unchanged token would make the
#: agent spin; it waits this long before polling again.
MIN_REPOLL_S: Final = 0.25


class Stopped(Exception):
    """The caller asked the runtime to stop."""


class FederationPin:
    """The federation this agent follows: the first one the aggregator named."""

    def __init__(self) -> None:
        self.federation: str | None = None

    def check(self, state: RoundState) -> None:
        """Raises IntegrityError: the aggregator switched federation."""
        if self.federation is None:
            self.federation = state.federation_id
        elif state.federation_id != self.federation:
            raise IntegrityError(
                f"aggregator switched federation from {self.federation!r} to "
                f"{state.federation_id!r}"
            )


def temporary_wait(exc: FedsecError, longest_s: float) -> float:
    """Seconds to wait after a temporary refusal outlasted the client's retries: the
    server's Retry-After or the client's longest backoff, never under MIN_REPOLL_S so
    a ``Retry-After: 0`` cannot make the agent spin."""
    wait = min(exc.retry_after, longest_s) if isinstance(exc, RetryLater) else longest_s
    return max(wait, MIN_REPOLL_S)


class ActionPerformer:
    """Performs the I/O actions of one :meth:`AgentRuntime.run`.

    Args:
        client: the aggregator client.
        stop: set to stop; long polls and SecAgg+ uploads are cut short.
        ledger, vault, roster: this agent's privacy ledger, vault and pinned roster.
        dataset_id: the dataset the ledger charges.
        pin: the federation followed (kept across runs).
        poll_timeout_s: long-poll wait asked of the aggregator.
        faults: where a chaos test crashes this agent (:mod:`fedsec.faults`).
        seam: how the stage messages travel (default: the star, through ``client``).
    """

    def __init__(
        self,
        client: AggregatorClient,
        stop: asyncio.Event,
        *,
        ledger: PrivacyLedger,
        vault: Vault,
        roster: PinnedRoster,
        dataset_id: str,
        pin: FederationPin,
        poll_timeout_s: float,
        faults: Faults = NO_FAULTS,
        seam: MemberSeam | None = None,
    ) -> None:
        self.client = client
        self.seam = seam or StarSeam(client)
        self.stop = stop
        self.ledger = ledger
        self.vault = vault
        self.roster = roster
        self.dataset_id = dataset_id
        self.pin = pin
        self.poll_timeout_s = poll_timeout_s
        self._faults = faults
        self._he = HeContexts(roster)
        self._table = self._performers()

    async def perform(self, action: act.Action) -> act.Event:
        """Carry out ``action``; a FedsecError becomes the Refused answer.

        Raises:
            Stopped: asked to stop.
        """
        try:
            return await self._table[type(action)](action)
        except FedsecError as exc:
            return act.Refused(exc)

    def _performers(self) -> dict[type[act.Action], Callable[[Any], Awaitable[act.Event]]]:
        c, guard = self.client, self.unless_stopped
        stage_messages: dict[type[act.Action], Callable[[Any], Awaitable[act.Event]]] = {
            **{upload: self._stage_upload for upload in _subclasses(act.StageUpload)},
            **{fetch: self._stage_fetch for fetch in _subclasses(act.StageFetch)},
        }
        return {
            **stage_messages,
            act.Poll: self._poll,
            act.FetchRoster: self._fetch_roster,
            act.Charge: self._charge,
            act.CheckBudget: self._check_budget,
            act.ReportTaken: self._report_taken,
            act.Join: lambda a: _as(act.JoinAnswered, c.join(a.round, a.attempt, a.request)),
            act.Report: lambda a: _passed(c.report(a.round, a.attempt, a.report)),
            act.KeepUpdate: self._keep_update,
            act.Release: self._release,
            act.Encrypt: self._encrypt,
            # not cut short by a stop: the receipt of an accepted contribution is kept
            act.SendMaskedInput: self._send_masked_input,
            act.FetchReceipt: lambda a: _as(act.ReceiptFetched, c.receipt(a.round)),
            act.Record: self._record,
            act.FetchStatus: lambda a: _as(act.StatusFetched, guard(c.status())),
            act.FaultPoint: self._fault_point,
            act.RouteStages: self._route_stages,
        }

    # -- round state -----------------------------------------------------------------

    async def _poll(self, action: act.Poll) -> act.RoundObserved:
        return act.RoundObserved(await self.poll(action.token))

    async def poll(self, token: int | None) -> RoundState:
        """The next round state (long-polled on ``token``), or Stopped when asked to stop."""
        started = time.monotonic()
        wait = 0.0 if token is None else self.poll_timeout_s
        state = await self._round_state(token, wait)
        self.pin.check(state)
        if token is not None and state.token == token and time.monotonic() - started < 0.05:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), MIN_REPOLL_S)
        return state

    async def _round_state(self, token: int | None, wait: float) -> RoundState:
        """``GET /round``, asked again after a temporary refusal until it is answered.

        Raises:
            Stopped: asked to stop, also while waiting to ask again.
            FedsecError: any other refusal.
        """
        while True:
            try:
                return await self.unless_stopped(self.client.get_round(token, wait))
            except FedsecError as exc:
                if not is_temporary(exc):
                    raise
                pause = temporary_wait(exc, self.client.backoff_max_s)
                log.warning("round_poll_refused retry_in_s=%.2f reason=%r", pause, exc.detail)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), pause)
            if self.stop.is_set():
                raise Stopped

    async def unless_stopped(self, request: Awaitable[T]) -> T:
        """``request``'s result; raises Stopped (cancelling it) once asked to stop."""
        answered = await unless_stopped(request, self.stop)
        if answered is None:
            raise Stopped
        return answered.result()

    # -- the ledger, the vault, the roster -----------------------------------------

    async def _fetch_roster(self, action: act.FetchRoster) -> act.RosterFetched:
        keys = await self.roster.keys(self.client, action.federation_id, serial=action.serial)
        return act.RosterFetched(keys)

    async def _charge(self, action: act.Charge) -> act.Charged:
        request = action.request
        index = -1  # nothing charged: nothing to declare
        unreported: tuple[wire.ChargeRecord, ...] = ()
        if request.dp_enabled:
            try:
                charged = self.ledger.charge(self.dataset_id, request.round, *request.cost)
            except BudgetExhausted as exc:
                log.error(
                    "privacy_budget_exhausted dataset=%s reason=%r", self.dataset_id, exc.detail
                )
                raise
            epsilon, index = charged.epsilon, charged.index
            if len(charged.unreported) > MAX_UNREPORTED_CHARGES:
                # the audit will find this member's ε above what its log entries give
                log.warning(
                    "privacy_unreported_truncated dataset=%s unreported=%d declared=%d",
                    self.dataset_id,
                    len(charged.unreported),
                    MAX_UNREPORTED_CHARGES,
                )
            unreported = tuple(
                wire.ChargeRecord(i, c.round, c.noise_multiplier, c.sample_rate, c.steps)
                for i, c in charged.unreported[-MAX_UNREPORTED_CHARGES:]
            )
        else:
            # allowed only with privacy.require_dp = false (simulations on public data)
            epsilon = self.ledger.spent(self.dataset_id)
            log.warning("training_without_dp round=%d dataset=%s", request.round, self.dataset_id)
        log.info(
            "privacy_charged round=%d dataset=%s steps=%d sample_rate=%.4f noise=%g epsilon=%.3f",
            request.round,
            self.dataset_id,
            request.steps,
            request.sample_rate,
            request.noise_multiplier,
            epsilon,
        )
        charge = PrivacyCharge(
            request.key,
            epsilon,
            request.steps,
            request.sample_rate,
            trained_round=request.round,
            index=index,
            unreported=unreported,
        )
        return act.Charged(charge)

    async def _check_budget(self, action: act.CheckBudget) -> act.BudgetChecked:
        self.ledger.check_can_train(self.dataset_id, action.round, *action.cost)
        return act.BudgetChecked()

    async def _report_taken(self, action: act.ReportTaken) -> act.Passed:
        self.ledger.mark_reported(self.dataset_id, action.index)
        return act.Passed()

    async def _keep_update(self, action: act.KeepUpdate) -> act.UpdateKept:
        return act.UpdateKept(
            self.vault.keep_update_once(action.round, action.attempt, action.quantized)
        )

    async def _release(self, action: act.Release) -> act.Passed:
        if action.index >= 0:  # -1: trained without DP, nothing charged to release
            try:
                self.ledger.record_release(
                    self.dataset_id, action.index, action.round, action.attempt
                )
            except IntegrityError as exc:
                log.error(
                    "update_release_refused dataset=%s reason=%r", self.dataset_id, exc.detail
                )
                raise
        log.info(
            "update_released round=%d attempt=%d charge_index=%d",
            action.round,
            action.attempt,
            action.index,
        )
        return act.Passed()

    async def _encrypt(self, action: act.Encrypt) -> act.Encrypted:
        context = await self._he.for_spec(self.client, action.spec)
        return act.Encrypted(await encrypt_update(context, action.quantized))

    # -- the stage messages, through the seam --------------------------------------

    async def _route_stages(self, action: act.RouteStages) -> act.Passed:
        if isinstance(self.seam, StarSeam):  # another topology has no aggregator to skip
            self.seam.route(action.round, action.attempt, action.url)
        return act.Passed()

    async def _stage_upload(self, action: act.StageUpload) -> act.UploadAnswered:
        answer = self.seam.send(action.round, action.attempt, action.body, action.wait)
        return act.UploadAnswered(await self.unless_stopped(answer))

    async def _stage_fetch(self, action: act.StageFetch) -> act.StageData:
        r, a, kind = action.round, action.attempt, action.answer.kind
        answer: Awaitable[act.StageAnswer] = self.seam.answer(r, a, kind, action.wait)
        return action.answer(await self.unless_stopped(answer))

    async def _send_masked_input(self, action: act.SendMaskedInput) -> act.MaskedInputAnswered:
        receipt, request = await self.seam.contribute(
            action.round, action.attempt, action.vector, action.statement, action.wait
        )
        return act.MaskedInputAnswered(receipt, request)

    async def _record(self, action: act.Record) -> act.Passed:
        self.vault.save_receipt(action.receipt)
        self.vault.save_record(action.record)
        return act.Passed()

    async def _fault_point(self, action: act.FaultPoint) -> act.Passed:
        self._faults.crash(action.round, action.point)
        return act.Passed()


def _subclasses(base: type[T]) -> list[type[T]]:
    """Every subclass of ``base``, at any depth."""
    found = []
    for sub in base.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


async def _as(event: Callable[[T], act.Event], request: Awaitable[T]) -> act.Event:
    return event(await request)


async def _passed(request: Awaitable[object]) -> act.Event:
    await request
    return act.Passed()
