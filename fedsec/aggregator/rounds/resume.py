"""Crash resume: the attempt in progress, rebuilt from the state store by replaying its
accepted messages into a fresh summation session, stage by stage, exactly as they were
accepted (through :func:`fedsec.protocol.replay.feed_accepted` for SecAgg+, the routine
``fedsec audit verify`` re-aggregates with)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import log
from fedsec.aggregator.storage import MessageStore, RoundRow
from fedsec.aggregator.summation import SummationSession
from fedsec.errors import FedsecError, ProtocolError
from fedsec.protocol import wire
from fedsec.protocol.stages import stage_index


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
    reached = stage_index(row.stage)
    for stage in live.summation.stages:
        live.stage = stage
        for member, body in messages.of_stage(row.round, row.attempt, stage):
            _replay(live.summation, stage, member, body)
        if stage_index(stage) >= reached:
            break
        live.summation.close(stage)
    live.stage, live.stage_started_at = row.stage, row.stage_started_at
    log.info("event=resumed round=%d attempt=%d stage=%s", live.round, live.attempt, live.stage)
    return live


def _replay(session: SummationSession, stage: str, member: str, body: bytes) -> None:
    try:
        session.replay(stage, member, body)
    except FedsecError as exc:  # pragma: no cover - stored messages were accepted once
        raise ProtocolError(
            f"state database holds a {stage} message from {member} that no longer "
            f"verifies: {exc.detail}"
        ) from None
