"""The registry of member steps covers exactly the summation modes the protocol has."""

from __future__ import annotations

import typing

from fedsec.agent.steps import MEMBER_STEPS
from fedsec.protocol.wire import RoundSpec


def test_every_summation_mode_has_member_steps_and_no_other() -> None:
    modes = typing.get_args(typing.get_type_hints(RoundSpec)["secure_sum"])
    assert sorted(MEMBER_STEPS) == sorted(modes) == ["he", "none", "secagg"]
