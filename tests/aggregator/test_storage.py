"""The storage interfaces' contract, run against every implementation.

Each test takes a ``backend``: how to open (and reopen) one empty store, and the
exception its ``add`` methods refuse a second row under the same key with: SQLite, and
PostgreSQL on a real cluster (tests.support.postgres; each test gets a fresh database;
without the server binaries the PostgreSQL cases skip, and fail under CI=true).  What
only SQLite promises (the file's pragmas and schema) is at the end.
"""

from __future__ import annotations

import ast
import contextlib
import math
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from fedsec.aggregator.storage import StateStore
from fedsec.aggregator.storage.postgres import PostgresStateStore
from fedsec.aggregator.storage.sqlite import SCHEMA, SqliteStateStore
from tests.support.postgres import Postgres, fresh_database, postgres_server


@dataclass
class Backend:
    open: Callable[[], StateStore]  # the same store each call, as a restarted process sees it
    duplicate: type[Exception]


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def _leading(store: PostgresStateStore) -> PostgresStateStore:
    # the previous store released the lease at close, as a clean stop does
    assert store.lease.acquire(time.time())
    return store


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend(lambda: SqliteStateStore(tmp_path / "state.db"), sqlite3.IntegrityError)
    if request.param == "postgres":
        url = fresh_database(request.getfixturevalue("postgres"))
        return Backend(lambda: _leading(PostgresStateStore(url)), psycopg.IntegrityError)
    raise AssertionError(request.param)  # pragma: no cover


@pytest.fixture
def state(backend: Backend) -> Iterator[StateStore]:
    store = backend.open()
    yield store
    store.close()


class Boom(Exception):
    pass


# -- rounds and joins ---------------------------------------------------------------------


def test_rounds_open_move_and_close(state: StateStore) -> None:
    assert state.rounds.latest() is None and state.rounds.get(1, 0) is None
    state.rounds.open(1, 0, 10.0)
    row = state.rounds.get(1, 0)
    assert row is not None and (row.stage, row.opened_at, row.stage_started_at) == ("open", 10, 10)
    assert (row.spec, row.closed_at, row.model_version, row.summary, row.detail) == (
        None,
        None,
        None,
        None,
        "",
    )
    state.rounds.set_stage(1, 0, "advertise", 11.0, spec=b"spec")
    state.rounds.set_stage(1, 0, "share_keys", 12.0, detail="slow")
    row = state.rounds.get(1, 0)
    assert row is not None
    assert (row.stage, row.stage_started_at, row.spec, row.detail) == (
        "share_keys",
        12,
        b"spec",
        "slow",
    )
    state.rounds.close(1, 0, "closed", 13.0, model_version=2, summary=b"sum", detail="ok")
    row = state.rounds.get(1, 0)
    assert row is not None
    assert (row.stage, row.closed_at, row.model_version, row.summary, row.detail) == (
        "closed",
        13,
        2,
        b"sum",
        "ok",
    )
    assert row.opened_at == 10 and row.spec == b"spec"


def test_rounds_history_is_oldest_first_and_latest_is_newest(state: StateStore) -> None:
    for round_, attempt in [(1, 0), (1, 1), (2, 0), (3, 0)]:
        state.rounds.open(round_, attempt, float(round_))
    state.rounds.close(1, 0, "aborted", 1.5, model_version=None, summary=b"", detail="")
    state.rounds.close(1, 1, "closed", 1.6, model_version=2, summary=b"", detail="")
    state.rounds.close(2, 0, "closed", 2.5, model_version=3, summary=b"", detail="")
    assert [(r.round, r.attempt) for r in state.rounds.history()] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (3, 0),
    ]
    assert [(r.round, r.attempt) for r in state.rounds.history(2)] == [(2, 0), (3, 0)]
    latest = state.rounds.latest()
    assert latest is not None and (latest.round, latest.attempt, latest.stage) == (3, 0, "open")
    assert state.rounds.count_closed() == 2


