"""A peer's aiohttp endpoint and its client: they move bytes and call the state machine.

One route, ``POST /peer/v1/{federation}/rounds/{round}/model``, takes a neighbour's model
(:mod:`fedsec.peer.messages`) signed as agent requests to the aggregator are (RFC 9421,
:mod:`fedsec.crypto.httpsig`: the signature covers method, path and body digest, so
federation and round in the path are bound to the sender's key and to the body).  Checks,
in order: the declared size (before a byte of the body is read); the signature over the
headers by a key of the roster; the body against the signed digest and the nonce (a
replayed request is refused even within its clock window); then everything
:meth:`fedsec.peer.gossip.GossipPeer.receive` checks.  A refusal is a 4xx with
``{"error": code, "detail": sentence}`` and leaves the peer as it was.

A second route, ``POST /peer/v1/{federation}/offer``, answers a returning neighbour's
signed :class:`~fedsec.peer.catchup.OfferRequest` with this peer's signed
:class:`~fedsec.peer.catchup.Offer` (its newest trained round and version history);
:func:`fetch_offer` is its client, which reads no more than the largest offer of the
model's size before :func:`fedsec.peer.catchup.open_offer` checks it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

import aiohttp
import msgspec
from aiohttp import web

from fedsec.crypto.httpsig import NonceCache, RequestVerifier, sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import (
    AuthError,
    FedsecError,
    PayloadError,
    PayloadTooLarge,
    ProtocolError,
    UnknownMember,
)
from fedsec.peer import catchup, messages
from fedsec.peer.gossip import GossipPeer
from fedsec.peer.limits import MAX_OFFER_REQUEST_BYTES, max_message_bytes, max_offer_bytes
from fedsec.protocol.limits import MAX_ID

log = logging.getLogger("fedsec.peer")

PEER: Final = web.AppKey("peer", GossipPeer)
VERIFIER: Final = web.AppKey("verifier", RequestVerifier)
SIGNER: Final = web.AppKey("signer", SigningIdentity)
ARRIVED: Final = web.AppKey("arrived", asyncio.Condition)
#: Seconds a signature's ``created`` may differ from the peer's clock, and so how long
#: its nonce is remembered: the aggregator's default skew (peers are as far apart).
MAX_SKEW_S: Final = 300.0


def model_path(federation_id: str, round_: int) -> str:
    return f"/peer/v1/{federation_id}/rounds/{round_}/model"


def offer_path(federation_id: str) -> str:
    return f"/peer/v1/{federation_id}/offer"


def peer_app(
    peer: GossipPeer, roster: Mapping[str, bytes], signer: SigningIdentity
) -> web.Application:
    """The endpoint of ``peer``; ``roster`` maps each member's key id to its public key,
    ``signer`` is the peer's own key (it signs the offers it makes).

    The app's :data:`ARRIVED` condition is notified after every model it keeps.
    """
    app = web.Application(client_max_size=max_message_bytes(peer.values))
    app[PEER] = peer
    app[VERIFIER] = RequestVerifier(roster.get, NonceCache(MAX_SKEW_S), max_skew_s=MAX_SKEW_S)
    app[ARRIVED] = asyncio.Condition()
    app[SIGNER] = signer
    app.router.add_post("/peer/v1/{federation}/rounds/{round}/model", _receive_model)
    app.router.add_post("/peer/v1/{federation}/offer", _make_offer)
    return app


async def _receive_model(request: web.Request) -> web.Response:
    peer = request.app[PEER]
    try:
        limit = max_message_bytes(peer.values)
        declared = request.content_length
        if declared is not None and declared > limit:
            raise PayloadTooLarge(f"a body of {declared} bytes exceeds the limit of {limit}")
        round_ = _path_round(request.match_info["round"])
        verifier = request.app[VERIFIER]
        signed = verifier.verify_headers(request.method, request.raw_path, request.headers)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes") from None
        keyid = verifier.verify_body(signed, raw)
        message = peer.receive(keyid, raw, request.match_info["federation"], round_)
    except FedsecError as exc:
        log.info("event=peer_refused code=%s detail=%s", exc.code, exc)
        return web.json_response({"error": exc.code, "detail": str(exc)}, status=exc.http_status)
    log.info("event=peer_received sender=%s round=%d", message.sender, message.round)
    async with request.app[ARRIVED]:
        request.app[ARRIVED].notify_all()
    return web.json_response({"round": message.round})


async def _make_offer(request: web.Request) -> web.Response:
    peer = request.app[PEER]
    try:
        declared = request.content_length
        if declared is not None and declared > MAX_OFFER_REQUEST_BYTES:
            raise PayloadTooLarge(f"a catch-up request of {declared} bytes is too long")
        verifier = request.app[VERIFIER]
        signed = verifier.verify_headers(request.method, request.raw_path, request.headers)
        raw = await _read_at_most(request.content, MAX_OFFER_REQUEST_BYTES)
        keyid = verifier.verify_body(signed, raw)
        asked = catchup.decode_request(raw)
        if {asked.federation_id, request.match_info["federation"]} != {peer.federation_id}:
            raise ProtocolError(f"this peer is in federation {peer.federation_id!r}")
        if asked.requester != keyid:
            raise AuthError(f"the request names requester {asked.requester}, {keyid} signed it")
        if keyid not in peer.neighbours:
            raise UnknownMember(f"{keyid} is not a neighbour of this peer")
        newest, history = peer.offer()
        peer.record_offer(keyid, asked.nonce, newest)  # journalled before it leaves
    except FedsecError as exc:
        log.info("event=peer_offer_refused code=%s detail=%s", exc.code, exc)
        return web.json_response({"error": exc.code, "detail": str(exc)}, status=exc.http_status)
    offer = catchup.make_offer(request.app[SIGNER], asked, newest, history)
    log.info("event=peer_offered to=%s round=%d", keyid, newest.round)
    return web.Response(body=msgspec.msgpack.encode(offer), content_type=messages.CONTENT_TYPE)


def _path_round(text: str) -> int:
    if not text.isdigit() or len(text) > len(str(MAX_ID)) or int(text) > MAX_ID:
        raise PayloadError(f"round {text[:20]!r} in the path is not an integer in 0..{MAX_ID}")
    return int(text)


async def send_model(
    session: aiohttp.ClientSession,
    base_url: str,
    identity: SigningIdentity,
    message: messages.PeerModel,
    timeout_s: float,
) -> tuple[int, str]:
    """POST ``message`` to the peer at ``base_url``, signed with ``identity``.

    Returns:
        The status and the response body (a JSON refusal on 4xx).

    Raises:
        aiohttp.ClientError, TimeoutError: the neighbour is unreachable or too slow.
    """
    body = messages.encode(message)
    path = model_path(message.federation_id, message.round)
    headers = {"Content-Type": messages.CONTENT_TYPE}
    headers |= sign_request(identity, "POST", path, headers, body)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(base_url + path, data=body, headers=headers, timeout=timeout) as r:
        return r.status, await r.text()


async def fetch_offer(
    session: aiohttp.ClientSession,
    base_url: str,
    identity: SigningIdentity,
    request: catchup.OfferRequest,
    values: int,
    timeout_s: float,
) -> bytes:
    """Ask the peer at ``base_url`` for its offer, signed with ``identity``; the answer's
    bytes, never more than the largest offer of ``values`` parameters.

    Raises:
        PayloadTooLarge: the answer declares or sends more than that.
        ProtocolError: the neighbour refused (its code and sentence in the detail).
        aiohttp.ClientError, TimeoutError: the neighbour is unreachable or too slow.
    """
    body = msgspec.msgpack.encode(request)
    path = offer_path(request.federation_id)
    headers = {"Content-Type": messages.CONTENT_TYPE}
    headers |= sign_request(identity, "POST", path, headers, body)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    limit = max_offer_bytes(values)
    async with session.post(base_url + path, data=body, headers=headers, timeout=timeout) as r:
        if r.status != 200:
            text = (await r.content.read(1024)).decode("utf-8", "replace")
            raise ProtocolError(f"the neighbour answered {r.status}: {text}")
        if r.content_length is not None and r.content_length > limit:
            raise PayloadTooLarge(f"an offer of {r.content_length} bytes exceeds {limit}")
        return await _read_at_most(r.content, limit)


async def _read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole of ``stream``, refused as soon as it holds more than ``limit`` bytes.

    Raises:
        PayloadTooLarge: it does.
    """
    raw = bytearray()
    while chunk := await stream.read(limit + 1 - len(raw)):
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLarge(f"a body longer than {limit} bytes")
    return bytes(raw)
