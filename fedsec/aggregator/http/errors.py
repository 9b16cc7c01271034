"""How the HTTP layer answers what goes wrong.

Errors the user caused are ``FedsecError`` (or aiohttp's own 4xx) and become 4xx
``{"error", "detail"}``, logged at INFO within :data:`~.limits.REFUSAL_LOG_PER_S`;
anything else is our bug: logged at ERROR with its traceback, answered 500.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from aiohttp import web

from fedsec.aggregator.http.keys import BODY_READ, Handler
from fedsec.aggregator.http.limits import MAX_DETAIL_CHARS, REFUSAL_LOG_PER_S
from fedsec.aggregator.storage.leadership import NotLeader
from fedsec.aggregator.transport import CLIENT_FAULTS, ThrottledLog
from fedsec.errors import FedsecError, RetryLater
from fedsec.protocol import wire
from fedsec.protocol.wire import LEADER_HEADER as LEADER_HEADER

# One logger for the whole HTTP layer, under the name its events have always had, so
# existing logging configuration and filters keep working.
log = logging.getLogger("fedsec.aggregator.app")

# A client that goes away or breaks framing mid-body is its own mistake, not our bug.
_CLIENT_GONE = (*CLIENT_FAULTS, ConnectionError, EOFError)


def json_response(value: Any, status: int = 200) -> web.Response:
    """``value`` encoded as the API's JSON (:func:`fedsec.protocol.wire.encode`)."""
    return web.Response(body=wire.encode(value), status=status, content_type="application/json")


def quote(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


# Refusals share the transport's throttle: at most REFUSAL_LOG_PER_S lines a second,
# the rest counted and reported with the next line that gets through.
_REFUSALS = ThrottledLog(log, lines=REFUSAL_LOG_PER_S, window_s=1.0)


def refusal(request: web.Request, code: str, status: int, detail: str) -> web.Response:
    """The 4xx answer ``{"error": code, "detail": detail}``, logged (throttled).

    A request whose body was not read is answered on a closing connection.
    """
    _REFUSALS.info(
        "event=refused method=%s path=%s code=%s status=%d detail=%r",
        request.method,
        quote(request.path, 120),
        code,
        status,
        quote(detail, 200),
    )
    response = json_response(wire.ErrorBody(error=code, detail=quote(detail)), status)
    if not request.get(BODY_READ) and (request.content_length or request.body_exists):
        # the body was not read (refused before authentication, or too large): close
        # rather than read and discard it to keep the connection
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map what ``handler`` raises to its answer: a refusal for the client's mistakes,
    500 (and a traceback in the log) for ours."""
    try:
        return await handler(request)
    except RetryLater as exc:
        response = refusal(request, exc.code, exc.http_status, exc.detail)
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        if isinstance(exc, NotLeader) and exc.leader_url:
            response.headers[LEADER_HEADER] = exc.leader_url
        return response
    except FedsecError as exc:
        return refusal(request, exc.code, exc.http_status, exc.detail)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return refusal(request, exc.reason.lower().replace(" ", "_"), exc.status, exc.reason)
    except _CLIENT_GONE as exc:
        return refusal(request, "incomplete_body", 400, f"the request body did not arrive: {exc}")
    except Exception:
        log.exception("event=internal_error method=%s path=%s", request.method, request.path)
        return json_response(
            wire.ErrorBody(error="internal_error", detail="the aggregator hit a bug; see its log"),
            500,
        )
