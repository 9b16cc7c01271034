"""What a summation mode's member steps are, and what the attempt lends them.

:class:`fedsec.agent.round.AgentRound` runs the parts every mode shares (the spec and
task checks, charging, the privacy report, encoding the update, keeping it, the receipt,
the outcome); the mode's own stages are a :class:`MemberSteps` object, picked once by the
spec's ``secure_sum`` from :data:`fedsec.agent.steps.MEMBER_STEPS`.  Steps are sans-I/O
like the round: each ``yield`` is an action of :mod:`fedsec.agent.actions`, so any
topology that performs those actions (today the star of
:mod:`fedsec.agent.seam`) runs every mode.
"""

from __future__ import annotations

from typing import Protocol

from fedsec.agent.actions import Step
from fedsec.agent.attempt import AttemptTracker
from fedsec.agent.charges import PrivacyCharge, TrainedUpdate
from fedsec.agent.charging import Carryover, charge_step
from fedsec.agent.contribution import Contribution
from fedsec.agent.member import Member
from fedsec.protocol.stages import Stage
from fedsec.protocol.wire import Receipt, RoundSpec, UnmaskRequestBody


class MemberAttempt(Protocol):
    """The attempt a mode's steps are part of (:class:`fedsec.agent.round.AgentRound`)."""

    spec: RoundSpec
    member: Member

    @property
    def tracker(self) -> AttemptTracker:
        """The attempt's newest round state, and the waits for its stages."""
        ...

    @property
    def carry(self) -> Carryover:
        """What earlier attempts left: an update to reuse, an unused charge."""
        ...

    @property
    def graph_nonce(self) -> bytes:
        """SecAgg+: the nonce this member committed to when joining the attempt."""
        ...

    def start_training(self, charge: TrainedUpdate | PrivacyCharge) -> Step[None]:
        """Train on ``charge`` in the background (nothing to do for a reused update)."""
        ...

    def await_training(self) -> Step[TrainedUpdate]:
        """The update training produced; training's error ends the attempt."""
        ...

    def send_vector(
        self, c: Contribution, vector: bytes, wait: float = 0.0, commitments_sha256: str = ""
    ) -> Step[tuple[Receipt, UnmaskRequestBody | None]]:
        """Keep the update, send ``vector`` with our signed statement, check and store
        the receipt (see :meth:`fedsec.agent.round.AgentRound.send_vector`)."""
        ...


class MemberSteps(Protocol):
    """One summation mode's part of a member's attempt.

    Attributes:
        first_stage: the first stage this mode's member takes part in; an attempt
            already past it is missed before anything is spent.
        releases_update: the update is released in the ledger before its vector
            leaves: the aggregator holds something it could difference against a
            retried attempt's sum (a masked input, a ciphertext).
        judged_by_rule: the aggregator sees each update and its aggregation rule may
            keep a receipted one out (trusted mode): the member reads why.
    """

    first_stage: Stage
    releases_update: bool
    judged_by_rule: bool

    def train(self) -> Step[tuple[TrainedUpdate, bool]]:
        """Charge, train, and whatever this mode does while training runs.

        Returns:
            The trained update, and whether the privacy report was taken on the way
            (False: the round sends it on its own).
        """
        ...

    def finish(self, c: Contribution) -> Step[Receipt]:
        """Send the contribution through this mode's stages; its receipt."""
        ...


def charge_and_train(attempt: MemberAttempt) -> Step[TrainedUpdate]:
    """Charge (or reuse), then train and await the update: what a mode with nothing to
    do during training does."""
    charge = yield from charge_step(attempt.spec, attempt.carry, attempt.member)
    yield from attempt.start_training(charge)
    return (yield from attempt.await_training())
