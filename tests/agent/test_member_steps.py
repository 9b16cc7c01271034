"""The registry of member steps covers exactly the summation modes the protocol has, and
each mode's member steps start at the mode's first message stage."""

from __future__ import annotations

import typing

from fedsec.agent.steps import MEMBER_STEPS
from fedsec.protocol.wire import RoundSpec
from fedsec.summation import MODES


def test_every_summation_mode_has_member_steps_and_no_other() -> None:
    modes = typing.get_args(typing.get_type_hints(RoundSpec)["secure_sum"])
    assert sorted(MEMBER_STEPS) == sorted(modes) == sorted(MODES) == ["he", "none", "secagg"]


def test_a_member_takes_part_from_its_modes_first_message_stage() -> None:
    # an attempt past this stage is missed before anything is spent
    for name, steps in MEMBER_STEPS.items():
        assert steps.first_stage == MODES[name].stages[0], name
