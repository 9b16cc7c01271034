"""``fedsec bench scale --shards N --intake 0,1,2,4``: intake throughput of a sharded
round with its groups' stage requests taken by the leader (0) or by that many group
server processes (``round.group_servers``), over the leader's SQLite store.

Each row is a real federation in a temporary directory: the leader is ``fedsec
aggregator serve``, each group server ``fedsec aggregator group-serve``, every member a
real :class:`~fedsec.crypto.secagg.ClientSession`.  This process joins the members, then
for each of the three upload stages (advertise, shares, masked input) prepares every
member's signed request first (client crypto and signatures are not timed), sends them
all, at most :data:`IN_FLIGHT` at a time, each to its group's server (or the leader),
and times from the first send to the last answer: an answer comes after the message's
commit, so ``accepted_per_s`` is accepted stage messages per second at the store.  The
fetches between stages (key lists, share relays) are not timed.

The floor is the machine: the sending side runs here too, and every process shares the
cores (``cores`` in the row); group servers over one SQLite file also share its write
lock, one commit at a time.  Rows of one run compare; the speed-up the issue asks of 4
processes needs as many cores as processes.

So each row also says what the processes spent, over the same three timed windows
(read just before the first send and just after the last answer of each stage, summed):

* ``leader_cpu_s``, ``group_server_cpu_s`` (one per server; absent with none) and
  ``sender_cpu_s``: CPU seconds (user + system, all threads; ``/proc/<pid>/stat`` for the
  servers, which counts in clock ticks, and this process's own for the sender);
* ``leader_cpu_s_to_next_stage``: the leader's CPU from the first send until the next
  stage is stored (its replay of what the servers stored can finish after their last
  answer, and the stage's turn is its work too);
* ``leader_cpu_ms_per_message`` (from ``leader_cpu_s_to_next_stage``),
  ``group_servers_cpu_ms_per_message`` (the servers' total) and
  ``sender_cpu_ms_per_message``: each over the ``messages`` accepted;
* ``store_lock_ms_per_message``: how long the writers (leader and servers together) held
  ``state.db``'s write lock per message, from each ``BEGIN IMMEDIATE``'s return to the
  return of its ``COMMIT`` (the WAL's fsync included), from the first send until the
  next stage is stored
  (``store_transactions`` of them); ``store_lock_cpu_ms_per_message`` and
  ``store_lock_core_wait_ms_per_message`` are the holding thread's CPU and its waits for
  a core (``run_delay``, ``/proc/thread-self/schedstat``) in those spans.  The serving
  processes are started through :data:`_LOCK_TIMED`, which times
  :class:`~fedsec.aggregator.storage.sqlite.connection.Transaction` in place (a few µs a
  transaction) and changes nothing else.  Writes outside a transaction (autocommit) and
  the nonce store's own file are not counted;
* ``leader_commit_wait_ms_per_message``, ``group_servers_commit_wait_ms_per_message``:
  the part of each process's own transactions, to the end of their after-commit
  callbacks (the log file's append and fsync, run after the lock is released), spent
  neither on a core nor waiting for one (the fsyncs): a commit runs on the event loop,
  so that time is the process's too.

From these, a **projection, not a measurement**: ``projected_accepted_per_s_with_cores``
is what the same per-message costs would allow with a core per serving process,

    min(1 / (c_leader + w_leader),  N / (c_servers + w_servers),  1 / (t_lock - q_lock))

(the group servers' term only for N > 0), per accepted message: ``c`` the CPU above
(``c_servers`` all servers' together), ``w`` the commit waits, N the server count,
``t_lock`` the lock's held time and ``q_lock`` the holders' waits for a core inside it
(a wait that a core of its own removes).  The servers' work divides over N processes;
the leader's share (its replay of every message, the round's bookkeeping) and the
store's serialized commits do not.  ``projected_limit`` names the smallest term.  The
stages are assumed to overlap perfectly and blocking outside a transaction (the
archive's fsyncs) is not counted, so the projection is an upper bound of what those
costs allow; the sender is left out (members send from their own machines), its own
bound is ``1 / sender_cpu``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import msgspec
import numpy as np
from yarl import URL

from fedsec.aggregator_client import AggregatorClient
from fedsec.bench.common import with_environment
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.secagg import ClientSession
from fedsec.crypto.secagg.messages import graph_commitment
from fedsec.federation import create_federation, enrol_agents, federation_toml
from fedsec.protocol import codec, wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.shards import group_index
from fedsec.task.digest import task_pin
from fedsec.tasks import get_task

#: Requests in flight at once: enough to keep every server busy, few enough that the
#: sending process's own event loop does not dominate.
IN_FLIGHT: Final = 32
TASK: Final = "mnist1d"
FED: Final = "intake"
START_S: Final = 90.0
STAGE_S: Final = 300.0
#: The counters a serving process keeps in its cell, each summed over its transactions:
#: the write lock's held seconds, the holding thread's CPU and waits for a core in them
#: (to ``COMMIT``'s return), the same three to the transaction's end (the after-commit
#: callbacks: the log file's append and fsync, after the lock is released), and the count.
_CELL: Final = struct.Struct("ddddddq")
#: Runs ``fedsec`` (argv[3:]) with the state store's transactions timed into the file
#: argv[1] (a :data:`_CELL`, whose format is argv[2], shared by mmap so this process
#: reads it at any instant).
#: A thread's waits for a core are its ``run_delay`` in ``/proc/thread-self/schedstat``;
#: ``released`` is put first among the connection's after-commit callbacks.
_LOCK_TIMED: Final = """
import mmap, os, struct, sys, threading, time
from fedsec.aggregator.storage.sqlite.connection import Transaction
CELL = struct.Struct(sys.argv[2])
cell = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), CELL.size)
total = [0.0] * 6 + [0]
schedstat = {}
def now():
    tid = threading.get_native_id()
    if tid not in schedstat:
        schedstat[tid] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    waited = int(os.pread(schedstat[tid], 100, 0).split()[1]) / 1e9
    return time.perf_counter(), time.thread_time(), waited
