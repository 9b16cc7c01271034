"""The aggregator pins the task package: every spec it signs names its own installation,
and a member whose installed package differs is refused at join, over real HTTP."""

from __future__ import annotations

import msgspec
import pytest

from fedsec.protocol import wire
from fedsec.task.digest import loaded_task_pin
from tests.support.aggregator import TASK
from tests.support.http import JOIN, Api, _fix_cohort, _join_body

pytestmark = pytest.mark.asyncio


def _other_package(**changes: str) -> wire.TaskPin:
    return msgspec.structs.replace(loaded_task_pin(TASK), **changes)


async def test_the_signed_spec_pins_the_aggregators_installation(api: Api) -> None:
    cohort = await _fix_cohort(api)
    assert cohort.spec.task_pin == loaded_task_pin(TASK)
    assert api.coord.live.spec is not None and api.coord.live.spec.task_pin == cohort.spec.task_pin


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"digest": "0" * 64}, ["digest expected"]),
        ({"version": "9.9.9", "digest": "1" * 64}, ["version expected", "digest expected"]),
        ({"distribution": "evil-task"}, ["distribution expected"]),
    ],
)
async def test_a_member_with_another_package_is_refused_at_join(
    api: Api, changes: dict[str, str], named: list[str]
) -> None:
    body = _join_body("a0", task_pin=_other_package(**changes))
    detail = await api.refused(
        409, "task_digest_mismatch", lambda: api.call("a0", "POST", JOIN, body)
    )
    for phrase in named:
        assert phrase in detail
    for field in {"entry point", "distribution", "version", "digest"} - {
        p.split(" expected")[0] for p in named
    }:
        assert f"{field} expected" not in detail  # only what differs is named
    assert "a0" in detail


async def test_a_join_without_a_pin_is_refused(api: Api) -> None:
    body = _join_body("a0", task_pin=None)
    detail = await api.refused(
        409, "task_digest_mismatch", lambda: api.call("a0", "POST", JOIN, body)
    )
    assert "no task pin" in detail


async def test_the_same_package_joins(api: Api) -> None:
    answer = await api.ok("a0", "POST", JOIN, _join_body("a0", task_pin=loaded_task_pin(TASK)))
    assert answer == {"accepted": True, "detail": "joined"}
