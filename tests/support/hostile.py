"""Shared pieces for the hostile-client tests: a served aggregator, a raw HTTP/1.1 client
and a check that a refused request left the durable state as it was.

The raw client writes the request bytes by hand (``asyncio.open_connection``), so a test
can send what aiohttp's or requests' client would normalise or refuse to send: bodies
that never come, ``Expect: 100-continue``, headers dribbled a byte at a time,
non-canonical numbers in the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sqlite3
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.storage.audit_trail import LOG_FILE
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from tests.support.aggregator import Federation

HOST = "127.0.0.1"
# Tables a signed request may add rows to even when it is refused: the replay store's.
NONCE_TABLE_HINTS = ("nonce", "replay")

Headers = Sequence[tuple[str, str]] | Mapping[str, str]


# -- serving --------------------------------------------------------------------------------------


@dataclass
class Served:
    """An aggregator serving ``ws`` on an ephemeral loopback port."""

    ws: Workspace
    coord: Coordinator
    app: web.Application
    port: int
    _stop: Callable[[], Awaitable[None]] = field(repr=False)

    async def stop(self) -> None:
        await self._stop()


async def serve(ws: Workspace, coord: Coordinator) -> Served:
    """Serve the real app for ``ws`` the way ``fedsec aggregator serve`` does
    (:func:`~fedsec.aggregator.transport.start_server`, with its connection rules) on
    127.0.0.1, port chosen by the OS."""
    app = make_app(ws, coord)
    running = await start_server(app, HOST, 0, None, ws.config.server)
    return Served(ws, coord, app, running.port, running.close)


# -- a raw HTTP/1.1 client ------------------------------------------------------------------------


@dataclass
class RawAnswer:
    """One HTTP answer as it came off the socket."""

    status: int
    headers: CIMultiDict[str]
    body: bytes
    interim: list[int]  # the status of every 1xx line seen before the answer

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> tuple[str, str]:
        """(error, detail) of a ``{"error", "detail"}`` body; asserts that shape."""
        assert self.headers.get("Content-Type", "").startswith("application/json"), self
        doc = self.json()
        assert isinstance(doc, dict) and set(doc) == {"error", "detail"}, doc
        assert isinstance(doc["error"], str) and isinstance(doc["detail"], str), doc
        assert doc["detail"], doc
        return doc["error"], doc["detail"]

    def __repr__(self) -> str:
        return f"RawAnswer({self.status}, {dict(self.headers)!r}, {self.body[:300]!r})"


def request_head(
    method: str,
    target: str,
    headers: Headers = (),
    *,
    content_length: int | None = None,
) -> bytes:
    """The request line and header block, exactly as given (no normalisation)."""
    items = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    names = {name.lower() for name, _ in items}
    if "host" not in names:
        items.insert(0, ("Host", "aggregator.test"))
    if content_length is not None:
        items.append(("Content-Length", str(content_length)))
    lines = [f"{method} {target} HTTP/1.1"] + [f"{name}: {value}" for name, value in items]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def signed_headers(
    identity: SigningIdentity, method: str, target: str, body: bytes
) -> dict[str, str]:
    """RFC 9421 headers for ``method target`` with ``body``, as an agent sends them."""
    return sign_request(identity, method, target, {}, body)


def signed_request(
    identity: SigningIdentity,
    method: str,
    target: str,
    body: bytes = b"",
    extra: Headers = (),
    *,
    content_type: str | None = None,
) -> bytes:
    """A complete signed request (head and body)."""
    headers = list(signed_headers(identity, method, target, body).items())
    headers += list(extra.items()) if isinstance(extra, Mapping) else list(extra)
    if content_type is None and body:
        content_type = (
            "application/json" if body[:1] in (b"{", b"[") else "application/octet-stream"
        )
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    return request_head(method, target, headers, content_length=len(body)) + body


async def read_answer(reader: asyncio.StreamReader) -> RawAnswer:
    """Read one answer (skipping 1xx interim answers, which are recorded)."""
    interim: list[int] = []
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers.add(name.strip(), value.strip())
        if 100 <= status < 200:
            interim.append(status)
            continue
        break
    if "Content-Length" in headers:
        body = await reader.readexactly(int(headers["Content-Length"]))
    elif headers.get("Transfer-Encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.read()
    return RawAnswer(status, headers, body, interim)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> RawAnswer:
    """Open a connection, send ``data``, read one answer within ``timeout`` seconds."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(read_answer(reader), timeout)
    finally:
        await close(writer)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


# -- what a refused request must leave as it was --------------------------------------------------


@dataclass(frozen=True)
class DurableState:
    """Row counts of every table in the state database (and its replay store, if any),
    a digest of the protocol tables' rows, and the transparency log file."""

    counts: dict[str, int]
    digests: dict[str, str]
    log_lines: int
    log_last_sha256: str

    def nonce_tables(self) -> set[str]:
        return {t for t in self.counts if any(h in t.lower() for h in NONCE_TABLE_HINTS)}


# Tables whose rows must not change at all after a refusal (not just their count).
PROTOCOL_TABLES = ("rounds", "joins", "messages", "reports", "receipts", "log")


def _db_tables(path: Path, prefix: str) -> tuple[dict[str, int], dict[str, str]]:
    counts: dict[str, int] = {}
    digests: dict[str, str] = {}
    if not path.exists():
        return counts, digests
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = [
            n
            for (n,) in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        for name in names:
            counts[prefix + name] = con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
            if not prefix and name in PROTOCOL_TABLES:
                rows = con.execute(f'SELECT * FROM "{name}" ORDER BY rowid').fetchall()
                digests[name] = hashlib.sha256(repr(rows).encode()).hexdigest()
    finally:
        con.close()
    return counts, digests


def durable_state(ws: Workspace) -> DurableState:
    counts, digests = _db_tables(ws.state.path, "")
    for other in sorted(ws.root.glob("*.db")):
        if other != ws.state.path:
            more, _ = _db_tables(other, other.stem + ".")
            counts.update(more)
    log_path = ws.root / LOG_FILE
    lines = log_path.read_bytes().splitlines() if log_path.exists() else []
    last = hashlib.sha256(lines[-1]).hexdigest() if lines else ""
    return DurableState(counts, digests, len(lines), last)


def assert_unchanged(
    before: DurableState, after: DurableState, *, nonces_may_grow_by: int = 0
) -> None:
    """Nothing durable changed, except that up to ``nonces_may_grow_by`` rows may have
    been added to the replay store (a refused request whose signature verified)."""
    assert after.log_lines == before.log_lines, "the transparency log grew"
    assert after.log_last_sha256 == before.log_last_sha256, "the transparency log changed"
    assert after.digests == before.digests, "a protocol table's rows changed"
    nonce_tables = before.nonce_tables() | after.nonce_tables()
    for table in sorted(set(before.counts) | set(after.counts)):
        old, new = before.counts.get(table, 0), after.counts.get(table, 0)
        if table in nonce_tables:
            assert old <= new <= old + nonces_may_grow_by, (table, old, new)
        else:
            assert new == old, f"table {table} has {new} rows, had {old}"


def fed_identity(fed: Federation, who: str) -> SigningIdentity:
    return fed.identities[who]
