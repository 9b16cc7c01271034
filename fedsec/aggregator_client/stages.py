"""The SecAgg+ stage calls: uploads whose answer the aggregator may hold ``wait``
seconds until the round reaches the next stage, and the fetches that fall back on
them (docs/agent.md, "One round, as the agent runs it").  The three control uploads
go in their compact form (:mod:`fedsec.protocol.compact`: msgpack, binary keys and
shares), about half their JSON size."""

from __future__ import annotations

from typing import TypeVar

from fedsec.aggregator_client.calls import Calls, route, seconds
from fedsec.aggregator_client.limits import LONG_POLL_SLACK_S, MAX_JSON_BYTES, MAX_RECEIPT_BYTES
from fedsec.aggregator_client.transport import Route
from fedsec.errors import PayloadError
from fedsec.protocol import compact
from fedsec.protocol.wire import (
    Accepted,
    AdvertiseKeysBody,
    CommitBody,
    CommitmentSetBody,
    ConsistencyBody,
    ConsistencyProofBody,
    ContributionStatement,
    HeContext,
    KeyListBody,
    MaskedInputAnswer,
    Receipt,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
    decode,
    encode,
)

T = TypeVar("T")


class StageCalls(Calls):
    """``advertise`` … ``unmask``: one method per SecAgg+ stage endpoint."""

    def _stage_query(self, attempt: int, wait: float) -> dict[str, int | str]:
        query: dict[str, int | str] = {"attempt": attempt}
        if wait > 0:
            query["wait"] = seconds(wait)
        return query

    def _wait_timeout(self, wait: float) -> float | None:
        """Client timeout for an answer the aggregator may hold ``wait`` seconds."""
        return self.timeout_s + wait + LONG_POLL_SLACK_S if wait > 0 else None

    async def _stage_json(
        self,
        stage: Route,
        kind: type[T],
        attempt: int,
        wait: float,
        what: str,
    ) -> T:
        """A SecAgg+ stage fetch whose answer the aggregator may hold ``wait`` seconds."""
        return await self._transport.json(
            stage,
            kind,
            query=self._stage_query(attempt, wait),
            what=what,
            timeout_s=self._wait_timeout(wait),
        )

    async def _stage_upload(
        self, stage: Route, body: compact.Body, attempt: int, wait: float, what: str
    ) -> Accepted:
        """A SecAgg+ control upload, sent compact; its answer may be held ``wait`` s."""
        raw = await self._transport.request(
            stage,
            query=self._stage_query(attempt, wait),
            body=compact.encode(body),
            content_type=compact.MEDIA_TYPE,
            max_bytes=MAX_JSON_BYTES,
            what=what,
            timeout_s=self._wait_timeout(wait),
        )
        return decode(raw, Accepted, max_bytes=MAX_JSON_BYTES, what=what, unique_keys=False)

    async def _json_upload(
        self,
        stage: Route,
        body: ConsistencyBody | CommitBody,
        attempt: int,
        wait: float,
        what: str,
    ) -> Accepted:
        """A small stage upload without a compact form, sent as JSON; its answer may be
        held ``wait`` s."""
        raw = await self._transport.request(
            stage,
            query=self._stage_query(attempt, wait),
            body=encode(body),
            content_type="application/json",
            max_bytes=MAX_JSON_BYTES,
            what=what,
            timeout_s=self._wait_timeout(wait),
        )
        return decode(raw, Accepted, max_bytes=MAX_JSON_BYTES, what=what, unique_keys=False)

    async def advertise(
        self, round: int, attempt: int, body: AdvertiseKeysBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/advertise``: our signed ephemeral public keys.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                share_keys; the answer then carries the key list (``keys``).
        """
        return await self._stage_upload(
            route("advertise", round=round), body, attempt, wait, "advertise answer"
        )

    async def keys(self, round: int, attempt: int, wait: float = 0.0) -> KeyListBody:
        """``GET /rounds/{r}/keys``: the relayed key list (long-polled up to ``wait`` s)."""
        return await self._stage_json(
            route("keys", round=round), KeyListBody, attempt, wait, "key list"
        )

    async def post_shares(
        self, round: int, attempt: int, body: ShareKeysBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/shares``: our encrypted shares for relay.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                masked_input; the answer then carries our share relay (``relay``).
        """
        return await self._stage_upload(
            route("post_shares", round=round), body, attempt, wait, "shares answer"
        )

    async def get_shares(self, round: int, attempt: int, wait: float = 0.0) -> ShareRelayBody:
        """``GET /rounds/{r}/shares``: shares addressed to us and the participants
        (long-polled up to ``wait`` s)."""
        return await self._stage_json(
            route("get_shares", round=round), ShareRelayBody, attempt, wait, "share relay"
        )

    async def masked_input(
        self,
        round: int,
        attempt: int,
        vector: bytes,
        statement: ContributionStatement,
        wait: float = 0.0,
    ) -> tuple[Receipt, UnmaskRequestBody | None]:
        """``POST /rounds/{r}/masked-input``: the packed vector with the signed contribution
        statement (commitment and signature as query parameters).

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                the consistency stage (SecAgg+); the answer then carries our unmask
                request (the survivor sets we sign).

        Returns:
            The verified receipt, and the unmask request when one came with it.

        Raises:
            SignatureError: the receipt is not signed by the pinned aggregator key.
        """
        query = self._stage_query(attempt, wait)
        query.update(commitment=statement.commitment, signature=statement.signature)
        raw = await self._transport.request(
            route("masked_input", round=round),
            query=query,
            body=vector,
            content_type="application/octet-stream",
            max_bytes=MAX_JSON_BYTES if wait > 0 else MAX_RECEIPT_BYTES,
            what="receipt",
            timeout_s=self._wait_timeout(wait),
        )
        if wait > 0:
            try:
                answer = decode(
                    raw,
                    MaskedInputAnswer,
                    max_bytes=MAX_JSON_BYTES,
                    what="receipt",
                    unique_keys=False,
                )
            except PayloadError:
                pass  # an aggregator that does not hold answers sends the bare receipt
            else:
                answer.receipt.verify(self.aggregator.public_bytes)
                return answer.receipt, answer.unmask
        return self._verified_receipt(raw), None

    async def get_unmask(self, round: int, attempt: int, wait: float = 0.0) -> UnmaskRequestBody:
        """``GET /rounds/{r}/unmask``: survivors and dropped members (long-polled up to
        ``wait`` s)."""
        return await self._stage_json(
            route("get_unmask", round=round), UnmaskRequestBody, attempt, wait, "unmask request"
        )

    async def consistency(
        self, round: int, attempt: int, body: ConsistencyBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/consistency``: our signature on the survivor sets.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                unmask; the answer then carries our consistency proof (``proof``).
        """
        return await self._json_upload(
            route("post_consistency", round=round), body, attempt, wait, "consistency answer"
        )

    async def get_consistency(
        self, round: int, attempt: int, wait: float = 0.0
    ) -> ConsistencyProofBody:
        """``GET /rounds/{r}/consistency``: the survivor sets and our neighbours'
        signatures on them (long-polled up to ``wait`` s)."""
        return await self._stage_json(
            route("get_consistency", round=round),
            ConsistencyProofBody,
            attempt,
            wait,
            "consistency proof",
        )

    async def commit(
        self, round: int, attempt: int, body: CommitBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/commit`` (homomorphic summation): our signed commitment
        to the hash of the ciphertext we will upload.

        Args:
            wait: seconds the aggregator may hold the answer until the round reaches
                masked_input; the answer then carries the commitment set (``commitments``).
        """
        return await self._json_upload(
            route("post_commit", round=round), body, attempt, wait, "commit answer"
        )

    async def get_commit(self, round: int, attempt: int, wait: float = 0.0) -> CommitmentSetBody:
        """``GET /rounds/{r}/commit``: the attempt's commitment set (long-polled up to
        ``wait`` s until stage commit closes)."""
        return await self._stage_json(
            route("get_commit", round=round), CommitmentSetBody, attempt, wait, "commitment set"
        )

    async def unmask(
        self, round: int, attempt: int, body: UnmaskResponseBody, wait: float = 0.0
    ) -> Accepted:
        """``POST /rounds/{r}/unmask``: our shares for unmasking.

        Args:
            wait: seconds the aggregator may hold the answer until the attempt is over;
                the answer then carries the round state (``state``).
        """
        return await self._stage_upload(
            route("post_unmask", round=round), body, attempt, wait, "unmask answer"
        )

    async def he_context(self) -> HeContext:
        """``GET /he/context``: the public CKKS context of a homomorphic-summation
        federation and the key custodian's signed statement of it."""
        return await self._transport.json(
            route("get_he_context"), HeContext, what="homomorphic context", max_bytes=MAX_JSON_BYTES
        )
