"""The agent's main loop: follow the aggregator's rounds, train under DP, contribute securely.

One round attempt, as the agent sees it (stages of :data:`fedsec.protocol.stages.Stage`)::

    open ──► join (schema fingerprint, task version, sample count)
    spec with us in the cohort ──► verify spec signature and task ──► charge the
        privacy ledger ──► download + verify the spec's model ──► train (DP-SGD)
        ──► signed privacy report
    secagg:  advertise keys ─► share_keys   (while training: neither needs the update)
             ─► masked_input (+ receipt) ─► unmask ─► closed
    none:    masked_input (plain quantized vector, + receipt) ─► closed

SecAgg+'s key stages run concurrently with local training: the two round trips
and the aggregator's stage changes then cost no wall time after training, which
is what made secure summation ~1.5x slower than plain summation when rounds are
short.  The aggregator's masked_input deadline includes the training time.

The agent long-polls ``GET /round`` with the last token it saw and reacts to each
state; if the attempt is aborted or a new one starts, the half-done session is
dropped and the agent follows the newest state.  Catching up after missed rounds
needs nothing special: every round names the model version to start from and
the agent downloads exactly that one.

Privacy: the ledger is charged (checked and recorded durably, in one locked step)
*before* training, so a crash can never spend privacy off the books.  A retried
attempt of the same round reuses the update already trained on the same model
with the same settings instead of training (and spending) again.  Rounds that ask
for training without DP are refused: this agent's promise to its data owner is
DP-SGD on every round.

Failures are split in three.  Temporary refusals (429 rate limited, 503 busy,
408 body timeout, 401 replayed) are retried by the client; when its retries run
out the agent still outlives them: a poll of the round state waits and asks
again, anything else drops this agent from the attempt.  Round-local ones (a
stage missed, a 409 from the aggregator, a relayed key list that does not verify)
drop this agent from the attempt with a warning and it waits for the next.
Everything else (spec or manifest signatures that do not verify, a task
mismatch, an exhausted budget, an unreachable aggregator, a key that is not on
the roster or may not do this, a clock the aggregator still refuses after the
client corrected it) ends :meth:`AgentRuntime.run` with the error, whose sentence
the CLI prints.

Logs are ``event key=value``; they never carry keys, shares, seeds or vectors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeVar, cast

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from fedsec.agent.client import AggregatorClient
from fedsec.agent.device import resolve_device
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.training import DPParams, fresh_seed, plan_round, train_local
from fedsec.agent.vault import RoundRecord, Vault
from fedsec.aggregator.roster import verify_roster_entry
from fedsec.config import AgentConfig, DataSection
from fedsec.crypto.commitment import CommitmentContext, commit, seal_reveal
from fedsec.crypto.identity import SigningIdentity, load_public_key, save_public_key
from fedsec.crypto.quantize import RingVector, pack, quantize
from fedsec.crypto.secagg import (
    ClientSession,
    UnmaskRequest,
)
from fedsec.errors import (
    AggregatorRefused,
    BudgetExhausted,
    ClockSkewError,
    ConfigError,
    DuplicateMessage,
    FedsecError,
    IntegrityError,
    NotFound,
    PayloadError,
    ProtocolError,
    ReplayError,
    RequestTimeout,
    RetryLater,
    SignatureError,
    StaleUpdate,
    TaskMismatch,
    WrongStage,
)
from fedsec.faults import crash_point, deterministic_bytes
from fedsec.modelfile import decode_model, verify_manifest
from fedsec.protocol import codec
from fedsec.protocol.limits import LONG_POLL_S
from fedsec.protocol.stages import Stage, stage_index
from fedsec.protocol.wire import (
    Accepted,
    ContributionStatement,
    JoinRequest,
    PrivacyReport,
    Receipt,
    RevealBody,
    RevealPayload,
    RoundSpec,
    RoundState,
    ShareRelayBody,
    UnmaskRequestBody,
    unhex,
)
from fedsec.tasks import Task, TrainingParams, check_schema, get_task, parse_partition
from fedsec.tasks.params import arrays_to_state, flatten_params, param_count

__all__ = [
    "ADMIN_KEY_FILE",
    "IDENTITY_FILE",
    "AgentRuntime",
    "LocalData",
    "RoundOutcome",
    "check_spec_task",
    "load_local_data",
    "member_weight",
    "verify_round_spec",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The agent's signing key, in its state directory (written 0600 by ``fedsec agent init``).
IDENTITY_FILE: Final = "identity.key"
#: The roster admin key, pinned on first use (see :meth:`AgentRuntime._roster`).
ADMIN_KEY_FILE: Final = "roster_admin.pub"
#: Long-poll wait asked of the aggregator: the longest it holds one.
POLL_TIMEOUT_S: Final = LONG_POLL_S
#: A server that answers a long poll at once with an unchanged token would make the
#: agent spin; it waits this long before polling again.
MIN_REPOLL_S: Final = 0.25
#: Allowance over the raw float32 size of the local model when downloading a model
#: file: the safetensors header is ~100 bytes per tensor, so 1 MiB covers ~10k tensors.
MODEL_HEADER_SLACK_BYTES: Final = 1024 * 1024
#: Statuses whose 4xx answers mean "not in this attempt any more", not "stop the agent".
_ROUND_LOCAL_STATUSES: Final = frozenset({404, 409, 410, 425})

OutcomeStatus = Literal["closed", "aborted", "missed", "dropped"]


@dataclass(frozen=True)
class RoundOutcome:
    """How one round attempt in which this agent was in the cohort ended for it.

    ``status``: ``closed`` (contributed; the round aggregated), ``aborted``
    (the attempt was abandoned; another may follow), ``missed`` (a stage passed
    before the agent was ready), ``dropped`` (a round-local error, in ``detail``).
    """

    round: int
    attempt: int
    status: OutcomeStatus
    model_version: int
    epsilon: float | None = None
    samples: int = 0
    weight: float | None = None
    receipt: Receipt | None = None
    detail: str = ""


@dataclass(frozen=True)
class LocalData:
    """This member's task and its share of the training data."""

    task: Task
    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]

    @property
    def samples(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class _TrainedUpdate:
    """An update trained for one round, reusable by a retried attempt of that round."""

    key: tuple[object, ...]
    delta: npt.NDArray[np.float32]
    epsilon: float  # total spent on the dataset once this round was charged
    steps: int
    sample_rate: float
    base_version: int = 0  # the model version it was trained from
    trained_round: int = -1  # the round the ledger charged for this training


@dataclass(frozen=True)
class _Charge:
    """What one training costs, charged to the privacy ledger before it starts."""

    key: tuple[object, ...]
    epsilon: float  # total spent on the dataset once this round was charged
    steps: int
    sample_rate: float
    trained_round: int


@dataclass(frozen=True)
class _Contribution:
    """What this member puts into one attempt."""

    trained: _TrainedUpdate
    samples: int
    weight: float
    quantized: RingVector


class _AttemptOver(Exception):
    """The attempt we were in ended (aborted, replaced, or the round moved on)."""

    def __init__(self, state: RoundState) -> None:
        super().__init__(f"round {state.round} attempt {state.attempt} stage {state.stage}")
        self.state = state


class _StageMissed(Exception):
    def __init__(self, state: RoundState, wanted: str) -> None:
        super().__init__(f"stage {wanted} already passed (now {state.stage})")
        self.state = state


class _Stopped(Exception):
    """The caller asked the runtime to stop."""


# ----------------------------------------------------------------------- pure checks


def verify_round_spec(spec: RoundSpec, aggregator_public: bytes) -> None:
    """Check that the aggregator whose key we pinned signed ``spec``.

    Raises:
        SignatureError: "round spec signature does not verify: ..." naming the key.
    """
    try:
        spec.verify(aggregator_public)
    except (SignatureError, PayloadError) as exc:
        raise SignatureError(
            f"round spec signature does not verify: {exc.detail}; the spec of round "
            f"{spec.round} was not signed by the aggregator key in agent.toml "
            f"({aggregator_public.hex()[:16]}...)"
        ) from None


def check_spec_task(spec: RoundSpec, task: Task, dim: int) -> None:
    """Refuse a round whose task, task version, data schema or model size differs from ours.

    Raises:
        TaskMismatch: naming the difference.
    """
    if spec.task != task.name:
        raise TaskMismatch(
            f"round {spec.round} trains task {spec.task!r} but this agent is set up for "
            f"{task.name!r} (data.task in agent.toml)"
        )
    if spec.task_version != task.version:
        raise TaskMismatch(
            f"round {spec.round} requires task {spec.task!r} version {spec.task_version!r} "
            f"but this agent runs version {task.version!r}; upgrade fedsec on the older side"
        )
    check_schema(spec.schema_fingerprint, task)
    if spec.dim != dim:
        raise TaskMismatch(
            f"round {spec.round} has {spec.dim} model parameters but the local "
            f"{task.name!r} model has {dim}"
        )


def member_weight(samples: int, spec: RoundSpec, member: str) -> float:
    """w = min(1, samples / max_weight_samples, this member's cap from the roster)."""
    cap = float(spec.weight_caps.get(member, 1.0))
    return float(max(0.0, min(1.0, samples / spec.max_weight_samples, cap)))


def training_params(spec: RoundSpec, task: Task) -> TrainingParams:
    """Local optimiser settings of the round.  Momentum is not in the spec: the task's.

    Raises:
        ConfigError: an unknown optimiser or invalid values.
    """
    optimizer = spec.training.optimizer
    if optimizer not in ("sgd", "adam"):
        raise ConfigError(f"round {spec.round} asks for unknown optimizer {optimizer!r}")
    return TrainingParams(
        lr=spec.training.lr,
        batch_size=spec.training.batch_size,
        local_epochs=spec.training.local_epochs,
        optimizer=cast(Literal["sgd", "adam"], optimizer),
        momentum=task.defaults.momentum if optimizer == "sgd" else 0.0,
    )


def load_local_data(data: DataSection) -> LocalData:
    """Build the task and this member's part of its training data.

    Raises:
        ConfigError: unknown task, bad options or partition, unreadable CSV.
    """
    options = dict(data.task_options)
    if data.csv:
        if data.task != "csv":
            raise ConfigError(
                f'data.csv is set but data.task is {data.task!r}; set data.task = "csv"'
            )
        options["path"] = data.csv
    task = get_task(data.task, **options)
    dataset = task.load()
    x, y = dataset.x_train, dataset.y_train
    if data.parts > 1:
        parts = parse_partition(data.partition).apply(y, data.parts, data.seed)
        index = parts[data.part_index]
        x, y = x[index], y[index]
    return LocalData(task=task, x=x, y=y)


# --------------------------------------------------------------- wire <-> secagg


# Masks for a vector this small (~1 ms for the MNIST-1D CNN's 5,210 parameters) are
# computed on the event loop: a worker thread costs two GIL hand-offs and a wake-up,
# measured 0.05 s a round slower with 50 agents sharing one process.
INLINE_MASKING_MAX_DIM = 100_000


def _is_temporary(exc: FedsecError) -> bool:
    """A refusal the agent outlives once the client's retries ran out on it: the same
    request, signed anew, may pass later (rate limit, busy, body timeout, nonce store
    full).  Clock skew is not: the client already corrected by the server's clock."""
    if isinstance(exc, ClockSkewError):
        return False
    return isinstance(exc, RetryLater | RequestTimeout | ReplayError)


def _temporary_wait(exc: FedsecError, longest_s: float) -> float:
    """Seconds to wait after a temporary refusal outlasted the client's retries: the
    server's Retry-After or the client's longest backoff, never under MIN_REPOLL_S so
    a ``Retry-After: 0`` cannot make the agent spin."""
    wait = min(exc.retry_after, longest_s) if isinstance(exc, RetryLater) else longest_s
    return max(wait, MIN_REPOLL_S)


def _is_round_local(exc: FedsecError) -> bool:
    if isinstance(exc, ProtocolError | NotFound) or _is_temporary(exc):
        return True
    return isinstance(exc, AggregatorRefused) and exc.http_status in _ROUND_LOCAL_STATUSES


# ----------------------------------------------------------------------------- runtime


class AgentRuntime:
    """Runs one data owner's agent against its aggregator.

    Args:
        config: the validated ``agent.toml``.
        identity: the agent's signing key (its public half must be the roster's).
        progress: show a progress bar while training.
        client: an aggregator client to use (tests); default one built from config.
        poll_timeout_s: long-poll wait asked of the aggregator.
        training_executor: where local training runs (default: asyncio's default
            executor).  Simulations that host many agents in one process pass one
            pool with a thread per core: more training threads than cores only
            contend for the GIL with the event loop that runs every agent's protocol.
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
    ) -> None:
        self.config = config
        self.identity = identity
        self.member = config.agent.id
        self.progress = progress
        self.poll_timeout_s = poll_timeout_s
        self.slowdown = slowdown  # simulations only: this member trains slowdown x slower
        self._training_executor = training_executor
        self._verified_roster: set[tuple[bytes, str, bytes, str]] = set()
        self._roster_cache: dict[str, tuple[int, dict[str, bytes]]] = {}
        self.state_dir = Path(config.agent.state_dir)
        self.aggregator_public = config.agent.aggregator_public_key_bytes
        self.dataset_id = config.data.effective_dataset_id()
        self.ledger = PrivacyLedger(self.state_dir)
        self.vault = Vault(self.state_dir)
        self._client = client
        self._stop = asyncio.Event()
        self._local: LocalData | None = None
        self._device: torch.device | None = None
        self._federation: str | None = None
        self._joined: set[tuple[int, int]] = set()
        self._handled: set[tuple[int, int]] = set()
        self._update: _TrainedUpdate | None = None
        # charged, but its training has produced no update yet (the model download was
        # refused, the attempt dropped): a retry trains on this charge, not a new one
        self._unused_charge: _Charge | None = None
        self._model: tuple[int, str, dict[str, npt.NDArray[np.float32]]] | None = None
        self._last_cost: tuple[float, float, int] | None = None
        self._receipts: dict[tuple[int, int], Receipt] = {}

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
            self._local = load_local_data(self.config.data)
            privacy = self.config.privacy
            known = self.dataset_id in self.ledger.datasets()
            budget = self.ledger.budget(self.dataset_id) if known else None
            if budget is None or (budget.epsilon, budget.delta) != (privacy.epsilon, privacy.delta):
                self.ledger.set_budget(self.dataset_id, privacy.epsilon, privacy.delta)
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
        outcomes: list[RoundOutcome] = []
        try:
            state = await self._poll(client, None)
            while True:
                if state.finished:
                    log.info("federation_finished rounds_completed=%d", state.rounds_completed)
                    break
                key = (state.round, state.attempt)
                following: RoundState | None = None
                if state.stage == "open" and key not in self._joined and state.spec is None:
                    if state.mode == "buffered":
                        if not await self._train_for_buffer_outliving_refusals(client, state):
                            # not joined untrained: try again once the round state changes
                            state = await self._poll(client, state.token)
                            continue
                        state = await self._poll(client, None)  # training took a while
                        key = (state.round, state.attempt)
                    fresh = state.stage == "open" and key not in self._joined
                    if fresh and state.spec is None and not await self._join(client, state):
                        # refused as stale: retrain on the newest model now, rather
                        # than wait for the next change of round state
                        state = await self._poll(client, None)
                        continue
                spec = state.spec
                if (
                    spec is not None
                    and key not in self._handled
                    and self.member in spec.cohort
                    and state.stage not in ("closed", "aborted")
                ):
                    self._handled.add(key)
                    outcome, following = await self._participate(client, state, spec)
                    outcomes.append(outcome)
                    await self._answer_quietly(client, spec.federation_id)
                    closed = sum(1 for o in outcomes if o.status == "closed")
                    if max_rounds is not None and closed >= max_rounds:
                        break
                state = following or await self._poll(client, state.token)
        except _Stopped:
            log.info("agent_stopped member=%s", self.member)
        finally:
            if self._client is None:
                await client.close()
        return outcomes

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
        auditors = await self._roster(client, federation_id, role="auditor")
        answered = 0
        for ch in pending.challenges:
            key = auditors.get(ch.auditor)
            if key is None:
                log.warning("challenge_ignored auditor=%s reason=not_an_active_auditor", ch.auditor)
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
            await _tolerate_duplicate(
                client.reveal(RevealBody(ch.round, ch.attempt, ch.auditor, sealed.hex()))
            )
            answered += 1
            log.info("challenge_answered round=%d auditor=%s", ch.round, ch.auditor)
        return answered

    async def _answer_quietly(self, client: AggregatorClient, federation_id: str) -> None:
        try:
            await self.answer_challenges(client, federation_id)
        except FedsecError as exc:
            log.warning("challenges_unanswered reason=%r", exc.detail)

    async def _poll(self, client: AggregatorClient, token: int | None) -> RoundState:
        """The next round state (long-polled on ``token``), or _Stopped when asked to stop."""
        started = time.monotonic()
        wait = 0.0 if token is None else self.poll_timeout_s
        state = await self._round_state(client, token, wait)
        if self._federation is None:
            self._federation = state.federation_id
        elif state.federation_id != self._federation:
            raise IntegrityError(
                f"aggregator switched federation from {self._federation!r} to "
                f"{state.federation_id!r}"
            )
        if token is not None and state.token == token and time.monotonic() - started < 0.05:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), MIN_REPOLL_S)
        return state

    async def _round_state(
        self, client: AggregatorClient, token: int | None, wait: float
    ) -> RoundState:
        """``GET /round``, asked again after a temporary refusal until it is answered.

        Raises:
            _Stopped: asked to stop, also while waiting to ask again.
            FedsecError: any other refusal.
        """
        while True:
            try:
                return await self._unless_stopped(client.get_round(token, wait))
            except FedsecError as exc:
                if not _is_temporary(exc):
                    raise
                pause = _temporary_wait(exc, client.backoff_max_s)
                log.warning("round_poll_refused retry_in_s=%.2f reason=%r", pause, exc.detail)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), pause)
            if self._stop.is_set():
                raise _Stopped

    async def _unless_stopped(self, request: Awaitable[T]) -> T:
        """``request``'s result; raises _Stopped (cancelling it) once asked to stop."""
        if self._stop.is_set():
            raise _Stopped
        fetch = asyncio.ensure_future(request)
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({fetch, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (fetch, stopper):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if fetch not in done:
            raise _Stopped
        return fetch.result()

    async def _stage_data(
        self,
        client: AggregatorClient,
        state: RoundState,
        stage: Stage,
        fetch: Callable[[float], Awaitable[T]],
    ) -> tuple[T, RoundState]:
        """The data of ``stage`` for this member: long-polled in one request (``fetch``
        with a wait); when that answers before the stage (wait over, attempt aborted),
        fall back to polling the round state, then fetch at once.

        Returns:
            The data, and the newest round state seen (``state`` when none was polled).
        """
        try:
            return await self._unless_stopped(fetch(self.poll_timeout_s)), state
        except WrongStage:
            current = await self._wait_for(client, state, (stage,))
            return await self._unless_stopped(fetch(0.0)), current

    async def _wait_for(
        self,
        client: AggregatorClient,
        state: RoundState,
        stages: Iterable[Stage],
        attempt: tuple[int, int] | None = None,
    ) -> RoundState:
        """Long-poll until the attempt (round, attempt) — by default that of ``state`` —
        reaches one of ``stages``.

        Raises:
            _AttemptOver: the attempt was aborted or another round/attempt began.
            _StageMissed: the attempt is already past every stage in ``stages``.
        """
        wanted = tuple(stages)
        key = attempt or (state.round, state.attempt)
        latest = max(stage_index(s) for s in wanted)
        current = state
        while True:
            if (current.round, current.attempt) != key or current.stage == "aborted":
                raise _AttemptOver(current)
            if current.stage in wanted:
                return current
            if stage_index(current.stage) > latest:
                raise _StageMissed(current, "/".join(wanted))
            current = await self._poll(client, current.token)

    async def _join(self, client: AggregatorClient, state: RoundState) -> bool:
        """Ask for a seat in the cohort; False when the update must be retrained first."""
        local = self.prepare()
        key = (state.round, state.attempt)
        self._joined.add(key)
        if self._last_cost is not None:
            # The last round's cost is the best guess of this one's: do not take a cohort
            # seat that the budget could not pay for.
            self.ledger.check_can_train(self.dataset_id, state.round, *self._last_cost)
        request = JoinRequest(
            dataset_schema=local.task.schema.fingerprint(),
            task_version=local.task.version,
            samples=local.samples,
            base_version=(
                self._update.base_version
                if state.mode == "buffered" and self._update is not None
                else None
            ),
        )
        try:
            answer = await client.join(state.round, state.attempt, request)
        except DuplicateMessage:
            log.info("round_join_duplicate round=%d attempt=%d", *key)
            return True
        except StaleUpdate as exc:
            log.warning("round_join_stale round=%d attempt=%d reason=%r", *key, exc.detail)
            self._update = None  # retrain on the newest model
            self._joined.discard(key)
            return False
        except FedsecError as exc:
            if not _is_round_local(exc):
                raise
            log.warning("round_join_refused round=%d attempt=%d reason=%r", *key, exc.detail)
            return True
        if answer.accepted:
            log.info("round_joined round=%d attempt=%d samples=%d", *key, local.samples)
        else:
            log.warning("round_join_rejected round=%d attempt=%d reason=%r", *key, answer.detail)
        return True

    async def _train_for_buffer_outliving_refusals(
        self, client: AggregatorClient, state: RoundState
    ) -> bool:
        """:meth:`_train_for_buffer`; False when a temporary refusal (of the model
        download) left the agent without an update to join with."""
        try:
            await self._train_for_buffer(client, state)
        except FedsecError as exc:
            if not _is_temporary(exc):
                raise
            log.warning("buffer_training_deferred round=%d reason=%r", state.round, exc.detail)
            return False
        return True

    async def _train_for_buffer(self, client: AggregatorClient, state: RoundState) -> None:
        """Buffered mode: train on the newest signed plan before joining, unless an
        update is already waiting."""
        if self._update is not None or state.plan is None:
            return
        plan = state.plan
        verify_round_spec(plan, self.aggregator_public)
        local = self.prepare()
        model = local.task.build_model(0)
        check_spec_task(plan, local.task, param_count(model))
        await self._train(client, plan, local, model)

    async def _participate(
        self, client: AggregatorClient, state: RoundState, spec: RoundSpec
    ) -> tuple[RoundOutcome, RoundState | None]:
        """Take part in one attempt; return its outcome and the newest state seen."""
        verify_round_spec(spec, self.aggregator_public)
        r, a = state.round, state.attempt
        if (spec.federation_id, spec.round, spec.attempt) != (state.federation_id, r, a):
            log.warning(
                "round_spec_mismatch round=%d attempt=%d spec_round=%d spec_attempt=%d",
                r,
                a,
                spec.round,
                spec.attempt,
            )
            return self._outcome(spec, "dropped", detail="spec names another round"), None
        first_stage = "advertise" if spec.secure_sum == "secagg" else "masked_input"
        if stage_index(state.stage) > stage_index(first_stage):
            # Joined before a restart, back too late: training now would spend privacy
            # on an update that can no longer be sent.
            detail = f"stage {first_stage} already passed (now {state.stage})"
            log.warning("round_missed round=%d attempt=%d reason=%r", r, a, detail)
            return self._outcome(spec, "missed", detail), None
        local = self.prepare()
        model = local.task.build_model(0)
        check_spec_task(spec, local.task, param_count(model))
        weight = member_weight(local.samples, spec, self.member)
        # FedBuff: a stale update counts less, s(τ) = (1 + τ)^-½.  It scales the update,
        # not the weight: the aggregator divides by Σ w, which would cancel a discount
        # shared by the whole buffer.  Applied here since the aggregator sees only sums.
        discount = (
            (1.0 + spec.staleness.get(self.member, 0)) ** -0.5 if spec.mode == "buffered" else 1.0
        )
        base = RoundOutcome(r, a, "dropped", spec.model_version, samples=local.samples)
        receipt: Receipt | None = None
        try:
            session: ClientSession | None = None
            current = state
            if spec.secure_sum == "secagg":
                # Before training: a roster or parameters that do not check out must not
                # cost any privacy.
                roster = await self._roster(client, spec.federation_id, serial=state.roster_serial)
                session = ClientSession(spec.secagg_params(), self.member, self.identity, roster)
                charge = self._charge(spec, local)
                # the report rides with the shares: one request fewer than POST /report
                report = self._privacy_report(spec, local, charge)
                trained, current, relay, reported = await self._train_during_key_setup(
                    client, state, spec, session, local, model, charge, report
                )
            else:
                trained = await self._train(client, spec, local, model)
                reported = False
            base = RoundOutcome(
                r, a, "dropped", spec.model_version, trained.epsilon, local.samples, weight
            )
            if not reported:
                await self._report(client, spec, local, trained)
            rounding = deterministic_bytes(self.member, spec.round, "rounding") or os.urandom(32)
            q = quantize(trained.delta * np.float32(discount), weight, spec.quant_spec(), rounding)
            contribution = _Contribution(trained, local.samples, weight, q)
            if session is not None:
                receipt, current = await self._secagg_round(
                    client, current, spec, session, contribution, relay
                )
            else:
                receipt, current = await self._plain_round(client, current, spec, contribution)
            if spec.mode == "buffered":
                self._update = None  # consumed: the next buffer gets a freshly trained update
            if current.round > r:
                final = current  # the held unmask answer came once our round had closed
            else:
                final = await self._wait_for(client, current, ("closed",), attempt=(r, a))
            log.info("round_closed round=%d attempt=%d", r, a)
            return _with(base, "closed", receipt), final
        except _AttemptOver as over:
            receipt = self._receipts.get((r, a))
            now = over.state
            status: OutcomeStatus = "aborted"
            if receipt is not None and now.round > r:
                status = "closed"  # the round moved on after taking our contribution
            log.info(
                "round_attempt_over round=%d attempt=%d status=%s now_round=%d now_attempt=%d "
                "stage=%s",
                r,
                a,
                status,
                now.round,
                now.attempt,
                now.stage,
            )
            return _with(base, status, receipt), now
        except _StageMissed as missed:
            receipt = self._receipts.get((r, a))
            log.warning("round_missed round=%d attempt=%d reason=%r", r, a, str(missed))
            return _with(base, "missed", receipt, str(missed)), missed.state
        except FedsecError as exc:
            if not _is_round_local(exc):
                raise
            receipt = self._receipts.get((r, a))
            log.warning("round_dropped round=%d attempt=%d reason=%r", r, a, exc.detail)
            return _with(base, "dropped", receipt, exc.detail), None

    def _outcome(self, spec: RoundSpec, status: OutcomeStatus, detail: str) -> RoundOutcome:
        return RoundOutcome(spec.round, spec.attempt, status, spec.model_version, detail=detail)

    # -- training -------------------------------------------------------------------

    async def _train(
        self,
        client: AggregatorClient,
        spec: RoundSpec,
        local: LocalData,
        model: torch.nn.Module,
        charge: _Charge | _TrainedUpdate | None = None,
    ) -> _TrainedUpdate:
        """Charge the ledger (unless ``charge`` is what :meth:`_charge` returned), fetch
        the spec's model and train; reuse a retried round's update."""
        if charge is None:
            charge = self._charge(spec, local)
        if isinstance(charge, _TrainedUpdate):
            return charge
        params = training_params(spec, local.task)
        await self._load_global_model(client, spec, model)
        before = flatten_params(model)
        dp = (
            DPParams(spec.dp.noise_multiplier, spec.dp.max_grad_norm, spec.dp.delta)
            if spec.dp.enabled
            else None
        )
        assert self._device is not None
        result = await asyncio.get_running_loop().run_in_executor(
            self._training_executor,
            functools.partial(
                train_local,
                model,
                local.x,
                local.y,
                params,
                dp,
                self._device,
                _training_seed(self.member, spec.round),
                self.progress,
            ),
        )
        if result.steps != charge.steps or abs(result.sample_rate - charge.sample_rate) > 1e-12:
            log.warning(
                "privacy_plan_differs round=%d planned_steps=%d steps=%d planned_rate=%g rate=%g",
                spec.round,
                charge.steps,
                result.steps,
                charge.sample_rate,
                result.sample_rate,
            )
        delta = (flatten_params(model) - before).astype(np.float32)
        log.info(
            "round_trained round=%d steps=%d loss=%.4f seconds=%.1f",
            spec.round,
            result.steps,
            result.train_loss,
            result.duration_s,
        )
        if self.slowdown > 1.0:
            # simulations of slow members only: stretch training to slowdown x its time
            await asyncio.sleep((self.slowdown - 1.0) * result.duration_s)
        self._unused_charge = None  # spent on this update; another training is charged anew
        self._update = _TrainedUpdate(
            charge.key,
            delta,
            charge.epsilon,
            charge.steps,
            charge.sample_rate,
            base_version=spec.model_version,
            trained_round=charge.trained_round,
        )
        return self._update

    def _charge(self, spec: RoundSpec, local: LocalData) -> _Charge | _TrainedUpdate:
        """Charge the privacy ledger for training on ``spec``, before training starts; or
        return the update a retried attempt (or a buffered member) reuses, charged when
        it was trained.

        Raises:
            ConfigError: the round trains without DP and this agent requires it.
            BudgetExhausted: the charge would exceed the budget.
        """
        params = training_params(spec, local.task)
        key: tuple[object, ...] = (spec.federation_id, spec.round, spec.model_version)
        key += (spec.model_sha256, spec.training, spec.dp)
        if self._update is not None and self._update.key == key:
            log.info("round_update_reused round=%d attempt=%d", spec.round, spec.attempt)
            return self._update
        if spec.mode == "buffered" and spec.cohort and self._update is not None:
            # buffered: the update was trained before joining, on the version we named
            base = spec.model_version - spec.staleness.get(self.member, 0)
            if self._update.base_version == base:
                return self._update
        if self._unused_charge is not None and self._unused_charge.key == key:
            log.info("privacy_charge_reused round=%d attempt=%d", spec.round, spec.attempt)
            return self._unused_charge
        if not spec.dp.enabled and self.config.privacy.require_dp:
            raise ConfigError(
                f"round {spec.round} asks for training without differential privacy; this "
                "agent trains only with DP-SGD, so it refuses (ask the operator to set "
                "dp.enabled = true)"
            )
        sample_rate, steps = plan_round(local.samples, params)
        cost = (spec.dp.noise_multiplier, sample_rate, steps)
        self._last_cost = cost
        if spec.dp.enabled:
            try:
                epsilon = self.ledger.charge(self.dataset_id, spec.round, *cost)
            except BudgetExhausted as exc:
                log.error(
                    "privacy_budget_exhausted dataset=%s reason=%r", self.dataset_id, exc.detail
                )
                raise
        else:
            # allowed only with privacy.require_dp = false (simulations on public data)
            epsilon = self.ledger.spent(self.dataset_id)
            log.warning("training_without_dp round=%d dataset=%s", spec.round, self.dataset_id)
        log.info(
            "privacy_charged round=%d dataset=%s steps=%d sample_rate=%.4f noise=%g epsilon=%.3f",
            spec.round,
            self.dataset_id,
            steps,
            sample_rate,
            spec.dp.noise_multiplier,
            epsilon,
        )
        self._unused_charge = _Charge(key, epsilon, steps, sample_rate, trained_round=spec.round)
        return self._unused_charge

    async def _load_global_model(
        self, client: AggregatorClient, spec: RoundSpec, model: torch.nn.Module
    ) -> None:
        """Download the spec's model version, verify manifest and hash, load it into ``model``.

        Raises:
            IntegrityError / SignatureError: the manifest or file does not verify, or it
                is not the model the spec names.
        """
        state = model.state_dict()
        if self._model is None or self._model[:2] != (spec.model_version, spec.model_sha256):
            manifest = await client.manifest(spec.model_version)
            if manifest.sha256 != spec.model_sha256:
                raise IntegrityError(
                    f"round {spec.round} names model v{spec.model_version} with sha256 "
                    f"{spec.model_sha256[:16]}..., but its manifest says {manifest.sha256[:16]}..."
                )
            limit = sum(t.numel() for t in state.values()) * 4 + MODEL_HEADER_SLACK_BYTES
            data = await client.model_bytes(spec.model_version, limit)
            verify_manifest(
                manifest, self.aggregator_public, data, federation_id=spec.federation_id
            )
            arrays = decode_model(
                data,
                max_bytes=limit,
                expected_names=list(state),
                expected_shapes={k: tuple(v.shape) for k, v in state.items()},
            )
            self._model = (spec.model_version, spec.model_sha256, arrays)
            log.info("model_downloaded version=%d bytes=%d", spec.model_version, len(data))
        arrays_to_state(model, {k: v.copy() for k, v in self._model[2].items()})

    def _privacy_report(
        self, spec: RoundSpec, local: LocalData, charged: _Charge | _TrainedUpdate
    ) -> PrivacyReport:
        """The signed report of what this attempt's training was charged."""
        return PrivacyReport(
            federation_id=spec.federation_id,
            round=spec.round,
            attempt=spec.attempt,
            member=self.member,
            dataset_id=self.dataset_id,
            epsilon=charged.epsilon,
            delta=self.config.privacy.delta,
            noise_multiplier=spec.dp.noise_multiplier,
            sample_rate=charged.sample_rate,
            steps=charged.steps,
            samples=local.samples,
            trained_round=charged.trained_round,
        ).sign(self.identity)

    async def _report(
        self, client: AggregatorClient, spec: RoundSpec, local: LocalData, trained: _TrainedUpdate
    ) -> None:
        report = self._privacy_report(spec, local, trained)
        with contextlib.suppress(DuplicateMessage):
            await client.report(spec.round, spec.attempt, report)
        log.info("privacy_reported round=%d epsilon=%.3f", spec.round, trained.epsilon)

    # -- contributing ---------------------------------------------------------------

    async def _roster(
        self,
        client: AggregatorClient,
        federation_id: str,
        role: str = "agent",
        serial: int = 0,
    ) -> dict[str, bytes]:
        """Active members' public keys of ``role`` from the admin-signed roster.

        The admin key is pinned on first use in ``state_dir/roster_admin.pub`` and a
        different one is refused afterwards: the aggregator serves the roster, so
        without the pin it could sign a roster of its own and substitute keys.

        Raises:
            SignatureError: the admin key changed, an entry does not verify, or the
                roster holds a different key for this agent.
        """
        cached = self._roster_cache.get(role)
        if serial and cached is not None and cached[0] == serial:
            return cached[1]  # unchanged since the last round (the serial says so)
        body = await client.roster()
        admin = unhex(body.admin_public_key, "roster admin public key", 32)
        pinned_path = self.state_dir / ADMIN_KEY_FILE
        if pinned_path.exists():
            pinned = load_public_key(pinned_path)
            if pinned != admin:
                raise SignatureError(
                    f"the roster is signed by admin key {admin.hex()[:16]}..., not the key "
                    f"{pinned.hex()[:16]}... pinned in {pinned_path}; if the consortium really "
                    "rotated its admin key, replace that file with the new key"
                )
        else:
            save_public_key(pinned_path, admin)
            log.warning("roster_admin_pinned key=%s file=%s", admin.hex(), pinned_path)
        roster: dict[str, bytes] = {}
        for entry in body.entries:
            # each entry is verified once; later rosters repeat mostly the same entries
            seen = (admin, federation_id, entry.signed_bytes(federation_id), entry.admin_signature)
            if seen not in self._verified_roster:
                verify_roster_entry(entry, admin, federation_id)
                self._verified_roster.add(seen)
            if entry.is_active and entry.role == role:
                roster[entry.agent_id] = entry.public_key_bytes
        if role == "agent" and roster.get(self.member) != self.identity.public_bytes:
            raise SignatureError(
                f"the roster does not enrol {self.member!r} as an active agent with this "
                f"agent's key {self.identity.key_id}"
            )
        if serial:
            self._roster_cache[role] = (serial, roster)
        return roster

    async def _train_during_key_setup(
        self,
        client: AggregatorClient,
        state: RoundState,
        spec: RoundSpec,
        session: ClientSession,
        local: LocalData,
        model: torch.nn.Module,
        charge: _Charge | _TrainedUpdate,
        report: PrivacyReport,
    ) -> tuple[_TrainedUpdate, RoundState, ShareRelayBody | None, bool]:
        """Train while advertising keys and sharing them (``report`` goes with the
        shares); return the update, the state, the share relay if it came with the
        shares' answer, and whether the aggregator took the report.

        If the key stages fail (the attempt is aborted, a stage is missed), training is
        still awaited, so the update is kept for a retried attempt and the privacy it
        cost is not spent twice; then the key-stage error is raised.  If training fails,
        the key stages are cancelled.
        """
        setup = asyncio.ensure_future(self._secagg_key_stages(client, state, spec, session, report))
        try:
            trained = await self._train(client, spec, local, model, charge)
        except BaseException:
            setup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await setup
            raise
        current, relay, reported = await setup
        return trained, current, relay, reported

    async def _secagg_key_stages(
        self,
        client: AggregatorClient,
        state: RoundState,
        spec: RoundSpec,
        session: ClientSession,
        report: PrivacyReport,
    ) -> tuple[RoundState, ShareRelayBody | None, bool]:
        """SecAgg+ advertise and share-keys stages; they do not need the update.  The
        privacy report, charged before training, is sent with the shares.

        Each upload asks the aggregator to hold its answer until the next stage and
        carry that stage's data (key list, share relay): one request per stage instead
        of an upload, a long poll of the round state and a fetch.  Returns the newest
        round state seen, the share relay when it came with the shares' answer, and
        whether the shares (and so the report) were taken by this request.
        """
        r, a = spec.round, spec.attempt
        current = await self._wait_for(client, state, ("advertise",))
        adv = session.advertise()
        body = codec.advertise_body(adv)
        answer = await self._upload(client.advertise(r, a, body, self.poll_timeout_s))
        log.info("secagg_advertised round=%d attempt=%d", r, a)
        crash_point(r, "advertise")

        if answer is not None and answer.keys is not None:
            keys = answer.keys
        else:
            keys, current = await self._stage_data(
                client, current, "share_keys", lambda wait: client.keys(r, a, wait)
            )
        shares = session.share_keys(codec.key_list(keys))
        answer = await self._upload(
            client.post_shares(r, a, codec.share_keys_body(shares, report), self.poll_timeout_s)
        )
        log.info("secagg_shared round=%d attempt=%d neighbours=%d", r, a, len(shares.shares))
        crash_point(r, "share_keys")
        if answer is None:  # a 409: an earlier try landed, maybe without this report
            return current, None, False
        return current, answer.relay, True

    async def _upload(self, request: Awaitable[Accepted]) -> Accepted | None:
        """A SecAgg+ upload's answer, cut short by a stop; None for a 409 duplicate."""
        return await _tolerate_duplicate(self._unless_stopped(request))

    async def _secagg_round(
        self,
        client: AggregatorClient,
        state: RoundState,
        spec: RoundSpec,
        session: ClientSession,
        c: _Contribution,
        relay: ShareRelayBody | None,
    ) -> tuple[Receipt, RoundState]:
        """SecAgg+ masked input and unmask stages, after the key stages."""
        r, a = spec.round, spec.attempt
        current = state
        if relay is None:
            fetched, current = await self._stage_data(
                client, current, "masked_input", lambda wait: client.get_shares(r, a, wait)
            )
        else:
            fetched = relay
        session.receive_shares(codec.share_relay(fetched, self.member))
        if spec.dim <= INLINE_MASKING_MAX_DIM:
            masked = session.masked_input(c.quantized)
        else:  # keep the event loop responsive while a large vector is masked
            masked = await asyncio.to_thread(session.masked_input, c.quantized)
        # the receipt is held until the unmask stage and comes with our unmask request
        receipt, held = await self._send_vector(
            client, spec, c, masked.vector, wait=self.poll_timeout_s
        )
        crash_point(r, "masked_input")

        if held is not None:
            request = held
        else:
            request, current = await self._stage_data(
                client, current, "unmask", lambda wait: client.get_unmask(r, a, wait)
            )
        answer = session.unmask(UnmaskRequest(tuple(request.survivors), tuple(request.dropped)))
        body = codec.unmask_body(answer)
        # held until the attempt is over; the answer carries the round state then
        accepted = await self._upload(client.unmask(r, a, body, self.poll_timeout_s))
        log.info(
            "secagg_unmasked round=%d attempt=%d survivors=%d dropped=%d",
            r,
            a,
            len(request.survivors),
            len(request.dropped),
        )
        if accepted is not None and accepted.state is not None:
            current = accepted.state
        elif request.state_token is not None and (current.round, current.attempt) == (r, a):
            # the state as of the unmask request: the wait for the close starts there
            current = msgspec.structs.replace(current, stage="unmask", token=request.state_token)
        return receipt, current

    async def _plain_round(
        self, client: AggregatorClient, state: RoundState, spec: RoundSpec, c: _Contribution
    ) -> tuple[Receipt, RoundState]:
        current = await self._wait_for(client, state, ("masked_input",))
        receipt, _ = await self._send_vector(client, spec, c, pack(c.quantized, spec.ring_bits))
        return receipt, current

    async def _send_vector(
        self,
        client: AggregatorClient,
        spec: RoundSpec,
        contribution: _Contribution,
        vector: bytes,
        wait: float = 0.0,
    ) -> tuple[Receipt, UnmaskRequestBody | None]:
        """Keep the update for audits, send ``vector``, check and store the receipt.

        Returns:
            The receipt, and the unmask request when the answer was held for it
            (``wait`` > 0, SecAgg+).

        Raises:
            IntegrityError: the receipt names another member, round or contribution.
        """
        r, a = spec.round, spec.attempt
        salt = self.vault.keep_update_once(r, a, contribution.quantized)
        digest = hashlib.sha256(vector).hexdigest()
        commitment = commit(
            contribution.quantized,
            salt,
            CommitmentContext(spec.federation_id, r, a, self.member, spec.ring_bits),
        )
        statement = ContributionStatement(
            federation_id=spec.federation_id,
            round=r,
            attempt=a,
            member=self.member,
            vector_sha256=digest,
            commitment=commitment.hex(),
        ).sign(self.identity)
        request: UnmaskRequestBody | None = None
        try:
            # not cut short by a stop: the receipt of an accepted contribution is kept
            receipt, request = await client.masked_input(r, a, vector, statement, wait)
        except DuplicateMessage:
            # A retry after a lost answer: the first try was taken; fetch its receipt.
            receipt = await client.receipt(r)
        expected = (spec.federation_id, r, a, self.member, digest)
        got = (
            receipt.federation_id,
            receipt.round,
            receipt.attempt,
            receipt.member,
            receipt.contribution_sha256,
        )
        if got != expected:
            raise IntegrityError(
                f"receipt for round {r} attempt {a} does not acknowledge what was sent: "
                f"expected {expected}, got {got}"
            )
        self.vault.save_receipt(receipt)
        self._receipts[(r, a)] = receipt
        self._save_record(spec, contribution, receipt)
        log.info(
            "contribution_accepted round=%d attempt=%d bytes=%d sha256=%s log_index=%d",
            r,
            a,
            len(vector),
            digest,
            receipt.log_index,
        )
        return receipt, request

    def _save_record(self, spec: RoundSpec, contribution: _Contribution, receipt: Receipt) -> None:
        trained = contribution.trained
        self.vault.save_record(
            RoundRecord(
                federation_id=spec.federation_id,
                round=spec.round,
                attempt=spec.attempt,
                member=self.member,
                dataset_id=self.dataset_id,
                model_version=spec.model_version,
                secure_sum=spec.secure_sum,
                epsilon=trained.epsilon,
                samples=contribution.samples,
                weight=contribution.weight,
                steps=trained.steps,
                contribution_sha256=receipt.contribution_sha256,
                receipt_log_index=receipt.log_index,
                recorded_at=time.time(),
            )
        )


def _with(
    base: RoundOutcome, status: OutcomeStatus, receipt: Receipt | None, detail: str = ""
) -> RoundOutcome:
    return RoundOutcome(
        base.round,
        base.attempt,
        status,
        base.model_version,
        base.epsilon,
        base.samples,
        base.weight,
        receipt,
        detail,
    )


def _training_seed(member: str, round_: int) -> int:
    """A fresh secret seed for DP noise and sampling (deterministic only under the unsafe
    test switch, see fedsec.faults)."""
    fixed = deterministic_bytes(member, round_, "training")
    return int.from_bytes(fixed[:8], "big") >> 1 if fixed else fresh_seed()


async def _tolerate_duplicate(request: Awaitable[T]) -> T | None:
    """Await a POST; None when a 409 duplicate says an earlier (retried) try already
    landed."""
    try:
        return await request
    except DuplicateMessage:
        log.info("request_duplicate_ignored")
        return None
