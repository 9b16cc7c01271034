"""The member's message seam: send this stage's upload, await that stage's answer.

The round machines never name a transport: their stage actions
(:class:`~fedsec.agent.actions.StageUpload`, :class:`~fedsec.agent.actions.StageFetch`,
:class:`~fedsec.agent.actions.SendMaskedInput`) are carried out by a :class:`MemberSeam`.
What a stage's upload or answer is, is told by its body's type (one wire struct per
stage message), so a seam needs no knowledge of the summation mode.

:class:`StarSeam` is the star topology: every upload goes to the aggregator over signed
HTTP (:class:`~fedsec.aggregator_client.AggregatorClient`), which relays what members
send one another and holds an answer until its stage is reached.  A peer-to-peer
topology implements the same three calls by sending to its peers and collecting their
messages; the machines and their steps stay as they are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

from fedsec.agent.actions import StageAnswer, UploadBody
from fedsec.aggregator_client import AggregatorClient
from fedsec.protocol.wire import (
    Accepted,
    AdvertiseKeysBody,
    CommitBody,
    CommitmentSetBody,
    ConsistencyBody,
    ConsistencyProofBody,
    ContributionStatement,
    KeyListBody,
    Receipt,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
)

A = TypeVar("A", bound=StageAnswer)


class MemberSeam(Protocol):
    """How one member's stage messages travel, for one topology."""

    async def send(self, round: int, attempt: int, body: UploadBody, wait: float) -> Accepted:
        """Send this stage's upload ``body`` (its type names the stage).

        Args:
            wait: seconds the answer may be held until the next stage, whose data it
                then carries (0: answer at once).

        Raises:
            FedsecError: the upload was refused (DuplicateMessage: an earlier try landed).
        """
        ...

    async def answer(self, round: int, attempt: int, kind: type[A], wait: float) -> A:
        """That stage's answer for this member: a ``kind`` (its type names the stage).

        Raises:
            WrongStage: the stage was not reached within ``wait`` seconds.
            FedsecError: any other refusal, or an answer that does not decode.
        """
        ...

    async def contribute(
        self,
        round: int,
        attempt: int,
        vector: bytes,
        statement: ContributionStatement,
        wait: float,
    ) -> tuple[Receipt, UnmaskRequestBody | None]:
        """Send this member's vector with its signed statement.

        Returns:
            The receipt, and the unmask request when the answer was held for it
            (``wait`` > 0, SecAgg+).

        Raises:
            FedsecError: refused (DuplicateMessage: an earlier try landed).
        """
        ...


class StarSeam:
    """The star: every stage message goes through the aggregator (``client``), or, for
    an attempt whose spec names this member's shard group a server (:meth:`route`),
    through that group server first."""

    def __init__(self, client: AggregatorClient) -> None:
        self.client = client
        self._routes: dict[tuple[int, int], AggregatorClient] = {}

    def route(self, round: int, attempt: int, url: str) -> None:
        """Send attempt (``round``, ``attempt``)'s stage messages to ``url`` first (the
        verified spec's group server), then to the aggregator's URLs."""
        self._routes = {(round, attempt): self.client.for_group(url)}  # older ones are over

    def _client(self, round: int, attempt: int) -> AggregatorClient:
        return self._routes.get((round, attempt), self.client)

    async def send(self, round: int, attempt: int, body: UploadBody, wait: float) -> Accepted:
        c = self._client(round, attempt)
        uploads: Mapping[type, Callable[..., Awaitable[Accepted]]] = {
            AdvertiseKeysBody: c.advertise,
            ShareKeysBody: c.post_shares,
            ConsistencyBody: c.consistency,
            CommitBody: c.commit,
            UnmaskResponseBody: c.unmask,
        }
        return await uploads[type(body)](round, attempt, body, wait)

    async def answer(self, round: int, attempt: int, kind: type[A], wait: float) -> A:
        c = self._client(round, attempt)
        answers: Mapping[type, Callable[..., Awaitable[Any]]] = {
            KeyListBody: c.keys,
            ShareRelayBody: c.get_shares,
            UnmaskRequestBody: c.get_unmask,
            ConsistencyProofBody: c.get_consistency,
            CommitmentSetBody: c.get_commit,
        }
        return cast(A, await answers[kind](round, attempt, wait))

    async def contribute(
        self,
        round: int,
        attempt: int,
        vector: bytes,
        statement: ContributionStatement,
        wait: float,
    ) -> tuple[Receipt, UnmaskRequestBody | None]:
        client = self._client(round, attempt)
        return await client.masked_input(round, attempt, vector, statement, wait)
