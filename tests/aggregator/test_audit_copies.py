"""The audit trail's copies of the state database: archive objects of accepted messages
and ``audit/log.jsonl`` lines, written without an fsync per message and made durable at
the round close (:mod:`fedsec.aggregator.storage.audit_trail`).

A machine crash is simulated by what it may leave of writes that were never fsynced:
the newest archive objects missing or short, the file cut mid-line.  The aggregator is
then started again on the same workspace, as ``test_coordinator``'s restart tests do.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedsec import archive as archive_module
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.storage.audit_trail import LOG_FILE, SYNCED_BEFORE, AuditTrail
from fedsec.aggregator.workspace import STATE_DB, Workspace
from fedsec.audit.verify import verify_log
from fedsec.fsio import sync_filesystem
from tests.support.aggregator import (
    Cohort,
    FakeClock,
    Federation,
    advertise_all,
    fetch_shares,
    fix_cohort,
    log_entries,
    make_federation,
    mask_all,
    share_all,
    unmask_all,
)
from tests.support.http import AGENTS, Api

MEMBERS = ("a0", "a1", "a2", "a3", "a4")


def _open_round(coord: Coordinator, fed: Federation, members: tuple[str, ...]) -> Cohort:
    cohort = fix_cohort(coord, fed.identities, members)
    assert coord.live.stage == "advertise"
    return cohort


def _to_consistency(coord: Coordinator, cohort: Cohort, members: tuple[str, ...]) -> None:
    advertise_all(coord, cohort, members)
    share_all(coord, cohort, members)
    fetch_shares(coord, cohort, members)
    mask_all(coord, cohort, members)
    assert coord.live.stage == "consistency"


def _accepted(fed: Federation, round_: int) -> list[dict[str, Any]]:
    return [
        e for e in log_entries(fed.ws) if e["kind"] == "accepted" and e["body"]["round"] == round_
    ]


def _file_is_the_database(fed: Federation) -> None:
    lines = b"".join(line + b"\n" for _, line in fed.ws.state.log.log_lines())
    assert (fed.root / LOG_FILE).read_bytes() == lines


def _verifies(root: Path) -> None:
    audit = root / "audit"
    result = verify_log(audit / "log.jsonl", audit / "archive", root)
    assert result.ok, result.problem


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every fsync and syncfs the process makes from Python, by kind."""
    calls: list[str] = []
    fsync = os.fsync

    def counted_fsync(fd: int) -> None:
        calls.append("fsync")
        fsync(fd)

    def counted_syncfs(path: Path | str) -> bool:
        calls.append("syncfs")
        return sync_filesystem(path)

    monkeypatch.setattr(os, "fsync", counted_fsync)
    monkeypatch.setattr(archive_module, "sync_filesystem", counted_syncfs)
    yield calls


def test_an_accepted_message_costs_no_fsync_until_the_round_closes(
    tmp_path: Path, clock: FakeClock, syncs: list[str]
) -> None:
    fed = make_federation(tmp_path / "ws")
    coord = Coordinator(fed.ws, clock=clock)
    cohort = _open_round(coord, fed, MEMBERS)
    syncs.clear()
    _to_consistency(coord, cohort, MEMBERS)
    # 15 messages archived and logged, each acknowledged after the database's commit
    assert len(_accepted(fed, 1)) == 3 * len(MEMBERS)
    assert syncs == []
    unmask_all(coord, cohort, MEMBERS)
    assert coord.live.round == 2
    # the close made the archive durable in one pass, then fsynced the file once
    assert syncs.count("syncfs") + syncs.count("fsync") >= 2
    assert "syncfs" in syncs or syncs.count("fsync") > len(_accepted(fed, 1))
    (head,) = [e for e in log_entries(fed.ws) if e["kind"] == "head"]
    # the watermark: every object named before the close's head is durable
    assert fed.ws.state.values.get(SYNCED_BEFORE) == str(head["index"]).encode()
    _file_is_the_database(fed)