def test_a_round_attempt_is_opened_once(backend: Backend, state: StateStore) -> None:
    state.rounds.open(1, 0, 1.0)
    with pytest.raises(backend.duplicate):
        state.rounds.open(1, 0, 2.0)
    row = state.rounds.get(1, 0)
    assert row is not None and row.opened_at == 1 and len(state.rounds.history()) == 1


def test_joins_keep_their_order_bases_and_times(backend: Backend, state: StateStore) -> None:
    state.joins.add(1, 0, "zed", 30, 5.0, base_version=4)
    state.joins.add(1, 0, "amy", 10, 6.0)
    state.joins.add(1, 0, "bob", 20, 7.0, base_version=3)
    state.joins.add(1, 1, "amy", 99, 8.0)
    assert list(state.joins.samples(1, 0).items()) == [("zed", 30), ("amy", 10), ("bob", 20)]
    assert state.joins.bases(1, 0) == {"zed": 4, "amy": None, "bob": 3}
    assert [state.joins.nth_time(1, 0, n) for n in (1, 2, 3)] == [5.0, 6.0, 7.0]
    assert math.isinf(state.joins.nth_time(1, 0, 4))
    assert state.joins.samples(2, 0) == {} and state.joins.bases(2, 0) == {}
    assert [state.joins.count(1, 0), state.joins.count(1, 1), state.joins.count(2, 0)] == [3, 1, 0]
    assert state.joins.joined(1, 0, "bob") and not state.joins.joined(1, 1, "bob")
    with pytest.raises(backend.duplicate):
        state.joins.add(1, 0, "amy", 11, 9.0)
    assert state.joins.samples(1, 0)["amy"] == 10


# -- messages, reports, receipts ----------------------------------------------------------


def test_messages_replay_in_acceptance_order(backend: Backend, state: StateStore) -> None:
    seqs = [
        state.messages.add(1, 0, "advertise", member, member.encode())
        for member in ("m2", "m0", "m1")
    ]
    state.messages.add(1, 0, "share_keys", "m0", b"shares")
    state.messages.add(1, 1, "advertise", "m0", b"other attempt")
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert list(state.messages.of_stage(1, 0, "advertise")) == [
        ("m2", b"m2"),
        ("m0", b"m0"),
        ("m1", b"m1"),
    ]
    assert state.messages.count(1, 0, "advertise") == 3
    assert state.messages.count(1, 0, "unmask") == 0
    assert state.messages.get(1, 0, "share_keys", "m0") == b"shares"
    assert state.messages.get(1, 0, "share_keys", "m1") is None
    with pytest.raises(backend.duplicate):
        state.messages.add(1, 0, "advertise", "m0", b"again")
    assert state.messages.get(1, 0, "advertise", "m0") == b"m0"
    assert state.messages.count(1, 0, "advertise") == 3
    # what a reader that saw up to a sequence number lacks (the leader reading what
    # group servers stored): that stage and attempt only, in order
    assert list(state.messages.after(1, 0, "advertise", seqs[0])) == [
        (seqs[1], "m0", b"m0"),
        (seqs[2], "m1", b"m1"),
    ]
    assert list(state.messages.after(1, 0, "advertise", seqs[2])) == []
    assert [m for _, m, _ in state.messages.after(1, 0, "share_keys", 0)] == ["m0"]


def test_reports_and_their_epsilons(backend: Backend, state: StateStore) -> None:
    assert state.reports.epsilons() == {} and state.reports.epsilon_max(1, 0) is None
    state.reports.add(1, 0, "a", 0.5, b"ra1")
    state.reports.add(1, 0, "b", 0.75, b"rb1")
    state.reports.add(2, 0, "a", 1.25, b"ra2")
    assert state.reports.get(1, 0, "a") == b"ra1" and state.reports.get(1, 1, "a") is None
    assert state.reports.epsilons() == {"a": 1.25, "b": 0.75}
    assert state.reports.epsilon_max(1, 0) == 0.75
    with pytest.raises(backend.duplicate):
        state.reports.add(1, 0, "a", 9.0, b"forged")
    assert state.reports.get(1, 0, "a") == b"ra1" and state.reports.epsilon_max(1, 0) == 0.75


