"""Crash resume: the attempt in progress, rebuilt from the state store by replaying its
accepted messages into a fresh summation session, stage by stage, exactly as they were
accepted (:func:`fedsec.summation.feed`, the routine the mode's ``replay`` sums with
for ``fedsec audit verify`` and the key custodian)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import log
from fedsec.aggregator.storage import MessageStore, RoundRow
from fedsec.errors import ProtocolError
from fedsec.protocol import wire
from fedsec.summation import StoredMessage, SummationSession, feed


def rebuild(
    row: RoundRow,
    messages: MessageStore,
    open_summation: Callable[[wire.RoundSpec], SummationSession],
) -> Attempt:
    """The attempt of ``row`` (in progress: neither closed nor aborted) as it stood.

    Args:
        row: the attempt's stored row.
        messages: the store holding its accepted messages.
        open_summation: a fresh summation session for a spec.

    Raises:
        ProtocolError: a stored message no longer verifies (the store was altered).
    """
    live = Attempt(row.round, row.attempt, "open", row.opened_at, row.stage_started_at)
    if row.spec is None:
        return live
    spec = msgspec.json.decode(row.spec, type=wire.RoundSpec)
    live.spec, live.summation = spec, open_summation(spec)
    stages = live.summation.stages
    reached = stages[: stages.index(row.stage) + 1]  # type: ignore[arg-type,unused-ignore]
    stored = [
        StoredMessage(stage, member, body)
        for stage in reached
        for member, body in messages.of_stage(row.round, row.attempt, stage)
    ]
    try:
        feed(live.summation, stored, through=row.stage)
    except ProtocolError as exc:  # pragma: no cover - stored messages were accepted once
        raise ProtocolError(f"state database: {exc.detail}") from None
    live.stage, live.stage_started_at = row.stage, row.stage_started_at
    log.info("event=resumed round=%d attempt=%d stage=%s", live.round, live.attempt, live.stage)
    return live
