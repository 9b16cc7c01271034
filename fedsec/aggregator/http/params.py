"""What a request names, decoded with its bounds: path and query parameters, JSON bodies
and the compact (msgpack) form of the SecAgg+ uploads.

Each query parameter is given once (:func:`refuse_repeated_params`, for every signed
route).  Integers are canonical ASCII decimal (:func:`fedsec.protocol.wire.parse_uint`), seconds
are plain decimals capped at the long-poll limit, and a JSON body is decoded within
``server.max_json_bytes`` (a compact upload too), so one resource has one spelling and
nothing a client sends is parsed without a bound.
"""

from __future__ import annotations

import re
from typing import TypeVar

from aiohttp import web

from fedsec.aggregator.http.errors import quote
from fedsec.aggregator.http.keys import WORKSPACE
from fedsec.errors import PayloadError
from fedsec.protocol import compact, wire
from fedsec.protocol.limits import LONG_POLL_S

T = TypeVar("T")
B = TypeVar("B", wire.AdvertiseKeysBody, wire.ShareKeysBody, wire.UnmaskResponseBody)

# plain decimal only: float() would also take "nan", "inf", "1e999", "1_0" and " 5"
_SECONDS_RE = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")


def refuse_repeated_params(request: web.Request) -> None:
    """Refuse a query parameter given more than once.

    The request signature covers the whole target, ``?attempt=0&attempt=1`` included:
    a reader taking the first value and one taking the last would act on different
    attempts, so a signed target must name each parameter once.  Checked before the
    body is read or the nonce spent.

    Raises:
        PayloadError: naming the first parameter given twice.
    """
    seen: set[str] = set()
    for name, _ in request.query.items():  # every occurrence (iterating keys skips repeats)
        if name in seen:
            raise PayloadError(f"query parameter {quote(name, 32)!r} is given more than once")
        seen.add(name)


def round_args(request: web.Request) -> tuple[int, int]:
    """(round, attempt) of a round route: the ``{round}`` path part, ``?attempt`` (0).

    Raises:
        PayloadError: either is not a canonical id.
    """
    round_ = wire.parse_uint(request.match_info["round"], "round")
    attempt = wire.parse_uint(request.query.get("attempt", "0"), "attempt")
    return round_, attempt


def model_version(request: web.Request) -> int:
    """The ``{version}`` path part of a model route.

    Raises:
        PayloadError: not a canonical id.
    """
    return wire.parse_uint(request.match_info["version"], "model version")


def statement_params(request: web.Request) -> tuple[str, str]:
    """A masked input's ``commitment`` and ``signature`` query parameters: the member's
    signed contribution statement (checked against the body by whoever takes it).

    Raises:
        PayloadError: either is missing or empty.
    """
    commitment = request.query.get("commitment", "")
    signature = request.query.get("signature", "")
    if not commitment or not signature:
        raise PayloadError(
            "masked input needs the commitment and signature query parameters "
            "(the member's signed contribution statement)"
        )
    return commitment, signature


def wait_seconds(request: web.Request) -> float:
    """The ``wait`` query parameter of a stage-data request: seconds to hold the answer
    until the round reaches that stage (0, the default, answers at once)."""
    return seconds(request.query.get("wait", "0"), "wait")


def seconds(raw: str, what: str) -> float:
    """A query parameter in seconds, capped at :data:`LONG_POLL_S`.

    Raises:
        PayloadError: not a plain non-negative decimal.
    """
    if not _SECONDS_RE.fullmatch(raw):
        raise PayloadError(
            f"{what} must be a non-negative number of seconds like 5 or 2.5, got {quote(raw, 32)!r}"
        )
    return min(float(raw), LONG_POLL_S)


def decode_json(raw: bytes, kind: type[T], request: web.Request, what: str) -> T:
    """A JSON control message, at most ``server.max_json_bytes``.

    Raises:
        PayloadError: see :func:`fedsec.protocol.wire.decode`.
    """
    ws = request.app[WORKSPACE]
    return wire.decode(raw, kind, max_bytes=ws.config.server.max_json_bytes, what=what)


def decode_upload(raw: bytes, kind: type[B], request: web.Request, what: str) -> B:
    """A SecAgg+ upload, as the JSON body struct ``kind``: decoded from its compact form
    (:mod:`fedsec.protocol.compact`) when the request's ``Content-Type`` is
    ``application/msgpack``, else as JSON; at most ``server.max_json_bytes`` either way.

    Raises:
        PayloadError: see :func:`fedsec.protocol.compact.to_body` and
            :func:`fedsec.protocol.wire.decode`.
    """
    if request.content_type == compact.MEDIA_TYPE:
        limit = request.app[WORKSPACE].config.server.max_json_bytes
        return compact.to_body(raw, kind, max_bytes=limit, what=what)
    return decode_json(raw, kind, request, what)
