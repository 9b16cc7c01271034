"""A group server's intake: the stage messages of the shard groups the signed spec
gives this server's URL, taken as the leader's intake takes them
(:mod:`fedsec.aggregator.rounds.intake`), over the leader's state store.

The attempt is the store's: its newest row (round, attempt, stage, spec).  The leader
moves the stages; this desk follows.  For each of its groups it holds that group's
SecAgg+ session, fed from the store's messages through the stored stage whenever the
stage moved (:func:`fedsec.summation.feed`, as a resumed aggregator rebuilds its own),
so its survivor sets are the leader's.

A message is checked against the attempt (round, stage, cohort, group), decoded and
validated by the group's session before anything is stored; then it waits, with the
others validated meanwhile, for its batch's commit (:mod:`.batch`): archived, then
stored, logged (and, for a masked input, receipted) in one transaction that first
re-reads the attempt's stage and the leader's take-over mark: a message the leader may
already have closed its stage without, or of a group the leader took over, is refused
with nothing stored.  Its sender is answered only once that transaction committed.
Since the transaction is SQLite's ``BEGIN IMMEDIATE`` the log's tail is read under the
write lock, so the leader's and every group server's entries form one hash chain in
one order.  A refusal there leaves the session holding a message the store lacks: it
is rebuilt from the store before its next use.

A group server never writes ``audit/log.jsonl``: the leader copies the committed lines
there at its next commit (:class:`~fedsec.aggregator.storage.audit_trail.AuditTrail`).

The bytes of the requests it serves are counted in the attempt in progress when they
arrive, as the leader counts its own, and stored with each message and each heartbeat
(:class:`~fedsec.aggregator.groups.hosts.ServedTraffic`): the leader's round summary
adds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from fedsec.aggregator.groups.batch import MAX_BATCH, CommitQueue, Pending, StoreWrites, commit
from fedsec.aggregator.groups.hosts import (
    GroupTakenOver,
    ServedTraffic,
    beat,
    follow_again,
    share_store,
)
from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.events import ContributionAccepted, ContributionRefused, Event
from fedsec.aggregator.rounds.refusals import RefusalLog
from fedsec.aggregator.rounds.reports import check_report
from fedsec.aggregator.storage.audit_trail import ARCHIVE_DIR, append_entry
from fedsec.aggregator.storage.leadership import NotLeader
from fedsec.aggregator.workspace import Workspace
from fedsec.archive import Archive
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import (
    DuplicateMessage,
    FedsecError,
    NotFound,
    RetryLater,
    UnknownMember,
    WrongGroup,
    WrongStage,
)
from fedsec.protocol import codec, wire
from fedsec.protocol.log_entries import LogBody
from fedsec.protocol.shards import group_index
from fedsec.protocol.stages import SECAGG_STAGES, Stage
from fedsec.summation import StoredMessage, feed
from fedsec.summation.secagg import SecAggPlusSession
from fedsec.summation.session import StageMessage

log = logging.getLogger("fedsec.aggregator.groups")

#: How long one read of an attempt's stage answers :meth:`GroupDesk.reached` for every
#: held request: the leader closes a stage within its tick (50 ms), so a held member
#: learns of it within ~0.1 s, and the store sees one read per interval however many
#: members are held (each read carries the round's spec).
STAGE_POLL_S: Final = 0.05

#: Each answer a member fetches (or an upload's held answer carries): the stage it
#: waits for.
ANSWER_STAGES: dict[str, Stage] = {
    "key_list": "share_keys",
    "share_relay": "masked_input",
    "unmask_request": "consistency",
    "consistency_proof": "unmask",
}


@dataclass
class _Served:
    """The attempt in progress as this server serves it."""

    live: Attempt
    spec: wire.RoundSpec
    groups: dict[int, SecAggPlusSession] = field(default_factory=dict)
    fed_through: str = ""  # the stored stage the sessions were fed through; "": stale


class GroupDesk:
    """The stage messages of the groups ``url`` serves, for ``ws``'s federation.

    Args:
        ws: the workspace (its roster, signing key and state store: the leader's).
        url: this server's base URL, as ``round.group_servers`` lists it.
        clock: Unix time (log entries, receipts).
        events: told of each masked input accepted or refused, as the leader's intake
            tells its bus (the group server's own metrics).
    """

    def __init__(
        self,
        ws: Workspace,
        url: str,
        clock: Callable[[], float] = time.time,
        events: Callable[[Event], None] = lambda event: None,
    ) -> None:
        self.ws, self.url, self._clock, self._events = ws, url.rstrip("/"), clock, events
        share_store(ws.state, follower=True)  # PostgreSQL: the leader's token, in order
        self._archive = Archive(ws.root / ARCHIVE_DIR)
        self._served: _Served | None = None
        self._stage_read: tuple[tuple[int, int], float, str | None] | None = None
        # (when read, the newest stored attempt): which attempt a request is counted in
        self._newest: tuple[float, tuple[int, int] | None] | None = None
        self._traffic = ServedTraffic(self.url)
        self._refusals = RefusalLog(ws.state, self._log_refusal, self._live)
        # validated messages waiting for their batch's commit, and who awaits them
        self._queue = CommitQueue()
        self._done: dict[Pending, asyncio.Future[None]] = {}
        self._committer: asyncio.Task[None] | None = None
        self._writes = StoreWrites(ws, self._traffic, clock)
        #: Messages this server stored (the bench reads it).
        self.accepted = 0

    # -- the attempt, as stored ------------------------------------------------------------------

    def served(self) -> _Served:
        """The attempt in progress, its sessions fed through its stored stage.

        Raises:
            WrongStage: no attempt has a spec yet.
        """
        row = self.ws.state.rounds.latest()
        if row is not None:
            self._newest = (self._clock(), (row.round, row.attempt))
        if row is None or row.spec is None:
            raise WrongStage("no round is in progress past its cohort")
        s = self._served
        if s is None or (s.live.round, s.live.attempt) != (row.round, row.attempt):
            spec = msgspec.json.decode(row.spec, type=wire.RoundSpec)
            live = Attempt(row.round, row.attempt, row.stage, row.opened_at, row.stage_started_at)
            live.spec = spec
            s = self._served = _Served(live, spec)
        s.live.stage, s.live.stage_started_at = row.stage, row.stage_started_at
        if s.fed_through != row.stage:
            self._feed(s, row.stage)
        return s

    def _live(self) -> Attempt:
        """The attempt in progress (for :class:`RefusalLog`: which attempts a refusal
        may be logged for); the stored newest one while none has a spec yet."""
        try:
            return self.served().live
        except WrongStage:
            row = self.ws.state.rounds.latest()
            if row is None:
                return Attempt(0, 0, "none", 0.0, 0.0)  # no round: no refusal is logged
            return Attempt(row.round, row.attempt, row.stage, row.opened_at, row.stage_started_at)

    def _feed(self, s: _Served, stage: str) -> None:
        """Rebuild each of this server's groups from the store, through ``stage``."""
        mine = [i for i, g in enumerate(s.spec.groups) if g.url == self.url]
        messages = self.ws.state.messages
        groups = {}
        for i in mine:
            members = s.spec.groups[i].members
            keys = {}
            for m in members:
                entry = self.ws.roster.get(m)
                if entry is not None:
                    keys[m] = entry.public_key_bytes
            session = SecAggPlusSession(s.spec, keys, consistency=True, group=i)
            if stage in session.stages:
                reached = session.stages[: session.stages.index(stage) + 1]
                wanted = set(members)
                stored = [
                    StoredMessage(st, m, body)
                    for st in reached
                    for m, body in messages.of_stage(s.live.round, s.live.attempt, st)
                    if m in wanted
                ]
                feed(session, stored, through=stage)
            groups[i] = session
        s.groups, s.fed_through = groups, stage

    def _group_of(self, s: _Served, member: str) -> tuple[int, SecAggPlusSession]:
        """Raises: UnknownMember: not in the cohort; WrongGroup: in a group another
        server (or the leader) serves, which the detail names."""
        s.live.in_cohort(member)
        index = group_index(s.spec.groups, member)
        session = s.groups.get(index)
        if session is None:
            where = s.spec.groups[index].url or "the leader's URL"
            raise WrongGroup(
                f"{member} is in shard group {index} of round {s.live.round}, served at "
                f"{where}, not at {self.url}"
            )
        return index, session

    # -- uploads ---------------------------------------------------------------------------------

    async def accept(
        self,
        member: str,
        r: int,
        a: int,
        stage: Stage,
        raw: bytes,
        decode: Callable[[str], StageMessage],
        **entry: Any,
    ) -> wire.Receipt | None:
        """Take one stage message (``raw``: as stored) of a member of this server's
        groups, answered once it is durable: stored and logged (and receipted) in one
        transaction with the other messages validated meanwhile (:mod:`.batch`).  An
        identical retry gets the same answer (its receipt, for a masked input), also
        while the first waits for its commit.  ``entry``: a masked input's
        ``commitment``, ``signature`` and ``receipt_for`` (its SHA-256).

        Raises:
            WrongStage: not the attempt in progress, or not its stage (also when the
                stage moved on while this message was checked).
            UnknownMember: not in the cohort.
            WrongGroup: in a group this server does not serve.
            NotLeader: the leader took the group over.
            RetryLater: another leader took the lease over meanwhile (PostgreSQL).
            DuplicateMessage: a different message of this stage was stored, or waits.
            ProtocolError, PayloadError, SignatureError: the group's session refuses it.
            OSError, sqlite3.Error, psycopg.Error: the batch's archive objects or its
                transaction failed: nothing of the batch was stored, none answered.
        """
        stored = self.ws.state.messages.get(r, a, stage, member)
        if stored == raw:
            return self._receipt_of(member, r, a, entry)
        message = self._validated(member, r, a, stage, raw, decode, entry, stored is not None)
        return await self._committed(message)

    def _validated(
        self,
        member: str,
        r: int,
        a: int,
        stage: Stage,
        raw: bytes,
        decode: Callable[[str], StageMessage],
        entry: dict[str, Any],
        stored_another: bool,
    ) -> Pending:
        """The message checked against the attempt and taken by its group's session,
        queued for its commit (or the identical one already queued).  ``stored_another``:
        the store holds a different message of the member's stage (read by the caller,
        nothing awaited since)."""
        s = self.served()
        s.live.expect(member, r, a, stage)
        index, session = self._group_of(s, member)
        message = Pending(r, a, stage, member, index, raw, entry)
        if self._queue.pending(r, a, stage, member) is not None:
            return self._queue.join(message)  # the same bytes: the same outcome
        if stored_another:
            raise DuplicateMessage(f"{member} already sent a different {stage} message this round")
        session.receive(stage, decode(member))
        return self._queue.join(message)

    async def masked_input(
        self, member: str, r: int, a: int, raw: bytes, commitment: str, signature: str
    ) -> wire.Receipt:
        """A member's masked input with its signed contribution statement; its receipt.
        A refusal of a member of this server's groups is logged as the leader logs its
        own (:class:`~fedsec.aggregator.rounds.refusals.RefusalLog`, within its bounds).

        Raises:
            SignatureError: the statement is not the member's.
            WrongStage, UnknownMember, WrongGroup, NotLeader, RetryLater,
                DuplicateMessage, BadVector: as :meth:`accept`.
        """
        try:
            return await self._masked_input(member, r, a, raw, commitment, signature)
        except (NotLeader, RetryLater, WrongGroup):
            # not this server's to log: the leader takes (or took) the member's group, the
            # leader changed, or the member is another server's
            raise
        except FedsecError as exc:
            in_cohort = self._refusals.refused(member, r, a, raw, exc)
            self._events(ContributionRefused(r, a, member, exc.code, self._clock(), in_cohort))
            raise

    def _log_refusal(self, body: LogBody) -> None:
        """A ``refused`` entry, in a transaction of its own: the tail is read under the
        write lock (PostgreSQL: in the leader's writer order), so the chain stays one."""
        state = self.ws.state
        try:
            with state.transaction():
                append_entry(state.log, self._clock(), body)
        except NotLeader:
            # the leader changed (or lost the lease): the member's refusal stands, its
            # entry is not written; the process log keeps it
            log.warning("event=refusal_not_logged reason=fenced entry=%r", body)
            follow_again(state)

    async def _masked_input(
        self, member: str, r: int, a: int, raw: bytes, commitment: str, signature: str
    ) -> wire.Receipt:
        digest = hashlib.sha256(raw).hexdigest()
        fields = {"commitment": commitment, "signature": signature, "receipt_for": digest}
        if self.ws.state.messages.get(r, a, "masked_input", member) != raw:
            statement = wire.ContributionStatement(
                federation_id=self.ws.federation_id,
                round=r,
                attempt=a,
                member=member,
                vector_sha256=digest,
                commitment=commitment,
                signature=signature,
            )
            entry = self.ws.roster.get(member)
            if entry is None:
                raise UnknownMember(f"{member} is not on the roster")
            statement.verify(entry.public_key_bytes)
        receipt = await self.accept(
            member, r, a, "masked_input", raw, lambda m: MaskedInput(m, raw), **fields
        )
        assert receipt is not None
        return receipt

    async def share_keys(self, member: str, r: int, a: int, body: wire.ShareKeysBody) -> None:
        """A member's shares; the privacy report they carry is checked first and stored
        with them, in their transaction.

        Raises:
            PayloadError: the report names another member, round or federation, or an
                ε that is not a finite number >= 0.
            SignatureError: the report is not the member's.
            as :meth:`accept`.
        """
        raw = wire.encode(wire.ShareKeysBody(shares=body.shares))
        report = body.report
        checked = None
        if report is not None and self.ws.state.reports.get(r, a, member) is None:
            checked = self._check_report(member, r, a, report)
        extra = {} if checked is None or report is None else {"report": (report, checked)}
        await self.accept(
            member,
            r,
            a,
            "share_keys",
            raw,
            lambda m: codec.share_keys_message(m, body),
            **extra,
        )

    def _check_report(self, member: str, r: int, a: int, report: wire.PrivacyReport) -> bytes:
        check_report(report, self.ws.federation_id, member, r, a)
        entry = self.ws.roster.get(member)
        if entry is None:
            raise UnknownMember(f"{member} is not on the roster")
        report.verify(entry.public_key_bytes)
        return wire.encode(report)

    async def unmask(self, member: str, r: int, a: int, body: wire.UnmaskResponseBody) -> None:
        """A survivor's unmask answer; one that comes after the attempt closed without
        needing it is answered as accepted, with nothing stored (as the leader does).

        Raises:
            as :meth:`accept`.
        """
        row = self.ws.state.rounds.get(r, a)
        if row is not None and row.stage == "closed":
            return
        await self.accept(
            member,
            r,
            a,
            "unmask",
            wire.encode(body),
            lambda m: codec.unmask_message(m, body),
        )

    # -- storage ---------------------------------------------------------------------------------

    async def _committed(self, message: Pending) -> wire.Receipt | None:
        """``message``'s outcome, once its batch committed (or failed).

        Raises:
            as :meth:`accept`: the refusal its transaction gave it.
        """
        loop = asyncio.get_running_loop()
        done = self._done.get(message)
        if done is None:
            done = self._done[message] = loop.create_future()
        if self._committer is None or self._committer.done():
            self._committer = loop.create_task(self._commit_queued())
        await asyncio.shield(done)  # a sender that goes away leaves its batch intact
        if message.error is not None:
            raise message.error
        return message.receipt

    async def _commit_queued(self) -> None:
        """Commit the queue in batches until it is empty.  First the loop runs while
        that lets more requests join: those ready now, and (the loop being blocked
        while a batch commits) all that arrived meanwhile, so a batch grows with the
        load without a fixed wait."""
        queued = -1
        while queued != len(self._queue) < MAX_BATCH:
            queued = len(self._queue)
            await asyncio.sleep(0)
        while batch := self._queue.take():
            try:
                self._commit(batch)
            except Exception:  # a bug after the commit: each message keeps its outcome
                log.exception("event=group_commit_failed messages=%d", len(batch))
            finally:
                self._queue.settle(batch)
                for message in batch:
                    done = self._done.pop(message, None)
                    if done is not None and not done.done():
                        done.set_result(None)

    def _commit(self, batch: list[Pending]) -> None:
        """Archive ``batch``'s bytes (durable before their entries commit), then store,
        log and receipt them (:func:`~.batch.commit`); then what each outcome means
        here."""
        archived = []
        for message in batch:
            try:
                message.sha256 = self._archive.put(message.raw, sync=False)
                archived.append(message)
            except OSError as exc:
                message.error, message.settled = exc, True
        try:
            self._archive.make_durable(m.sha256 for m in archived)
        except OSError as exc:
            for message in archived:
                message.error, message.settled = exc, True
            archived = []
        if archived:
            commit(archived, self._writes)
        refused = [m for m in batch if not m.accepted]
        if refused and self._served is not None:
            self._served.fed_through = ""  # the sessions took what the store lacks
        fenced = [
            m
            for m in refused
            if isinstance(m.error, NotLeader) and not isinstance(m.error, GroupTakenOver)
        ]
        if fenced and follow_again(self.ws.state):
            # another leader took the lease over (it resumes the round): the members
            # retry here, under the new leader's token
            for m in fenced:
                m.error = RetryLater(f"the leader changed while {m.member}'s {m.stage} was stored")
        for m in batch:
            if m.accepted:
                self.accepted += 1
                if m.stage == "masked_input":
                    self._events(ContributionAccepted(m.round, m.attempt, m.member, len(m.raw)))

    def _receipt_of(
        self, member: str, r: int, a: int, extra: dict[str, Any]
    ) -> wire.Receipt | None:
        """An identical retry's answer: the stored receipt of a masked input."""
        if "receipt_for" not in extra:
            return None
        stored = self.ws.state.receipts.latest(r, member)
        if stored is None:
            raise NotFound(f"no accepted contribution from {member} in round {r}")
        return msgspec.json.decode(stored, type=wire.Receipt)

    # -- traffic and heartbeat -------------------------------------------------------------------

    def count_request(self, named: tuple[int, int] | None, received: int) -> tuple[int, int] | None:
        """Count an authenticated request's ``received`` bytes in the attempt in progress
        (as the leader counts its own: the newest stored attempt when it arrives); that
        attempt, to count its answer in (None: no round yet, nothing is counted).
        ``named``: the (round, attempt) the request names, if any; one later than the
        last read makes the desk read the store again rather than count it in the
        attempt before."""
        now = self._clock()
        seen = self._newest
        if (
            seen is None
            or not 0 <= now - seen[0] < STAGE_POLL_S
            or (named is not None and (seen[1] is None or named > seen[1]))
        ):
            row = self.ws.state.rounds.latest()
            seen = self._newest = (now, None if row is None else (row.round, row.attempt))
        attempt = seen[1]
        if attempt is not None:
            self._traffic.count(attempt, received, 0)
        return attempt

    def count_answer(self, attempt: tuple[int, int], sent: int) -> None:
        """Count the ``sent`` bytes of the answer to a request counted in ``attempt``."""
        self._traffic.count(attempt, 0, sent)

    def beat(self, now: float) -> None:
        """Write this server's heartbeat at ``now``, with the bytes counted since the
        last commit, in one transaction.

        Raises:
            NotLeader: PostgreSQL: the leader changed (call
                :func:`~fedsec.aggregator.groups.hosts.follow_again`).
        """
        state = self.ws.state
        with state.transaction():
            beat(state, self.url, now)
            self._traffic.write(state)
        self._traffic.written()

    # -- answers ---------------------------------------------------------------------------------

    def reached(self, r: int, a: int, stage: str) -> bool:
        """Whether attempt (r, a) is the stored one and has reached ``stage`` (not aborted)."""
        now = self._clock()
        seen = self._stage_read
        if seen is not None and seen[0] == (r, a) and 0 <= now - seen[1] < STAGE_POLL_S:
            stored = seen[2]
        else:
            row = self.ws.state.rounds.get(r, a)
            stored = None if row is None or row.spec is None else row.stage
            self._stage_read = ((r, a), now, stored)
        if stored is None or stored in ("aborted", "closed"):
            return False
        order = SECAGG_STAGES
        return stored in order and order.index(stored) >= order.index(stage)

    def answer(self, name: str, member: str, r: int, a: int) -> Any:
        """``name`` (key_list, share_relay, unmask_request, consistency_proof) for
        ``member`` of attempt (r, a), once it reached that answer's stage.

        Raises:
            WrongStage: not that attempt, or it has not reached the stage.
            UnknownMember, WrongGroup: as :meth:`accept`.
        """
        s = self.served()
        s.live.expect_at_least(member, r, a, ANSWER_STAGES[name])
        _, session = self._group_of(s, member)
        if name in ("unmask_request", "consistency_proof"):
            # the leader's change token means nothing here: the member's next poll of the
            # leader reads the state anew
            return getattr(session, name)(member, 0)
        return getattr(session, name)(member)
