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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
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
_SERVE = (sys.executable, "-m", "fedsec", "aggregator")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    serve = [*_SERVE, "serve", "--workspace", str(workspace), "--host", "127.0.0.1"]
    commands = [[*serve, "--port", str(leader_port), "--log-level", "WARNING"]]
    commands += [
        [
            *_SERVE,
            "group-serve",
            "--workspace",
            str(workspace),
            "--url",
            u,
            "--log-level",
            "WARNING",
        ]
        for u in urls
    ]
    connector = aiohttp.TCPConnector(limit=4 * IN_FLIGHT)
    with _processes(commands):
        async with aiohttp.ClientSession(connector=connector) as http:
            await _healthy(http, [leader, *urls])
            return await _round(http, leader, key, db, ids, servers)


async def _round(
    http: aiohttp.ClientSession,
    leader: str,
    key: bytes,
    db: Path,
    ids: dict[str, SigningIdentity],
    servers: int,
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
        timings[name] = await _send_all(http, requests)
        await _stage(db, then)

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
        }
    )


def intake_rows(
    members: int, shards: int, servers: list[int], emit: Callable[[dict[str, Any]], None]
) -> None:
    """One row per group server count, in the order given; each emitted as it ends."""
    for count in servers:
        emit(intake_row(members, shards, count))