last = [None]
def released():
    last[0] = now()
enter, leave = Transaction.__enter__, Transaction.__exit__
def timed_enter(self):
    enter(self)
    if self._outer:
        if released not in self._after:
            self._after.insert(0, released)
        last[0] = None
        self._bench_at = now()
def timed_exit(self, *exc):
    leave(self, *exc)
    if self._outer:
        end = now()
        unlocked = last[0] or end
        for i in range(3):
            total[i] += unlocked[i] - self._bench_at[i]
            total[3 + i] += end[i] - self._bench_at[i]
        total[6] += 1
        CELL.pack_into(cell, 0, *total)
Transaction.__enter__, Transaction.__exit__ = timed_enter, timed_exit
sys.argv = ["fedsec", *sys.argv[3:]]
from fedsec.cli import main
main()
"""
_TICK_S: Final = 1 / os.sysconf("SC_CLK_TCK")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds, all its threads (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


Lock = tuple[float, float, float, float, float, float, int]  # one process's _CELL


@dataclass
class _Probe:
    """The serving processes' CPU and lock counters, summed over the timed windows."""

    pids: list[int]  # the leader first, then each group server
    cells: list[Path]  # in the same order
    cpu_s: list[float] = field(default_factory=list)
    sender_cpu_s: float = 0.0
    leader_cpu_s_to_stage: float = 0.0  # until the next stage is stored
    locks: list[Lock] = field(default_factory=list)

    def _locks(self) -> list[Lock]:
        out = []
        for path in self.cells:
            with open(path, "rb") as f:
                out.append(_CELL.unpack(f.read(_CELL.size)))
        return out

    async def window(self, run: Awaitable[float], then: Awaitable[Any]) -> float:
        """Await ``run`` (a stage's sends), adding what each process spent meanwhile, then
        ``then`` (the next stage stored), adding the leader's CPU and the store's lock
        until it ends."""
        cpu, own, locks = [_cpu_s(p) for p in self.pids], time.process_time(), self._locks()
        seconds = await run
        cpu_after, own_after = [_cpu_s(p) for p in self.pids], time.process_time()
        await then
        self.leader_cpu_s_to_stage += _cpu_s(self.pids[0]) - cpu[0]
        spent = [b - a for a, b in zip(cpu, cpu_after, strict=True)]
        self.cpu_s = [a + b for a, b in zip(self.cpu_s or [0.0] * len(spent), spent, strict=True)]
        self.sender_cpu_s += own_after - own
        self.locks = [
            _add(total, before, after)
            for total, before, after in zip(
                self.locks or [_NO_LOCK] * len(locks), locks, self._locks(), strict=True
            )
        ]
        return seconds

    def fields(self, messages: int) -> dict[str, Any]:
        """The row's CPU and lock fields and the projection (the module's formula)."""
        leader, servers = self.cpu_s[0], self.cpu_s[1:]
        # a process's own commits block its event loop: their time off the CPU (the
        # fsync), less its waits for a core, is its time too
        blocked = [max(span - cpu - waited, 0.0) for *_, span, cpu, waited, _ in self.locks]
        out: dict[str, Any] = {
            "messages": messages,
            "leader_cpu_s": round(leader, 3),
            "leader_cpu_s_to_next_stage": round(self.leader_cpu_s_to_stage, 3),
            "sender_cpu_s": round(self.sender_cpu_s, 3),
            "leader_cpu_ms_per_message": round(1000 * self.leader_cpu_s_to_stage / messages, 4),
            "sender_cpu_ms_per_message": round(1000 * self.sender_cpu_s / messages, 4),
            "leader_commit_wait_ms_per_message": round(1000 * blocked[0] / messages, 4),
        }
        t_leader = (self.leader_cpu_s_to_stage + blocked[0]) / messages
        bounds = {"leader": 1 / t_leader if t_leader else math.inf}
        if servers:
            out["group_server_cpu_s"] = [round(s, 3) for s in servers]
            out["group_servers_cpu_ms_per_message"] = round(1000 * sum(servers) / messages, 4)
            out["group_servers_commit_wait_ms_per_message"] = round(
                1000 * sum(blocked[1:]) / messages, 4
            )
            t_servers = (sum(servers) + sum(blocked[1:])) / messages
            bounds["group_servers"] = len(servers) / t_servers if t_servers else math.inf
        held, held_cpu, waited = (sum(lock[i] for lock in self.locks) for i in range(3))
        out["store_lock_ms_per_message"] = round(1000 * held / messages, 4)
        out["store_lock_cpu_ms_per_message"] = round(1000 * held_cpu / messages, 4)
        out["store_lock_core_wait_ms_per_message"] = round(1000 * waited / messages, 4)
        out["store_transactions"] = sum(lock[6] for lock in self.locks)
        t_lock = (held - waited) / messages
        bounds["store_lock"] = 1 / t_lock if t_lock > 0 else math.inf
        limit = min(bounds, key=bounds.__getitem__)
        out["projected_accepted_per_s_with_cores"] = round(bounds[limit], 1)
        out["projected_limit"] = limit
        return out


