"""The asyncio helpers never swallow their caller's cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fedsec.aio import cancel_and_wait, unless_stopped

#: Event-loop steps over which a cancellation is tried: the request ends at step 0 and
#: the caller has returned well before this many steps.
STEPS = 12


async def _cancelled_after(steps: int) -> tuple[bool, bool]:
    """Run unless_stopped on a request that ends, cancel the caller ``steps`` loop
    steps later; (whether cancel() took, whether the caller ended cancelled)."""
    request: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(unless_stopped(request, asyncio.Event()))
    await asyncio.sleep(0)
    request.set_result(7)
    for _ in range(steps):
        await asyncio.sleep(0)
    took = caller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    return took, caller.cancelled()


@pytest.mark.parametrize("steps", range(STEPS))
def test_a_caller_cancelled_at_any_step_ends_cancelled(steps: int) -> None:
    took, cancelled = asyncio.run(_cancelled_after(steps))
    assert took == cancelled  # a cancel that took is never swallowed


def test_every_step_is_tried_from_running_to_returned() -> None:
    outcomes = {asyncio.run(_cancelled_after(steps)) for steps in range(STEPS)}
    assert outcomes == {(True, True), (False, False)}


def test_the_request_answers_or_the_stop_wins() -> None:
    async def main() -> tuple[int, bool, bool]:
        answered = await unless_stopped(asyncio.sleep(0, result=5), asyncio.Event())
        assert answered is not None
        stop = asyncio.Event()
        slow = asyncio.ensure_future(asyncio.sleep(30))
        asyncio.get_running_loop().call_later(0.01, stop.set)
        stopped = await unless_stopped(slow, stop)
        never = asyncio.sleep(0)
        already = await unless_stopped(never, stop)  # stop already set: never started
        return answered.result(), stopped is None and slow.cancelled(), already is None

    assert asyncio.run(main()) == (5, True, True)


def test_cancel_and_wait_ends_every_task_and_drops_their_errors() -> None:
    async def fails() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            raise RuntimeError("cleanup failed")

    async def main() -> list[bool]:
        tasks = [asyncio.ensure_future(fails()), asyncio.ensure_future(asyncio.sleep(30))]
        await asyncio.sleep(0)
        await cancel_and_wait(*tasks, None)
        return [task.done() for task in tasks]

    assert asyncio.run(main()) == [True, True]
