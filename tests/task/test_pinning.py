"""The signed round spec pins the task package; a member refuses a round whose pin is
not what it installed, before it trains or is charged anything."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from fedsec.errors import TaskDigestMismatch
from fedsec.protocol.wire import RoundSpec, TaskPin
from fedsec.task.digest import loaded_task_pin
from tests.agent.test_agent_round import DIM, TASK, make_spec, start

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _pinned(**changes: str) -> TaskPin:
    return msgspec.structs.replace(loaded_task_pin(TASK.name), **changes)


def test_a_round_pinning_what_is_installed_is_accepted() -> None:
    spec = make_spec(task_pin=_pinned())
    assert spec.task_pin is not None and spec.task_pin.distribution == "fedsec"
    round_ = start(spec)
    assert not round_.training


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"digest": "0" * 64}, "digest expected '0000"),
        ({"version": "9.9"}, "version expected '9.9', installed '0.1.0'"),
        ({"distribution": "evil-tasks"}, "distribution expected 'evil-tasks', installed 'fedsec'"),
    ],
)
def test_a_round_whose_pin_differs_is_refused_before_training(
    changes: dict[str, str], named: str
) -> None:
    spec = make_spec(task_pin=_pinned(**changes))
    with pytest.raises(TaskDigestMismatch, match=named) as info:
        start(spec)
    assert info.value.code == "task_digest_mismatch"
    assert f"round {spec.round}" in info.value.detail


def test_the_pin_is_signed_and_old_specs_keep_their_bytes() -> None:
    unpinned = make_spec()
    assert b"task_pin" not in msgspec.json.encode(unpinned)
    pinned = make_spec(task_pin=_pinned())
    decoded = msgspec.json.decode(msgspec.json.encode(pinned), type=RoundSpec)
    assert decoded.task_pin == pinned.task_pin
    assert pinned.signature != unpinned.signature
    assert DIM > 0