def test_the_receipt_of_a_round_is_its_newest_attempts(backend: Backend, state: StateStore) -> None:
    assert state.receipts.latest(1, "a") is None
    state.receipts.add(1, 0, "a", b"first")
    state.receipts.add(1, 2, "a", b"third")
    state.receipts.add(1, 1, "a", b"second")
    state.receipts.add(1, 0, "b", b"b's")
    assert state.receipts.latest(1, "a") == b"third" and state.receipts.latest(1, "b") == b"b's"
    assert state.receipts.latest(2, "a") is None
    with pytest.raises(backend.duplicate):
        state.receipts.add(1, 2, "a", b"replaced")
    assert state.receipts.latest(1, "a") == b"third"


# -- challenges, log, values --------------------------------------------------------------


def test_challenges_stay_open_until_revealed(backend: Backend, state: StateStore) -> None:
    state.challenges.add(2, 0, "m", "aud1", b"c2")
    state.challenges.add(1, 0, "m", "aud1", b"c1")
    state.challenges.add(1, 0, "m", "aud2", b"c1'")
    state.challenges.add(1, 0, "n", "aud1", b"cn")
    assert state.challenges.count() == 4
    assert state.challenges.get(1, 0, "m", "aud1") == b"c1"
    assert state.challenges.get(1, 1, "m", "aud1") is None
    assert sorted(state.challenges.open_for("m")[:2]) == [b"c1", b"c1'"]
    assert state.challenges.open_for("m")[2] == b"c2"
    state.challenges.add_reveal(1, 0, "m", "aud1", b"r1")
    state.challenges.add_reveal(1, 0, "n", "aud1", b"rn")
    assert sorted(state.challenges.open_for("m")) == [b"c1'", b"c2"]
    assert state.challenges.open_for("n") == []
    assert state.challenges.reveals_for("aud1") == [b"r1", b"rn"]
    assert state.challenges.reveals_for("aud2") == []
    with pytest.raises(backend.duplicate):
        state.challenges.add_reveal(1, 0, "m", "aud1", b"again")
    assert state.challenges.reveals_for("aud1") == [b"r1", b"rn"]


def test_log_lines_in_index_order(backend: Backend, state: StateStore) -> None:
    assert state.log.log_tail() is None and list(state.log.log_lines()) == []
    for index in range(4):
        state.log.add_log_line(index, f"line {index}".encode())
    assert state.log.log_tail() == (3, b"line 3")
    assert list(state.log.log_lines(2)) == [(2, b"line 2"), (3, b"line 3")]
    assert [i for i, _ in state.log.log_lines()] == [0, 1, 2, 3]
    with pytest.raises(backend.duplicate):
        state.log.add_log_line(3, b"rewritten")
    assert state.log.log_tail() == (3, b"line 3")


def test_values_are_replaced(state: StateStore) -> None:
    assert state.values.get("fedadam.m") is None
    state.values.put("fedadam.m", b"\x00\x01")
    state.values.put("fedadam.m", b"\x02")
    state.values.put("fedadam.v", b"")
    assert state.values.get("fedadam.m") == b"\x02" and state.values.get("fedadam.v") == b""


# -- transactions and durability ----------------------------------------------------------


def _write_one_of_each(state: StateStore) -> None:
    state.rounds.open(1, 0, 1.0)
    state.joins.add(1, 0, "a", 10, 1.0)
    state.messages.add(1, 0, "advertise", "a", b"keys")
    state.reports.add(1, 0, "a", 1.0, b"report")
    state.receipts.add(1, 0, "a", b"receipt")
    state.challenges.add(1, 0, "a", "aud", b"challenge")
    state.log.add_log_line(0, b"entry")
    state.values.put("k", b"v")


def _nothing_written(state: StateStore) -> bool:
    return (
        state.rounds.latest() is None
        and state.joins.samples(1, 0) == {}
        and state.messages.count(1, 0, "advertise") == 0
        and state.reports.get(1, 0, "a") is None
        and state.receipts.latest(1, "a") is None
        and state.challenges.get(1, 0, "a", "aud") is None
        and state.log.log_tail() is None
        and state.values.get("k") is None
    )