@pytest.mark.parametrize("watermark", ["recorded", "absent"])
def test_objects_and_log_lines_a_machine_crash_lost_are_restored_before_serving(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, watermark: str
) -> None:
    """Round 2's messages were accepted and acknowledged (receipts); the machine then
    crashed before the round closed, losing the writes that were never fsynced.
    ``absent``: a workspace whose round 1 an older release closed (it fsynced every
    object and recorded no watermark): its last head stands for it."""
    root = tmp_path / "ws"
    fed = make_federation(root, auditors=("aud",))
    coord = Coordinator(fed.ws, clock=clock)
    cohort = _open_round(coord, fed, MEMBERS)
    _to_consistency(coord, cohort, MEMBERS)
    unmask_all(coord, cohort, MEMBERS)
    cohort = _open_round(coord, fed, MEMBERS)
    _to_consistency(coord, cohort, MEMBERS)
    receipts = {m: coord.receipt(m, 2) for m in MEMBERS}
    accepted = _accepted(fed, 2)
    digests = [str(e["body"]["sha256"]) for e in accepted]
    archive = coord.trail.archive
    whole = {d: archive.path(d).read_bytes() for d in digests}

    # the crash: the newest objects gone, the last one short under its own name, the
    # file cut in the middle of round 2's first accepted line
    for digest in digests[:-1]:
        archive.path(digest).unlink()
    torn = digests[-1]
    archive.path(torn).write_bytes(whole[torn][: len(whole[torn]) // 2])
    log_file = root / LOG_FILE
    text = log_file.read_bytes()
    first = next(line for i, line in fed.ws.state.log.log_lines() if i == accepted[0]["index"])
    log_file.write_bytes(text[: text.index(first) + len(first) // 2])
    fed.ws.close()  # no clean stop: the process is gone with the machine
    if watermark == "absent":
        with sqlite3.connect(root / STATE_DB) as db:
            deleted = db.execute("DELETE FROM server_state WHERE name = ?", (SYNCED_BEFORE,))
            assert deleted.rowcount == 1

    caplog.set_level(logging.INFO, logger="fedsec.aggregator.storage.audit_trail")
    caplog.clear()  # only the restart's records: an earlier test may have set INFO
    ws = Workspace.open(root)
    fed = Federation(ws, fed.identities)
    coord = Coordinator(ws, clock=clock)
    # before anything is served: every object back, whole, and the file the database's
    for digest in digests:
        assert archive.path(digest).read_bytes() == whole[digest]
    _file_is_the_database(fed)
    # bounded: only the entries since round 1's close were checked, not the history
    (checked,) = [r.getMessage() for r in caplog.records if "event=archive_checked" in r.msg]
    assert f"checked={len(digests)} rewritten={len(digests)}" in checked
    _verifies(root)

    # no round lost: the members' receipts stand and round 2 closes
    assert {m: coord.receipt(m, 2) for m in MEMBERS} == receipts
    unmask_all(coord, cohort, MEMBERS)
    assert [(r.round, r.stage) for r in ws.state.rounds.history()] == [
        (1, "closed"),
        (2, "closed"),
        (3, "open"),
    ]
    assert coord.archived("aud", torn) == whole[torn]
    _verifies(root)
    ws.close()


def test_an_object_the_database_cannot_restore_is_reported_lost(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ws"
    fed = make_federation(root)
    coord = Coordinator(fed.ws, clock=clock)
    cohort = _open_round(coord, fed, MEMBERS)
    _to_consistency(coord, cohort, MEMBERS)
    first = _accepted(fed, 1)[0]
    digest = str(first["body"]["sha256"])
    path = coord.trail.archive.path(digest)
    path.unlink()
    fed.ws.close()
    # the database's copy damaged too, outside the aggregator: nothing to restore from
    with sqlite3.connect(root / STATE_DB) as db:
        db.execute(
            "UPDATE messages SET body = x'00' WHERE stage = ? AND member = ?",
            (first["body"]["stage"], first["body"]["member"]),
        )

    caplog.set_level(logging.INFO, logger="fedsec.aggregator.storage.audit_trail")
    caplog.clear()  # only the restart's records: an earlier test may have set INFO
    ws = Workspace.open(root)
    # the audit trail alone: the round's replay would refuse the damaged message next
    AuditTrail(root, ws.state.log, ws.signer, ws.federation_id, store=ws.state)
    lost = [r.getMessage() for r in caplog.records if "event=archive_object_lost" in r.msg]
    assert len(lost) == 1 and f"sha256={digest}" in lost[0]
    assert not path.exists()  # nothing written that is not the message
    ws.close()


@pytest.mark.asyncio
async def test_a_torn_archive_object_is_never_served_to_an_auditor(
    api: Api, syncs: list[str]
) -> None:
    coord, fed = api.coord, api.fed
    cohort = _open_round(coord, fed, AGENTS)
    _to_consistency(coord, cohort, AGENTS)
    unmask_all(coord, cohort, AGENTS)
    digest = str(_accepted(fed, 1)[-1]["body"]["sha256"])
    path = coord.trail.archive.path(digest)
    whole = path.read_bytes()
    url = f"/v1/audit/archive/{digest}"
    status, raw, _ = await api.call("aud", "GET", url)
    assert (status, raw) == (200, whole)

    # what a crash can leave under the object's name: its first half
    path.write_bytes(whole[: len(whole) // 2])
    detail = await api.refused(400, "integrity_error", lambda: api.call("aud", "GET", url))
    assert digest in detail
    assert path.read_bytes() == whole[: len(whole) // 2]  # the refusal changed nothing

    # a clean stop makes what the next round's messages wrote durable
    cohort = _open_round(coord, fed, AGENTS)
    advertise_all(coord, cohort, AGENTS)
    syncs.clear()
    await api.client.close()
    assert "syncfs" in syncs or "fsync" in syncs
