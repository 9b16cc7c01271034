"""The registry of member steps: one class per summation mode, keyed by the round
spec's ``secure_sum``.  The one place on the agent's side that reads the mode;
:class:`fedsec.agent.round.AgentRound` looks its steps up here once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from fedsec.agent.he_steps import HeSteps
from fedsec.agent.member_steps import MemberAttempt, MemberSteps
from fedsec.agent.plain_steps import PlainSteps
from fedsec.agent.secagg_steps import SecAggSteps

#: secure_sum -> the member steps of an attempt in that mode
MEMBER_STEPS: Final[Mapping[str, Callable[[MemberAttempt], MemberSteps]]] = {
    "secagg": SecAggSteps,
    "he": HeSteps,
    "none": PlainSteps,
}


def member_steps(attempt: MemberAttempt) -> MemberSteps:
    """The steps of ``attempt``'s summation mode (the signed spec's ``secure_sum``, a
    mode the wire schema already admitted)."""
    return MEMBER_STEPS[attempt.spec.secure_sum](attempt)
