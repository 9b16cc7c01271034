"""The custodian's I/O loop: publish the public context once, then follow the federation
and answer each decrypt stage with a checked decryption or a logged refusal.

The loop only moves bytes: every decision is :class:`~fedsec.custodian.check.SumCheck`'s,
every byte of the log goes through :class:`~fedsec.custodian.follow.LogFollower`.  Each
decision is appended to the custodian's own ``decryptions.jsonl`` before anything leaves
(a release is recorded before its plaintext is posted).  An attempt refused stays
refused (the aggregator aborts it at its deadline and retries without the lost members);
an attempt released by an earlier run and still in decrypt is answered again with the
same plaintext, since the post may never have arrived.  A log that does not verify ends
the service: nothing the aggregator serves afterwards can be trusted.

Refusals decided by a decryption (:data:`~fedsec.custodian.check.DECRYPTION_REASONS`)
are answers about plaintexts nobody else can read: each tells the aggregator whether
contributions it chose decrypt to in-range integers.  Against CKKS such answers are the
raw material of the IND-CPA-D attacks (Li and Micciancio, 2021), and honest members never
cause one, so after :data:`MAX_DECRYPTION_REFUSALS` of them in the decision log the
service stops with an alert (a CRITICAL ``alert=custodian_halted`` line and
:class:`DecryptionHalted`), and refuses to start again until its operator raises
``--max-decryption-refusals``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final, Protocol, TypeVar

from fedsec.aio import cancel_and_wait, unless_stopped
from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian import hidden
from fedsec.custodian.check import (
    DECRYPTION_REASONS,
    MAX_DECRYPTION_REFUSALS,
    MIN_CONTRIBUTORS,
    Custody,
    Refused,
    Release,
    SumCheck,
)
from fedsec.custodian.follow import LogFollower
from fedsec.custodian.store import DecisionLog, open_custodian
from fedsec.errors import (
    AggregatorUnreachable,
    ConfigError,
    DuplicateMessage,
    FedsecError,
    IntegrityError,
    RequestTimeout,
    RetryLater,
    WrongStage,
)
from fedsec.protocol import he_release
from fedsec.protocol.limits import LONG_POLL_S
from fedsec.protocol.wire import (
    DecryptionStatement,
    HeContext,
    HeContextStatement,
    HeSumOffer,
    RoundSpec,
    RoundState,
)

__all__ = ["Aggregator", "CustodianService", "DecryptionHalted", "context_statement"]

log = logging.getLogger("fedsec.custodian")

#: Pause before asking again after a temporary refusal or an empty log read: short
#: enough to meet the decrypt deadline (round.decrypt_s, 60 s by default), long enough
#: not to hammer an aggregator that is catching up.
RETRY_PAUSE_S: Final = 1.0
#: Empty log reads tolerated while the log is behind the offer's index before refusing
#: (the aggregator writes its entries before it makes the offer, so one is plenty).
LOG_CATCH_UP_TRIES: Final = 3

#: Archive objects fetched ahead of the one being added: a sum check costs about one
#: round trip per FETCH_AHEAD contributions instead of one per contribution, while it
#: holds at most FETCH_AHEAD encrypted updates (32 MB each at d = 1M) besides the sum.
FETCH_AHEAD: Final = 4

T = TypeVar("T")
# Failures a later request may not meet: the transport gave up on them for now.
_TEMPORARY: Final = (RetryLater, RequestTimeout, AggregatorUnreachable)


class DecryptionHalted(FedsecError):
    """The custodian stopped decrypting after too many refusals a decryption decided."""

    code = "decryption_halted"
    http_status = 409


class Aggregator(hidden.ModelSource, Protocol):
    """The calls the service makes (:class:`~fedsec.aggregator_client.AggregatorClient`;
    tests pass a fake); a hidden model's parent is read through :class:`ModelSource`'s."""

    async def put_he_context(self, context: HeContext) -> None: ...
    async def he_context(self) -> HeContext: ...
    async def get_round(
        self, wait_token: int | None = None, timeout: float = 0.0
    ) -> RoundState: ...
    async def he_sum(self, round: int, attempt: int, wait: float = 0.0) -> HeSumOffer: ...
    async def post_decryption(self, round: int, attempt: int, body: bytes) -> None: ...
    async def log_lines(self, start: int) -> bytes: ...
    async def archived(self, sha256: str, max_bytes: int) -> bytes: ...


def context_statement(
    custody: Custody, identity: SigningIdentity, public_context: bytes
) -> HeContext:
    """The signed statement of the public context, with the context, as uploaded."""
    params = custody.params
    statement = HeContextStatement(
        federation_id=custody.federation_id,
        custodian=custody.custodian_id,
        poly_modulus_degree=params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        scale_bits=params.scale_bits,
        context_sha256=hashlib.sha256(public_context).hexdigest(),
    ).sign(identity)
    return HeContext(statement=statement, context=base64.b64encode(public_context).decode())


class CustodianService:
    """Serve one federation as its key custodian.

    Args:
        client: the aggregator's API.
        custody: who the custodian is and what it holds.
        identity: its signing key (signs the context and decryption statements).
        public_context: its public context bytes.
        follower: the verified log (fresh: the service reads it from entry 0).
        decisions: its append-only decision log.
        stop: set to stop (SIGINT / SIGTERM).
        poll_timeout_s: the long-poll wait asked of the aggregator.
        max_decryption_refusals: refusals decided by a decryption, over the whole
            decision log, after which the service stops.
    """

    def __init__(
        self,
        client: Aggregator,
        custody: Custody,
        identity: SigningIdentity,
        public_context: bytes,
        follower: LogFollower,
        decisions: DecisionLog,
        *,
        stop: asyncio.Event | None = None,
        poll_timeout_s: float = LONG_POLL_S,
        max_decryption_refusals: int = MAX_DECRYPTION_REFUSALS,
    ) -> None:
        self.client = client
        self.custody = custody
        self.identity = identity
        self.public_context = public_context
        self.follower = follower
        self.decisions = decisions
        self.stop = stop or asyncio.Event()
        self.poll_timeout_s = poll_timeout_s
        self.max_decryption_refusals = max_decryption_refusals
        # decided by this process, or refused ever; an attempt released by an earlier
        # process and still in decrypt is answered again (the post may not have arrived)
        self.handled = decisions.refused()

    async def run(self) -> None:
        """Publish the context, then decide every decrypt stage until the federation
        finishes or :attr:`stop` is set.

        Raises:
            DecryptionHalted: the decision log holds :attr:`max_decryption_refusals`
                refusals decided by a decryption (at start, or after one more).
            IntegrityError: the aggregator holds another context, or the log does not
                verify.
            FedsecError: a refusal no retry can change (the custodian is not enrolled).
        """
        self._check_halt()
        await self.publish_context()
        state = await self._guarded(lambda: self.client.get_round())
        while state is not None and not state.finished:
            if state.stage == "decrypt" and (state.round, state.attempt) not in self.handled:
                await self.handle(state.round, state.attempt)
            state = await self._guarded(functools.partial(self._next_state, state.token))
        if state is not None:
            log.info("federation_finished rounds_completed=%d", state.rounds_completed)

    async def _next_state(self, token: int) -> RoundState:
        return await self.client.get_round(token, self.poll_timeout_s)

    async def publish_context(self) -> None:
        """``POST /he/context``; a refusal because the aggregator holds a context is fine
        when the one it holds is ours.

        Raises:
            IntegrityError: the aggregator holds another context for the federation.
        """
        upload = context_statement(self.custody, self.identity, self.public_context)
        try:
            await self.client.put_he_context(upload)
        except FedsecError as exc:
            if exc.http_status != 409:
                raise
            held = await self.client.he_context()
            if held.statement.context_sha256 != self.custody.context_sha256:
                raise IntegrityError(
                    f"the aggregator already holds another CKKS context for federation "
                    f"{self.custody.federation_id} (sha256 {held.statement.context_sha256[:16]}…, "
                    f"ours {self.custody.context_sha256[:16]}…): {exc.detail}; members may "
                    "have encrypted under a key this custodian does not hold; ask the "
                    "operator which custodian directory the federation was set up with"
                ) from None
        log.info("context_published sha256=%s", self.custody.context_sha256)

    async def handle(self, round: int, attempt: int) -> None:
        """Decide one attempt's offer: check, then release or refuse (recorded either way).

        Raises:
            IntegrityError: the log does not verify (recorded as a refusal first).
        """
        offer = await self._guarded(lambda: self.client.he_sum(round, attempt))
        if offer is None:
            return
        self.handled.add((round, attempt))
        try:
            await self._read_log(offer.log_index)
        except IntegrityError as exc:
            self._refuse(offer, Refused("bad_log", f"the log does not verify: {exc.detail}"))
            raise
        try:
            check, release = await self._check(offer)
            statement, rest = release.statement, release.plaintext
            if check.spec.he_model_hidden:
                statement, rest = await self._seal(check.spec, release)
        except Refused as refusal:
            self._refuse(offer, refusal)
            if refusal.reason in DECRYPTION_REASONS:
                self._check_halt()
            return
        statement = statement.sign(self.identity)
        self.decisions.record_release(offer, release)
        log.info(
            "released round=%d attempt=%d contributors=%d sum_sha256=%s plaintext_sha256=%s",
            round,
            attempt,
            len(statement.contributors),
            statement.sum_sha256,
            statement.plaintext_sha256,
        )
        try:
            await self.client.post_decryption(round, attempt, he_release.frame(statement, rest))
        except (DuplicateMessage, WrongStage) as exc:  # already stored, or the attempt ended
            log.warning(
                "decryption_not_taken round=%d attempt=%d detail=%r", round, attempt, exc.detail
            )

    async def _seal(self, spec: RoundSpec, release: Release) -> tuple[DecryptionStatement, bytes]:
        """A hidden model's release (:mod:`fedsec.custodian.hidden`).

        Raises:
            Refused: the parent model does not verify or open, or cannot take the sum.
        """
        genesis = self.follower.genesis
        assert genesis is not None  # the sum check read the log from entry 0
        try:
            parent = await hidden.parent_model(
                self.client,
                self.custody.public_key,
                self.custody.custodian_id,
                self.identity,
                spec,
            )
            return hidden.seal_release(
                spec,
                release.statement,
                release.plaintext,
                parent,
                float(genesis.server["server_lr"]),
                hidden.recipients(self.follower),
            )
        except FedsecError as exc:
            raise Refused(
                "bad_parent",
                f"the hidden model of round {spec.round} cannot be derived from version "
                f"{spec.model_version}: {exc.detail}",
            ) from None

    async def _check(self, offer: HeSumOffer) -> tuple[SumCheck, Release]:
        """Re-add the offer's contributions, fetched :data:`FETCH_AHEAD` at a time (added
        in the log's order), and decide.

        Raises:
            Refused: see :class:`SumCheck`; an archive object is not served.
        """
        check = SumCheck(offer, self.follower, self.custody, self.decisions.released())
        wanted = list(check.wanted)
        fetches: deque[asyncio.Task[bytes]] = deque()
        try:
            for i, logged in enumerate(wanted):
                while len(fetches) < FETCH_AHEAD and i + len(fetches) < len(wanted):
                    ahead = wanted[i + len(fetches)]
                    fetches.append(
                        asyncio.ensure_future(
                            self.client.archived(ahead.sha256, max_bytes=ahead.bytes)
                        )
                    )
                try:
                    raw = await fetches.popleft()
                except FedsecError as exc:
                    raise Refused(
                        "archive_mismatch",
                        f"the archive object of {logged.member}'s contribution is not "
                        f"served: {exc.detail}",
                    ) from None
                check.add(logged, raw)
        finally:
            await cancel_and_wait(*fetches)
        return check, check.release()

    async def _read_log(self, until: int) -> None:
        """Read the log on from where it was left until it holds ``until`` entries (or the
        aggregator stops serving more: the check then refuses ``log_incomplete``)."""
        empty = 0
        while self.follower.next_index < until and empty < LOG_CATCH_UP_TRIES:
            before = self.follower.next_index
            self.follower.feed(await self.client.log_lines(before))
            if self.follower.next_index == before:
                empty += 1
                await self._pause(RETRY_PAUSE_S)

    def _refuse(self, offer: HeSumOffer, refusal: Refused) -> None:
        self.decisions.record_refusal(offer, refusal)
        log.warning(
            "refused round=%d attempt=%d reason=%s sum_sha256=%s detail=%r",
            offer.round,
            offer.attempt,
            refusal.reason,
            offer.sum_sha256,
            refusal.detail,
        )

    def _check_halt(self) -> None:
        """Raises DecryptionHalted: the decision log holds too many refusals decided by
        a decryption (see the module docstring)."""
        count = self.decisions.decryption_refusals()
        if count < self.max_decryption_refusals:
            return
        log.critical(
            "alert=custodian_halted decryption_refusals=%d limit=%d federation=%s",
            count,
            self.max_decryption_refusals,
            self.custody.federation_id,
        )
        raise DecryptionHalted(
            f"the custodian refused {count} offers on what their contributions decrypt to "
            f"(limit {self.max_decryption_refusals}; see {self.decisions.path}): crafted "
            "ciphertexts may be probing the federation's secret key (IND-CPA-D), so it "
            "decrypts nothing more; investigate, then restart it with a higher "
            "--max-decryption-refusals"
        )

    async def _guarded(self, ask: Callable[[], Awaitable[T]]) -> T | None:
        """``ask()``'s answer, asked anew after a temporary failure (the transport has
        already retried it); None once stopped."""
        while not self.stop.is_set():
            answered = await unless_stopped(ask(), self.stop)
            if answered is None:
                return None
            try:
                return answered.result()
            except _TEMPORARY as exc:
                log.warning(
                    "aggregator_unavailable retry_in_s=%.1f detail=%r", RETRY_PAUSE_S, exc.detail
                )
                await self._pause(RETRY_PAUSE_S)
        return None

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)


async def serve_directory(
    directory: Path,
    custodian_id: str,
    aggregator_url: str | Sequence[str],
    aggregator_key: bytes,
    *,
    admin_key: bytes | None = None,
    min_contributors: int = MIN_CONTRIBUTORS,
    max_decryption_refusals: int = MAX_DECRYPTION_REFUSALS,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the federation as the custodian whose directory is ``directory`` (what
    ``fedsec custodian serve`` runs; the simulation runs it as a task).

    Raises:
        ConfigError: ``min_contributors`` is below :data:`MIN_CONTRIBUTORS`,
            ``max_decryption_refusals`` below 1, or the directory is not a custodian's.
        FedsecError: see :meth:`CustodianService.run`.
    """
    from fedsec.aggregator_client import AggregatorClient
    from fedsec.crypto import he

    if min_contributors < MIN_CONTRIBUTORS:
        raise ConfigError(f"--min-contributors must be at least {MIN_CONTRIBUTORS}")
    if max_decryption_refusals < 1:
        raise ConfigError("--max-decryption-refusals must be at least 1")
    opened = open_custodian(directory)
    params = opened.manifest.params
    custody = Custody(
        federation_id=opened.manifest.federation_id,
        custodian_id=custodian_id,
        public_key=opened.identity.public_bytes,
        context_sha256=opened.manifest.context_sha256,
        public_ctx=he.load_public_context(
            opened.public_context, params, params.context_max_bytes(secret=False)
        ),
        secret_ctx=he.load_secret_context(
            opened.secret_context, params, params.context_max_bytes(secret=True)
        ),
        min_contributors=min_contributors,
    )
    follower = LogFollower(custody.federation_id, aggregator_key, admin_public_key=admin_key)
    async with AggregatorClient(aggregator_url, opened.identity, aggregator_key) as client:
        service = CustodianService(
            client,
            custody,
            opened.identity,
            opened.public_context,
            follower,
            opened.decisions,
            stop=stop,
            max_decryption_refusals=max_decryption_refusals,
        )
        await service.run()
