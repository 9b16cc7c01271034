"""Holding an answer until the round changes: the change signal and the holds.

The coordinator fires :class:`ChangeSignal` whenever its token changes (and the ticker
when the roster does); a held request re-checks its condition on each firing, until its
own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from fedsec.aggregator.http.keys import COORDINATOR
from fedsec.errors import FedsecError

T = TypeVar("T")


class ChangeSignal:
    """Wakes long-polling requests when the coordinator's token changes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        #: Requests held right now, waiting for a change (tests wait on it instead of
        #: sleeping to know that a request is held).
        self.waiting = 0

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        self.waiting += 1
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
            # one per held request and firing (~3 % of an aggregator's CPU at 300 members)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        finally:
            self.waiting -= 1


CHANGED = web.AppKey("changed", ChangeSignal)


async def hold_while(request: web.Request, pending: Callable[[], bool], wait: float) -> None:
    """Hold the request, at most ``wait`` seconds, while ``pending()`` (re-checked each
    time the round state changes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while pending():
        left = deadline - loop.time()
        if left <= 0:
            return
        await request.app[CHANGED].wait(left)


async def hold_until(
    request: web.Request, round_: int, attempt: int, stage: str, wait: float
) -> bool:
    """Hold the request, at most ``wait`` seconds, while the attempt is still in
    progress before ``stage``; True when it has reached (or passed) ``stage``."""
    coord = request.app[COORDINATOR]
    await hold_while(request, lambda: coord.before_stage(round_, attempt, stage), wait)
    return coord.has_reached(round_, attempt, stage)


async def next_stage_data(
    request: web.Request, r: int, a: int, stage: str, wait: float, fetch: Callable[[], T]
) -> T | None:
    """After an accepted upload with ``?wait``: the next stage's data for the caller once
    the round reaches it, or None (no wait asked, not reached in time, attempt over, or
    the caller is not in it; the agent then falls back to polling)."""
    if wait <= 0 or not await hold_until(request, r, a, stage, wait):
        return None
    try:
        return fetch()
    except FedsecError:
        return None
