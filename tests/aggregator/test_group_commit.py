"""Group commit in a group server's intake (:mod:`fedsec.aggregator.groups.batch`): the
messages a desk validated while the store was busy are stored, logged and receipted in
one transaction, and none is answered before that transaction committed.

Each test drives a real :class:`~fedsec.aggregator.groups.desk.GroupDesk` over a real
SQLite store, the leader in process; concurrent requests are concurrent awaits of the
desk on one event loop, as its aiohttp handlers await it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedsec import archive
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.groups import batch, hosts
from fedsec.aggregator.groups.desk import GroupDesk
from fedsec.aggregator.groups.hosts import GroupTakenOver, StoreGroupHosts
from fedsec.aggregator.storage.interfaces import StateStore
from fedsec.audit.verify import verify_log
from fedsec.errors import DuplicateMessage
from fedsec.protocol import codec, wire
from fedsec.protocol.shards import group_index
from tests.aggregator.test_group_servers import DESK_URLS, _desk_cohort, _federation
from tests.support.aggregator import Cohort, Federation, join_request, log_entries

#: Enough members that one desk serves a batch of many (both groups: one URL serves
#: every group, dealt round-robin).
MANY = tuple(f"c{i:02d}" for i in range(16))


class _Transactions:
    """Counts ``state``'s outer transactions; ``fail_commit`` makes the next ones' COMMIT
    fail (rolled back, then sqlite3's error), ``before`` runs just before the next one
    begins (the leader's move, at the worst moment for the batch)."""

    def __init__(self, state: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.fail_commit = 0
        self.before: Callable[[], None] | None = None
        self._real = state.transaction
        monkeypatch.setattr(state, "transaction", self._transaction)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.before is not None:
            before, self.before = self.before, None
            before()
        real = self._real()
        real.__enter__()
        self.count += 1
        try:
            yield
        except BaseException as exc:
            real.__exit__(type(exc), exc, None)
            raise
        if self.fail_commit:
            self.fail_commit -= 1
            real.__exit__(OSError, OSError("injected"), None)  # nothing of it is kept
            raise sqlite3.OperationalError("disk I/O error (injected at COMMIT)")
        real.__exit__(None, None, None)


def _advertising(tmp_path: Path) -> tuple[Federation, Cohort, GroupDesk]:
    """:data:`MANY` joined round 1 (two groups, both served at one URL); its desk."""
    url = DESK_URLS[0]
    fed = _federation(tmp_path / "ws", [url], MANY)
    coord = Coordinator(fed.ws)
    for m in MANY:
        assert coord.join(m, 1, 0, join_request(m, 1)).accepted
    spec = coord.live.spec
    assert spec is not None and coord.live.stage == "advertise"
    assert {g.url for g in spec.groups} == {url} and len(spec.groups) == 2
    return fed, Cohort(spec, fed.identities), GroupDesk(fed.ws, url)


async def _advertise_all(desk: GroupDesk, cohort: Cohort, members: tuple[str, ...]) -> list[Any]:
    """Each member's advertisement, sent at once; each outcome (an error, or None)."""

    async def one(m: str) -> None:
        body = cohort.advertise(m)
        raw = wire.encode(body)
        await desk.accept(m, 1, 0, "advertise", raw, lambda m: codec.advertise_message(m, body))

    return await asyncio.gather(*(one(m) for m in members), return_exceptions=True)


def _log_verifies(fed: Federation, tmp_path: Path) -> None:
    """The store's log, as the leader's file will copy it, verifies (chain, archive)."""
    copy = tmp_path / "log.jsonl"
    copy.write_bytes(b"".join(bytes(line) + b"\n" for _, line in fed.ws.state.log.log_lines(0)))
    verified = verify_log(copy, fed.root / "audit" / "archive", fed.root)
    assert verified.ok, verified.problem


def test_concurrent_messages_commit_in_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 advertisements at once: one transaction stores and logs them all (one WAL
    fsync under the shared write lock, not 16), each logged once, in the chain."""
    fed, cohort, desk = _advertising(tmp_path)
    before = len(log_entries(fed.ws))
    counted = _Transactions(fed.ws.state, monkeypatch)
    outcomes = asyncio.run(_advertise_all(desk, cohort, MANY))
    assert outcomes == [None] * len(MANY)
    assert counted.count == 1 < len(MANY)
    assert fed.ws.state.messages.count(1, 0, "advertise") == len(MANY) == desk.accepted
    logged = [e["body"]["member"] for e in log_entries(fed.ws, before)]
    assert sorted(logged) == sorted(MANY)
    _log_verifies(fed, tmp_path)
    fed.ws.close()


def test_a_batch_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past :data:`~fedsec.aggregator.groups.batch.MAX_BATCH` messages a batch is split:
    the write lock is never held for more than that many messages' writes."""
    monkeypatch.setattr(batch, "MAX_BATCH", 5)
    fed, cohort, desk = _advertising(tmp_path)
    counted = _Transactions(fed.ws.state, monkeypatch)
    assert asyncio.run(_advertise_all(desk, cohort, MANY)) == [None] * len(MANY)
    assert counted.count == 4  # 5 + 5 + 5 + 1
    assert fed.ws.state.messages.count(1, 0, "advertise") == len(MANY)
    fed.ws.close()


def test_no_receipt_before_the_batch_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (a receipt for a contribution the store lost): the batch's COMMIT fails
    after every message of it was validated and written.  No sender gets a receipt;
    nothing of the batch is stored, logged or receipted; the sessions are rebuilt from
    the store, and the same uploads then succeed, receipted as logged."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)
    fed, _, cohort = _desk_cohort(tmp_path, DESK_URLS)
    spec = cohort.spec
    desk = GroupDesk(fed.ws, DESK_URLS[0])
    ours = spec.groups[0].members
    uploads = {m: cohort.upload(m) for m in ours}
    before = len(log_entries(fed.ws))
    counted = _Transactions(fed.ws.state, monkeypatch)
    counted.fail_commit = 1

    async def send() -> list[Any]:
        return await asyncio.gather(
            *(desk.masked_input(m, 1, 0, *uploads[m]) for m in ours), return_exceptions=True
        )

    failed = asyncio.run(send())
    assert all(isinstance(o, sqlite3.OperationalError) for o in failed), failed
    assert counted.count == 1  # one batch, one failed commit: no answer came before it
    assert fed.ws.state.messages.count(1, 0, "masked_input") == 0
    assert all(fed.ws.state.receipts.latest(1, m) is None for m in ours)
    assert len(log_entries(fed.ws)) == before and desk.accepted == 0
    served = desk.served()  # rebuilt from the store: the sessions hold none of them
    assert served.fed_through == "masked_input"
    receipts = asyncio.run(send())
    assert counted.count == 2
    logged = {e["body"]["member"]: e for e in log_entries(fed.ws, before)}
    assert sorted(logged) == sorted(ours)
    for m, receipt in zip(ours, receipts, strict=True):
        assert isinstance(receipt, wire.Receipt), receipt
        assert receipt.member == m and logged[m]["index"] == receipt.log_index
        receipt.verify(fed.ws.signer.public_bytes)
    _log_verifies(fed, tmp_path)
    fed.ws.close()


def test_a_fenced_group_does_not_lose_the_other_messages_of_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader takes group 1 over just before the batch's transaction: its members'
    messages are refused (503 not_leader: they move on to the leader), group 0's of the
    same batch are stored, in that one transaction."""
    fed, cohort, desk = _advertising(tmp_path)
    counted = _Transactions(fed.ws.state, monkeypatch)
    counted.before = lambda: StoreGroupHosts(fed.ws.state, 1, 0).take_over(1)
    outcomes = asyncio.run(_advertise_all(desk, cohort, MANY))
    spec = cohort.spec
    for m, outcome in zip(MANY, outcomes, strict=True):
        if group_index(spec.groups, m) == 1:
            assert isinstance(outcome, GroupTakenOver), outcome
            assert fed.ws.state.messages.get(1, 0, "advertise", m) is None
        else:
            assert outcome is None
            assert fed.ws.state.messages.get(1, 0, "advertise", m) is not None
    assert counted.count == 2  # the take-over's own, then the batch's
    assert desk.accepted == len(spec.groups[0].members)
    fed.ws.close()


def test_a_failed_write_does_not_lose_the_other_messages_of_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One message's write fails inside the batch's transaction: the batch is rolled
    back and its messages committed one by one; only that message is refused."""
    fed, cohort, desk = _advertising(tmp_path)
    unlucky = MANY[3]
    add = fed.ws.state.messages.add

    def failing(r: int, a: int, stage: str, member: str, body: bytes) -> None:
        if member == unlucky:
            raise sqlite3.IntegrityError("injected for one message")
        add(r, a, stage, member, body)

    monkeypatch.setattr(fed.ws.state.messages, "add", failing)
    counted = _Transactions(fed.ws.state, monkeypatch)
    outcomes = asyncio.run(_advertise_all(desk, cohort, MANY))
    assert [m for m, o in zip(MANY, outcomes, strict=True) if o is not None] == [unlucky]
    assert isinstance(outcomes[MANY.index(unlucky)], sqlite3.IntegrityError)
    assert counted.count == 1 + len(MANY)  # the rolled-back batch, then one each
    assert fed.ws.state.messages.count(1, 0, "advertise") == len(MANY) - 1
    assert desk.accepted == len(MANY) - 1
    _log_verifies(fed, tmp_path)
    fed.ws.close()


def test_a_retry_while_pending_gets_the_same_receipt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An identical masked input sent again while the first waits for its commit is
    answered with the same receipt (one stored, one logged); a different one from the
    same member meanwhile is a duplicate, refused and logged as refused."""
    monkeypatch.setattr(hosts, "STALE_S", 600.0)
    fed, _, cohort = _desk_cohort(tmp_path, DESK_URLS)
    desk = GroupDesk(fed.ws, DESK_URLS[0])
    m, other = cohort.spec.groups[0].members[:2]
    good = cohort.upload(m)
    forged = cohort.upload(m, bytes(reversed(good[0])))
    before = len(log_entries(fed.ws))

    async def send() -> list[Any]:
        return await asyncio.gather(
            desk.masked_input(m, 1, 0, *good),
            desk.masked_input(m, 1, 0, *good),
            desk.masked_input(m, 1, 0, *forged),
            desk.masked_input(other, 1, 0, *cohort.upload(other)),
            return_exceptions=True,
        )

    first, again, different, theirs = asyncio.run(send())
    assert isinstance(first, wire.Receipt) and again == first
    assert isinstance(theirs, wire.Receipt) and theirs.member == other
    assert isinstance(different, DuplicateMessage)
    assert fed.ws.state.messages.get(1, 0, "masked_input", m) == good[0]
    added = [(e["kind"], e["body"]["member"]) for e in log_entries(fed.ws, before)]
    assert sorted(added) == sorted([("refused", m), ("accepted", m), ("accepted", other)]), added
    assert desk.accepted == 2
    fed.ws.close()


def test_a_batchs_archive_objects_are_durable_before_its_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each object a batch's entries name is fsynced (one fsync each, with its
    directory) before the transaction that logs it begins, as a message's own was."""
    fed, cohort, desk = _advertising(tmp_path)
    events: list[str] = []
    fsync = os.fsync

    def recorded(fd: int) -> None:
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(archive.os, "fsync", recorded)
    counted = _Transactions(fed.ws.state, monkeypatch)
    counted.before = lambda: events.append("BEGIN")
    assert asyncio.run(_advertise_all(desk, cohort, MANY)) == [None] * len(MANY)
    objects = fed.root / "audit" / "archive"
    digests = [hashlib.sha256(wire.encode(cohort.advertise(m))).hexdigest() for m in MANY]
    begin = events.index("BEGIN")
    synced = events[:begin]
    assert sorted(synced[: len(MANY)]) == sorted(str(objects / d[:2] / d) for d in digests)
    assert {str(objects / d[:2]) for d in digests} <= set(synced[len(MANY) :])
    fed.ws.close()


class _FakeStore:
    """A :class:`~fedsec.aggregator.groups.batch.BatchStore` that records what it is
    asked: the batch rules without a database."""

    def __init__(self, refuse_group: int | None = None, fail_member: str = "") -> None:
        self.calls: list[str] = []
        self.committed: list[str] = []
        self._refuse, self._fail = refuse_group, fail_member
        self._open: list[str] = []

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.calls.append("begin")
        self._open = []
        yield
        self.committed += self._open
        self.calls.append("commit")

    def check(self, message: batch.Pending) -> None:
        self.calls.append(f"check {message.stage} {message.group}")
        if message.group == self._refuse:
            raise GroupTakenOver(f"group {message.group} taken over", None)

    def write(self, message: batch.Pending) -> wire.Receipt | None:
        if message.member == self._fail:
            raise sqlite3.IntegrityError("injected")
        self._open.append(message.member)
        return None


def _pending(member: str, group: int) -> batch.Pending:
    return batch.Pending(1, 0, "advertise", member, group, member.encode(), {})


def test_a_batch_reads_each_stage_and_fence_once() -> None:
    """The stage and the fence are read once per (attempt, stage, group) of a batch, and
    a refusal there is its group's messages' alone."""
    store = _FakeStore(refuse_group=1)
    messages = [_pending(f"m{i}", i % 2) for i in range(6)]
    assert batch.commit(messages, store) == 1
    assert store.calls == ["begin", "check advertise 0", "check advertise 1", "commit"]
    assert store.committed == ["m0", "m2", "m4"]
    assert all(m.settled for m in messages)
    assert [type(m.error) for m in messages[1::2]] == [GroupTakenOver] * 3
    assert all(m.accepted for m in messages[::2])


def test_the_queue_keeps_one_message_per_member_and_stage() -> None:
    queue = batch.CommitQueue()
    first = queue.join(_pending("m0", 0))
    assert queue.join(_pending("m0", 0)) is first  # identical: the same outcome
    different = batch.Pending(1, 0, "advertise", "m0", 0, b"other", {})
    with pytest.raises(DuplicateMessage, match="m0 already sent a different advertise"):
        queue.join(different)
    assert queue.take() == [first] and len(queue) == 1
    queue.settle([first])
    assert queue.pending(1, 0, "advertise", "m0") is None and queue.take() == []
