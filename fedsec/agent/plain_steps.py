"""This member's stages of a plain (trusted-mode) attempt: train, then send the packed
quantized update once the attempt reaches masked_input.  The aggregator sees the update;
its aggregation rule may keep a receipted one out, and the member reads why."""

from __future__ import annotations

from fedsec.agent.actions import Step
from fedsec.agent.charges import TrainedUpdate
from fedsec.agent.contribution import Contribution
from fedsec.agent.member_steps import MemberAttempt, charge_and_train
from fedsec.crypto.quantize import pack
from fedsec.protocol.stages import Stage
from fedsec.protocol.wire import Receipt


class PlainSteps:
    """The plain summation mode's member steps (:class:`~fedsec.agent.member_steps.MemberSteps`)."""

    first_stage: Stage = "masked_input"
    releases_update = False  # the aggregator sees the update itself: nothing to difference
    judged_by_rule = True

    def __init__(self, attempt: MemberAttempt) -> None:
        self.attempt = attempt

    def train(self) -> Step[tuple[TrainedUpdate, bool]]:
        return (yield from charge_and_train(self.attempt)), False

    def finish(self, c: Contribution) -> Step[Receipt]:
        attempt = self.attempt
        yield from attempt.tracker.wait_for(("masked_input",))
        receipt, _ = yield from attempt.send_vector(c, pack(c.quantized, attempt.spec.ring_bits))
        return receipt