def test_an_exception_rolls_back_every_concern_together(state: StateStore) -> None:
    with pytest.raises(Boom), state.transaction():
        _write_one_of_each(state)
        assert state.log.in_transaction()
        raise Boom
    assert not state.log.in_transaction()
    assert _nothing_written(state)


def test_a_nested_transaction_joins_the_outer_one(state: StateStore) -> None:
    commits: list[int] = []
    state.log.on_commit(lambda: commits.append(len(list(state.log.log_lines()))))
    with pytest.raises(Boom), state.transaction():
        with state.transaction():
            _write_one_of_each(state)
        assert state.log.in_transaction() and commits == []  # the inner exit committed nothing
        raise Boom
    assert _nothing_written(state) and commits == []
    with state.transaction():
        with state.transaction():
            _write_one_of_each(state)
        assert commits == []
    assert commits == [1]


def test_commit_callbacks_run_after_each_commit_in_order(state: StateStore) -> None:
    calls: list[str] = []
    state.log.on_commit(lambda: calls.append(f"first:{state.log.in_transaction()}"))
    state.log.on_commit(lambda: calls.append("second"))
    state.log.add_log_line(0, b"outside any transaction")  # committed by itself, no callback
    assert calls == [] and not state.log.in_transaction()
    with state.transaction():
        state.log.add_log_line(1, b"inside")
        assert calls == []
    assert calls == ["first:False", "second"]
    with pytest.raises(Boom), state.transaction():
        state.log.add_log_line(2, b"rolled back")
        raise Boom
    assert calls == ["first:False", "second"] and state.log.log_tail() == (1, b"inside")


def test_committed_state_survives_a_reopen(backend: Backend) -> None:
    first = backend.open()
    with first.transaction():
        _write_one_of_each(first)
        first.rounds.set_stage(1, 0, "advertise", 2.0, spec=b"spec")
    with contextlib.suppress(Boom), first.transaction():
        first.log.add_log_line(1, b"never committed")
        raise Boom
    first.close()
    again = backend.open()
    try:
        row = again.rounds.latest()
        assert row is not None and (row.stage, row.spec) == ("advertise", b"spec")
        assert list(again.messages.of_stage(1, 0, "advertise")) == [("a", b"keys")]
        assert again.log.log_tail() == (0, b"entry") and again.values.get("k") == b"v"
        assert again.joins.samples(1, 0) == {"a": 10}
    finally:
        again.close()


# -- what only the SQLite implementation promises ------------------------------------------


def test_sqlite_file_is_wal_synchronous_full_with_the_released_schema(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "state.db")
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "state.db")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type='table'"))
    with contextlib.closing(sqlite3.connect(":memory:")) as reference:
        reference.executescript(SCHEMA)
        expected = dict(reference.execute("SELECT name, sql FROM sqlite_master WHERE type='table'"))
    assert tables == expected
    assert set(tables) >= {
        "rounds",
        "joins",
        "messages",
        "reports",
        "receipts",
        "log",
        "challenges",
        "reveals",
        "server_state",
    }


# -- the round logic depends on the interfaces only ----------------------------------------

_AGGREGATOR = Path(__file__).resolve().parents[2] / "fedsec" / "aggregator"
# Only the workspace opens concrete stores; the nonce replay cache (nonces.py) is the
# HTTP layer's own SQLite file, not aggregator state.
_OPENS_STORES = {"workspace.py", "nonces.py"}
_ROUND_LOGIC = sorted(
    path
    for path in _AGGREGATOR.rglob("*.py")
    if "storage" not in path.relative_to(_AGGREGATOR).parts[:1]
    and path.relative_to(_AGGREGATOR).as_posix() not in _OPENS_STORES
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", _ROUND_LOGIC, ids=lambda p: p.relative_to(_AGGREGATOR).as_posix())
def test_round_logic_imports_no_storage_implementation(path: Path) -> None:
    concrete = {
        name
        for name in _imports(path)
        if name.split(".")[0] in {"sqlite3", "psycopg"}
        or name.startswith(
            ("fedsec.aggregator.storage.sqlite", "fedsec.aggregator.storage.postgres")
        )
    }
    assert concrete == set()
