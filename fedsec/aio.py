"""Asyncio helpers shared by every long-running part of fedsec.

The invariant both keep: cancelling the *caller* always cancels it.  The pattern they
replace (``task.cancel()`` then ``with suppress(CancelledError): await task``) swallows
the caller's own cancellation when it arrives while the caller waits for the cancelled
task, and a member, custodian or simulation told to stop then runs on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (None and finished ones are skipped) and wait until all have
    ended; their results and errors are dropped, since nobody wants them any more.

    Raises:
        asyncio.CancelledError: the caller itself was cancelled meanwhile (the tasks
            have still been told to stop).
    """
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    try:
        await asyncio.wait(pending)
    finally:
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" noise


async def unless_stopped(request: Awaitable[T], stop: asyncio.Event) -> asyncio.Future[T] | None:
    """Run ``request`` until it ends or ``stop`` is set, whichever comes first.

    Returns the ended request (read it with ``.result()``), or None once ``stop`` was
    set first; the request is then cancelled.

    Raises:
        asyncio.CancelledError: the caller was cancelled (the request is cancelled too).
    """
    if stop.is_set():
        if asyncio.iscoroutine(request):
            request.close()  # never started; closing it spares a "never awaited" warning
        return None
    fetch = asyncio.ensure_future(request)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({fetch, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(fetch, stopper)
    return fetch if fetch in done else None
