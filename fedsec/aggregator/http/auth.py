"""Authenticating a signed request, in the order of ``docs/security.md``.

Everything that needs no body is checked before a byte of it is read: framing,
signature headers, key, roster role, created time, nonce and the member's rate.  Only
then is the body read (bounded in size, time and concurrency), checked against the
signed digest, and the nonce recorded.  ``Expect: 100-continue`` is answered only to a
request that passed the checks that need no body.  The bytes of an authenticated
request are counted in its round's summary, both ways: upwards its head (request line
and header fields, :func:`head_bytes`) as well as its body, since the signature fields
of a small control message weigh as much as its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

import aiohttp
from aiohttp import web

from fedsec.aggregator.http.errors import quote, refusal
from fedsec.aggregator.http.keys import (
    BODY_READ,
    COORDINATOR,
    ENDPOINT_OF,
    MEMBER,
    METRICS,
    OPS,
    RATE,
    SIGNED,
    UPLOADS,
    VERIFIER,
    WORKSPACE,
    Handler,
)
from fedsec.aggregator.http.params import refuse_repeated_params
from fedsec.aggregator.transport import mark_authenticated
from fedsec.config import ServerSection
from fedsec.errors import (
    AuthError,
    FedsecError,
    ForbiddenError,
    PayloadTooLarge,
    RequestTimeout,
    ServerBusy,
    UnsupportedEncoding,
)
from fedsec.protocol.endpoints import Endpoint


async def authenticate(request: web.Request) -> tuple[str, bytes]:
    """Authenticate the request; return (agent id, body).

    The roles allowed and the body limit are the matched endpoint's (the table in
    :mod:`fedsec.protocol.endpoints`).

    Raises:
        FedsecError: the first check the request fails (see :func:`_check_framing`,
            :func:`~fedsec.aggregator.http.params.refuse_repeated_params`,
            :func:`_authorised`, :func:`_upload_slot`, :func:`_read_body` and
            :meth:`RequestVerifier.verify_body`).
    """
    member, body = await verify_request(request)
    coord = request.app[COORDINATOR]
    key = coord.current_attempt()
    request[MEMBER] = key
    request.app[OPS].live.seen(member, time.time())
    # counted on arrival: a held answer (e.g. the unmask answer, held until the round
    # is over) must not leave its upload out of the round's summary
    coord.count_traffic(key, head_bytes(request) + len(body), 0)
    return member, body


async def verify_request(request: web.Request) -> tuple[str, bytes]:
    """:func:`authenticate`'s checks, without counting the request in a round: what a
    group server (:mod:`fedsec.aggregator.groups.server`), which holds no coordinator,
    runs on the same application keys (workspace, verifier, rate, upload slots).

    Raises:
        FedsecError: as :func:`authenticate`.
    """
    endpoint = _endpoint(request)
    limit = _body_limit(request, endpoint)
    _check_framing(request, limit)
    refuse_repeated_params(request)
    member, _keyid = _authorised(request, endpoint.roles)
    async with _upload_slot(request, limit):
        body = await _read_body(request, limit, _config(request).body_timeout_s)
    request.app[VERIFIER].verify_body(request[SIGNED], body)
    mark_authenticated(request)
    return member, body


def head_bytes(request: web.Request) -> int:
    """The size of the request's head as it came over HTTP/1.1: request line, header
    fields (``name: value``, each ended by CRLF) and the blank line that ends them."""
    line = len(request.method) + 1 + len(request.raw_path) + len(" HTTP/1.1\r\n")
    fields = sum(len(name) + 2 + len(value) + 2 for name, value in request.raw_headers)
    return line + fields + 2


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: answer 100 only to a request that would be read; a
    refusal (size, encoding, signature, role) goes out before the client sends the body."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return refusal(request, "expectation_failed", 417, "only Expect: 100-continue is known")
    try:
        _check_framing(request, _body_limit(request, _endpoint(request)))
        refuse_repeated_params(request)
        request.app[VERIFIER].verify_headers(request.method, request.raw_path, request.headers)
    except FedsecError as exc:
        return refusal(request, exc.code, exc.http_status, exc.detail)
    if request.version >= aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    return None


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every answered request by endpoint and status, with its body bytes both
    ways and its head's bytes, for ``/metrics`` (refusals included; requests matching
    no route are counted under ``unmatched``)."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # redirects (the dashboard's token exchange)
        _observe(request, exc.status, exc.body_length if exc.prepared else 0)
        raise
    body = response.body if isinstance(response, web.Response) else None
    # a Response is not yet written here (its body is); a stream has written itself
    sent = len(body) if isinstance(body, bytes | bytearray) else response.body_length
    _observe(request, response.status, sent)
    return response


def _observe(request: web.Request, status: int, sent: int) -> None:
    endpoint = request.app[ENDPOINT_OF].get(request.match_info.handler)
    name = endpoint.name if endpoint is not None else "unmatched"
    request.app[METRICS].observe_request(
        name, status, request.content_length or 0, sent, head=head_bytes(request)
    )


@web.middleware
async def traffic_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the response bytes of authenticated requests per round attempt (the
    demo's bytes up/down columns); request bytes are counted on arrival, once
    authenticated (:func:`authenticate`)."""
    response = await handler(request)
    key = request.get(MEMBER)
    body = response.body if isinstance(response, web.Response) else None
    if key is not None and isinstance(body, bytes | bytearray):
        request.app[COORDINATOR].count_traffic(key, 0, len(body))
    return response


