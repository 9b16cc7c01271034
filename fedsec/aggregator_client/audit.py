"""The audit calls: challenges to members and the sealed reveals that answer them."""

from __future__ import annotations

from fedsec.aggregator_client.calls import Calls, route
from fedsec.aggregator_client.limits import DEFAULT_MAX_MODEL_BYTES
from fedsec.protocol.wire import (
    Challenge,
    ChallengeList,
    ChallengeRequest,
    QuarantineAnswer,
    QuarantineOrder,
    Reveal,
    RevealBody,
    RevealList,
    VerdictReceipt,
    VerdictSubmission,
)


class AuditCalls(Calls):
    """One method per audit endpoint; agents answer challenges, auditors issue them."""

    async def challenges(self) -> ChallengeList:
        """``GET /audit/challenges``: open challenges addressed to us."""
        return await self._transport.json(route("get_challenges"), ChallengeList, what="challenges")

    async def reveal(self, body: RevealBody) -> Reveal:
        """``POST /audit/reveals``: answer a challenge with a sealed reveal."""
        return await self._transport.json(
            route("post_reveal"),
            Reveal,
            payload=body,
            what="reveal acknowledgement",
            max_bytes=DEFAULT_MAX_MODEL_BYTES,
        )

    async def challenge(self, request: ChallengeRequest) -> Challenge:
        """``POST /audit/challenges`` (auditor role)."""
        return await self._transport.json(
            route("post_challenge"), Challenge, payload=request, what="challenge"
        )

    async def reveals(self) -> RevealList:
        """``GET /audit/reveals`` (auditor role): reveals sealed to us."""
        return await self._transport.json(
            route("get_reveals"), RevealList, what="reveals", max_bytes=DEFAULT_MAX_MODEL_BYTES
        )

    async def submit_verdicts(self, submission: VerdictSubmission) -> VerdictReceipt:
        """``POST /audit/verdicts`` (auditor role): our control-sample verdicts."""
        return await self._transport.json(
            route("post_verdicts"), VerdictReceipt, payload=submission, what="verdict receipt"
        )

    async def quarantine(self, order: QuarantineOrder) -> QuarantineAnswer:
        """``POST /audit/quarantine`` (auditor role): a signed quarantine order."""
        return await self._transport.json(
            route("post_quarantine"), QuarantineAnswer, payload=order, what="quarantine answer"
        )
