"""The key custodian's calls: publishing the public CKKS context, fetching what it is
asked to decrypt, and answering with a decryption; and the checkers' reads of the
transparency log and its archive (the custodian's and the auditor's), through which the
custodian checks an offer before it believes it."""

from __future__ import annotations

from typing import Final

from fedsec.aggregator_client.calls import Calls, route, seconds
from fedsec.aggregator_client.limits import LONG_POLL_SLACK_S, MAX_ERROR_BYTES
from fedsec.aggregator_client.transport import Route
from fedsec.errors import PayloadError
from fedsec.protocol import endpoints
from fedsec.protocol.wire import HeContext, HeSumOffer, encode

#: Largest answer of one ``GET /audit/log`` read.  A log line is metadata and hashes
#: (at most 1 MiB, ``fedsec.protocol.log.MAX_LINE_BYTES``; a few hundred bytes in
#: practice) and the aggregator answers a bounded number of lines per request, so
#: 64 MiB is far above any honest answer while bounding what a hostile server can make
#: the custodian buffer; the caller reads on from where an answer ended.
MAX_LOG_ANSWER_BYTES: Final = 64 * 1024 * 1024

_SHA256_HEX: Final = frozenset("0123456789abcdef")


def _archive_route(sha256: str) -> Route:
    """The archive object's route; its name is a hex digest (a path segment, never more).

    Raises:
        PayloadError: ``sha256`` is not 64 lowercase hex digits.
    """
    if len(sha256) != 64 or not set(sha256) <= _SHA256_HEX:
        raise PayloadError(f"archive object name {sha256[:70]!r} is not a SHA-256 hex digest")
    endpoint = endpoints.BY_NAME["get_archive"]
    return Route(endpoint.method, endpoint.template.format(sha256=sha256))


class CustodianCalls(Calls):
    """One method per endpoint of the key custodian and of the log's checkers."""

    async def put_he_context(self, context: HeContext) -> None:
        """``POST /he/context``: publish the signed public context (custodian role).

        Raises:
            FedsecError subclass: the aggregator's refusal; a 409 when it already holds
                another context for the federation.
        """
        await self._transport.request(
            route("put_he_context"),
            body=encode(context),
            content_type="application/json",
            max_bytes=MAX_ERROR_BYTES,
            what="context answer",
        )

    async def he_sum(self, round: int, attempt: int, wait: float = 0.0) -> HeSumOffer:
        """``GET /rounds/{r}/he-sum``: what the custodian is asked to decrypt, held up to
        ``wait`` seconds until the attempt reaches the decrypt stage."""
        query: dict[str, int | str] = {"attempt": attempt}
        if wait > 0:
            query["wait"] = seconds(wait)
        return await self._transport.json(
            route("get_he_sum", round=round),
            HeSumOffer,
            query=query,
            what="homomorphic sum offer",
            timeout_s=self.timeout_s + wait + LONG_POLL_SLACK_S if wait > 0 else None,
        )

    async def post_decryption(self, round: int, attempt: int, body: bytes) -> None:
        """``POST /rounds/{r}/decryption``: the signed statement and the plaintext sum
        (:func:`fedsec.custodian.check.frame_decryption`)."""
        await self._transport.request(
            route("post_decryption", round=round),
            query={"attempt": attempt},
            body=body,
            content_type="application/octet-stream",
            max_bytes=MAX_ERROR_BYTES,
            what="decryption answer",
        )

    async def log_lines(self, start: int) -> bytes:
        """``GET /audit/log?from=N``: transparency-log lines from index ``start`` on
        (JSON lines; at most a bounded number, so callers read on from the last)."""
        return await self._transport.request(
            route("get_log"),
            query={"from": start},
            max_bytes=MAX_LOG_ANSWER_BYTES,
            what="transparency log",
        )

    async def archived(self, sha256: str, max_bytes: int) -> bytes:
        """``GET /audit/archive/{sha256}``: an archived protocol message; the caller
        bounds its size (the log entry names it) and checks its hash."""
        return await self._transport.request(
            _archive_route(sha256),
            max_bytes=max_bytes,
            what=f"archive object {sha256[:16]}",
        )