_NO_LOCK: Final[Lock] = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)


def _add(total: Lock, before: Lock, after: Lock) -> Lock:
    """``total`` plus what a process's counters grew by from ``before`` to ``after``."""
    s = [t + b - a for t, a, b in zip(total, before, after, strict=True)]
    return (s[0], s[1], s[2], s[3], s[4], s[5], int(s[6]))


@contextlib.contextmanager
def _processes(commands: list[list[str]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _healthy(http: aiohttp.ClientSession, urls: list[str]) -> None:
    end = time.monotonic() + START_S
    for url in urls:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/v1/health") as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > end:
                raise TimeoutError(f"{url} did not start within {START_S:g} s")
            await asyncio.sleep(0.1)


def _stored(db: Path) -> tuple[str, bytes | None]:
    """The newest attempt's stage and spec, read from the leader's store."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT stage, spec FROM rounds ORDER BY round DESC, attempt DESC LIMIT 1"
        ).fetchone()
    return ("", None) if row is None else (str(row[0]), row[1])


async def _stage(db: Path, stage: str) -> bytes:
    end = time.monotonic() + STAGE_S
    while True:
        at, spec = _stored(db)
        if at == stage and spec is not None:
            return bytes(spec)
        if at in ("aborted", "closed") or time.monotonic() > end:
            raise RuntimeError(f"the round did not reach {stage} (it is in {at or 'none'})")
        await asyncio.sleep(0.05)


Signed = tuple[str, dict[str, str], bytes]  # (url, headers, body)


def _signed(
    identity: SigningIdentity, base: str, target: str, body: bytes, content_type: str
) -> Signed:
    headers = {"Content-Type": content_type}
    headers |= sign_request(identity, "POST", target, headers, body, created=int(time.time()))
    return base + target, headers, body


async def _send_all(http: aiohttp.ClientSession, requests: list[Signed]) -> float:
    """Send every request (at most IN_FLIGHT at once); seconds from the first send to
    the last answer.

    Raises:
        RuntimeError: a request was refused.
    """
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(url: str, headers: dict[str, str], body: bytes) -> None:
        async with slots, http.post(URL(url, encoded=True), data=body, headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status} {answer[:200]!r}")

    start = time.perf_counter()
    await asyncio.gather(*(one(*r) for r in requests))
    return time.perf_counter() - start


async def _run(root: Path, members: int, shards: int, servers: int) -> dict[str, Any]:
    urls = [f"http://127.0.0.1:{_port()}" for _ in range(servers)]
    leader_port = _port()
    leader = f"http://127.0.0.1:{leader_port}"
    windows = {s: 600.0 for s in ("advertise_s", "share_s", "masked_s", "unmask_s")}
    toml = federation_toml(
        FED,
        TASK,
        round_={
            "min_agents": members,
            "max_agents": members,
            "shards": shards,
            "min_shard_members": max(3, members // shards),
            "group_servers": urls,
            "rounds": 1,
            **windows,
        },
        validation={"enabled": False},
    )
    ws = create_federation(root, FED, TASK, toml)  # the workspace is root/aggregator
    workspace = ws.root
    local = enrol_agents(ws, root, members)
    key, db = ws.signer.public_bytes, ws.root / "state.db"
    ws.close()
    ids = {a.agent_id: a.identity for a in local}
    cells = [root / f"lock-{i}.cell" for i in range(servers + 1)]
    for cell in cells:
        cell.write_bytes(bytes(_CELL.size))
    serve = [*_timed(cells[0]), "serve", "--workspace", str(workspace), "--host", "127.0.0.1"]
    commands = [[*serve, "--port", str(leader_port), "--log-level", "WARNING"]]
    commands += [
        [
            *_timed(cell),
            "group-serve",
            "--workspace",
            str(workspace),
            "--url",
            u,
            "--log-level",
            "WARNING",
        ]
        for u, cell in zip(urls, cells[1:], strict=True)
    ]
    connector = aiohttp.TCPConnector(limit=4 * IN_FLIGHT)
    with _processes(commands) as procs:
        async with aiohttp.ClientSession(connector=connector) as http:
            await _healthy(http, [leader, *urls])
            probe = _Probe([p.pid for p in procs], cells)
            return await _round(http, leader, key, db, ids, servers, probe)


def _timed(cell: Path) -> list[str]:
    """``fedsec aggregator`` started with its store's lock timed into ``cell``."""
    return [sys.executable, "-c", _LOCK_TIMED, str(cell), _CELL.format, "aggregator"]


async def _round(
    http: aiohttp.ClientSession,
    leader: str,
    key: bytes,
    db: Path,
    ids: dict[str, SigningIdentity],
    servers: int,
    probe: _Probe,
) -> dict[str, Any]:
    task = get_task(TASK)
    pin = task_pin(TASK)  # as the leader computed it when it started (the tree may change)
    nonces = {m: hashlib.sha256(f"graph/{m}".encode()).digest() for m in ids}
    clients = {m: AggregatorClient(leader, ids[m], key, session=http) for m in ids}
    for m, client in clients.items():
        commitment = graph_commitment(FED, 1, m, nonces[m]).hex()
        request = wire.JoinRequest(
            dataset_schema=task.schema.fingerprint(),
            task_version=task.version,
            samples=100,
            graph_commitment=commitment,
            task_pin=pin,
        )
        await client.join(1, 0, request)
    spec = msgspec.json.decode(await _stage(db, "advertise"), type=wire.RoundSpec)
    roster = {m: i.public_bytes for m, i in ids.items()}
    sessions = {
        m: ClientSession(spec.member_params(m), m, ids[m], roster, graph_nonce=nonces[m])
        for m in ids
    }
    at = {m: spec.groups[group_index(spec.groups, m)].url or leader for m in ids}
    fetch = {m: (c.for_group(at[m]) if at[m] != leader else c) for m, c in clients.items()}
    path = "/v1/rounds/1/{}?attempt=0"
    timings: dict[str, float] = {}

    async def stage(name: str, requests: list[Signed], then: str) -> None:
        timings[name] = await probe.window(_send_all(http, requests), _stage(db, then))

    advertise = {m: wire.encode(codec.advertise_body(s.advertise())) for m, s in sessions.items()}
    target = path.format("advertise")
    await stage(
        "advertise",
        [_signed(ids[m], at[m], target, b, "application/json") for m, b in advertise.items()],
        "share_keys",
    )
    keys = await _gather({m: fetch[m].keys(1, 0) for m in ids})
    shares = {}
    for m, s in sessions.items():
        out = s.share_keys(codec.key_list(keys[m]))
        shares[m] = wire.encode(
            wire.ShareKeysBody(
                shares=[
                    wire.OutgoingShare(recipient=x.recipient, ciphertext=x.ciphertext.hex())
                    for x in out.shares
                ]
            )
        )
    target = path.format("shares")
    await stage(
        "share_keys",
        [_signed(ids[m], at[m], target, b, "application/json") for m, b in shares.items()],
        "masked_input",
    )
    relays = await _gather({m: fetch[m].get_shares(1, 0) for m in ids})
    encoding = codec_for(spec)
    masked = []
    for i, (m, s) in enumerate(sessions.items()):
        s.receive_shares(codec.share_relay(relays[m], m))
        rng = np.random.default_rng(i)  # test updates only, never masks
        delta = (rng.standard_normal(spec.dim) / math.sqrt(spec.dim)).astype(np.float32)
        ring = encoding.encode(delta, 1.0, hashlib.sha256(f"rounding/{m}".encode()).digest())
        raw = s.masked_input(ring.ring).vector
        statement = wire.ContributionStatement(
            federation_id=FED,
            round=1,
            attempt=0,
            member=m,
            vector_sha256=hashlib.sha256(raw).hexdigest(),
            commitment=hashlib.sha256(b"bench/" + raw).hexdigest(),
        ).sign(ids[m])
        query = f"&commitment={statement.commitment}&signature={statement.signature}"
        target = path.format("masked-input") + query
        masked.append(_signed(ids[m], at[m], target, raw, "application/octet-stream"))
    await stage("masked_input", masked, "consistency")
    n = len(ids)
    total = sum(timings.values())
    return {
        "accepted_per_s": round(3 * n / total, 1),
        "accepted_per_s_by_stage": {k: round(n / v, 1) for k, v in timings.items()},
        "stage_wall_s": {k: round(v, 3) for k, v in timings.items()},
        "masked_input_bytes": len(masked[0][2]),
        "dim": spec.dim,
        "groups": len(spec.groups),
        "group_servers": servers,
        **probe.fields(3 * n),
    }


async def _gather(calls: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    values = await asyncio.gather(*calls.values())
    return dict(zip(calls, values, strict=True))


def intake_row(members: int, shards: int, servers: int) -> dict[str, Any]:
    """One round's upload stages of ``members`` in ``shards`` groups, taken by
    ``servers`` group server processes (0: the leader); its row.

    Raises:
        RuntimeError: a stage was refused or not reached.
        TimeoutError: a process did not start.
    """
    with tempfile.TemporaryDirectory(prefix="fedsec-intake-") as tmp:
        row = asyncio.run(_run(Path(tmp), members, shards, servers))
    return with_environment(
        {
            "bench": "scale",
            "part": "intake",
            "members": members,
            "shards": shards,
            "intake": "leader" if servers == 0 else "group_servers",
            **row,
            "store": "sqlite",
            "in_flight": IN_FLIGHT,
            "cores": len(os.sched_getaffinity(0)),
            "machine_cores": os.cpu_count(),
        }
    )


def intake_rows(
    members: int, shards: int, servers: list[int], emit: Callable[[dict[str, Any]], None]
) -> None:
    """One row per group server count, in the order given; each emitted as it ends."""
    for count in servers:
        emit(intake_row(members, shards, count))