def _endpoint(request: web.Request) -> Endpoint:
    """The endpoint-table entry of the route ``request`` matched."""
    return request.app[ENDPOINT_OF][request.match_info.handler]


def _body_limit(request: web.Request, endpoint: Endpoint) -> int:
    """The configured limit the endpoint's ``body_limit`` names, in bytes."""
    cfg = request.app[WORKSPACE].config.server
    return cfg.max_body_bytes if endpoint.body_limit == "binary" else cfg.max_json_bytes


def _check_framing(request: web.Request, limit: int) -> None:
    """What the request line and headers say about the body, before any of it is read.

    Raises:
        UnsupportedEncoding: a ``Content-Encoding`` other than identity (aiohttp would
            inflate it, so a small body could expand hundreds of times).
        PayloadTooLarge: a declared length over ``limit``.
    """
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise UnsupportedEncoding(
            f"Content-Encoding {quote(encoding, 32)!r} is refused: fedsec bodies are sent "
            "uncompressed (signed vectors and models do not compress)"
        )
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")


def _authorised(request: web.Request, roles: tuple[str, ...]) -> tuple[str, str]:
    """Signature over the headers, roster role and rate: (agent id, key id).

    Raises:
        PayloadError, AuthError, ReplayError: see :meth:`RequestVerifier.verify_headers`.
        ForbiddenError: the key's role is not one of ``roles``.
        RateLimited: the key is over its request rate.
    """
    signed = request.app[VERIFIER].verify_headers(request.method, request.raw_path, request.headers)
    entry = request.app[WORKSPACE].roster.by_key_id(signed.keyid)
    if entry is None or not entry.is_active:
        raise AuthError(f"key {signed.keyid} is unknown or revoked")
    if entry.role not in roles:
        raise ForbiddenError(
            f"{entry.agent_id} has role {entry.role}; this needs {' or '.join(roles)}"
        )
    request.app[RATE].charge(signed.keyid, time.monotonic())
    request[SIGNED] = signed
    return entry.agent_id, signed.keyid


# What a body no larger than a JSON control message is read under: no slot, and no
# generator-based context manager built for each such request (most of them).
_NO_SLOT: Final = contextlib.nullcontext()


def _upload_slot(request: web.Request, limit: int) -> contextlib.AbstractAsyncContextManager[None]:
    """Hold one of ``server.max_concurrent_uploads`` slots while a body that may be
    larger than a JSON control message is read, bounding bodies in memory.

    Raises:
        ServerBusy: on entering, no slot freed within ``server.upload_queue_s``.
    """
    cfg = request.app[WORKSPACE].config.server
    declared = request.content_length
    if limit <= cfg.max_json_bytes or (declared is not None and declared <= cfg.max_json_bytes):
        return _NO_SLOT
    return _held_slot(request, cfg)


@contextlib.asynccontextmanager
async def _held_slot(request: web.Request, cfg: ServerSection) -> AsyncIterator[None]:
    """One of the upload slots, held while the body is read.

    Raises:
        ServerBusy: no slot freed within ``server.upload_queue_s``.
    """
    slots = request.app[UPLOADS]
    try:
        async with asyncio.timeout(cfg.upload_queue_s):
            await slots.acquire()
    except TimeoutError:
        raise ServerBusy(
            f"all {cfg.max_concurrent_uploads} upload slots stayed busy for "
            f"{cfg.upload_queue_s:g} s; retry shortly",
            retry_after=cfg.upload_queue_s / 4,
        ) from None
    try:
        yield
    finally:
        slots.release()


async def read_unsigned_body(request: web.Request, limit: int) -> bytes:
    """The body of a request that carries no signature (an alert acknowledgement), read
    with the same framing checks as a signed one's, within ``server.header_timeout_s``.

    Raises:
        UnsupportedEncoding, PayloadTooLarge, RequestTimeout: see :func:`_check_framing`
            and :func:`_read_body`.
    """
    _check_framing(request, limit)
    # a small body from anyone: it gets the head's deadline, not an upload's, so no
    # unauthenticated request holds its connection busy (undisplaceable) for long
    return await _read_body(request, limit, _config(request).header_timeout_s)


def _config(request: web.Request) -> ServerSection:
    return request.app[WORKSPACE].config.server


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The body, at most ``limit`` bytes, within ``timeout_s`` seconds.

    Raises:
        PayloadTooLarge: more than ``limit`` bytes arrive.
        RequestTimeout: the body did not arrive in time.
    """
    # Most bodies (every one without a body, every control message) have arrived whole
    # with their head: then nothing can wait, and a timer, or reads until the end, would
    # be most of the cost of reading them.  A body over the limit has not been read
    # here, it has arrived: the parser holds it already.
    if request.content.is_eof():
        body = request.content.read_nowait()
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        request[BODY_READ] = True
        return body
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            await _read_chunks(request, limit, chunks)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s "
            f"({sum(map(len, chunks))} bytes received)"
        ) from None
    request[BODY_READ] = True
    return b"".join(chunks)


async def _read_chunks(request: web.Request, limit: int, chunks: list[bytes]) -> None:
    """Append the body's pieces to ``chunks`` until it ends.

    Raises:
        PayloadTooLarge: more than ``limit`` bytes arrive.
    """
    # StreamReader.read(n) returns what has arrived so far (up to n), not n bytes: a body
    # that comes in several pieces (slow link, chunked encoding) must be read in a loop.
    size = 0
    while chunk := await request.content.read(limit + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
