"""Stored messages -> a server session: the one replay routine of crash resume
(:mod:`fedsec.aggregator.rounds.resume`) and re-aggregation
(``fedsec audit verify``), so both rebuild a round exactly as it was accepted."""

from __future__ import annotations

import msgspec

from fedsec.crypto.secagg import MaskedInput, ServerSession
from fedsec.protocol.codec import (
    advertise_message,
    consistency_message,
    share_keys_message,
    unmask_message,
)
from fedsec.protocol.wire import (
    AdvertiseKeysBody,
    ConsistencyBody,
    ShareKeysBody,
    UnmaskResponseBody,
)


def feed_accepted(session: ServerSession, stage: str, member: str, raw: bytes) -> None:
    """Feed a message accepted earlier (as stored or archived: JSON body, or the raw
    vector for ``masked_input``) back into ``session``.

    Raises:
        ValueError: ``stage`` is not a SecAgg+ message stage.
        msgspec.DecodeError, FedsecError: the stored body no longer decodes or
            verifies (the store was altered).
    """
    if stage == "advertise":
        session.receive_advertise(
            advertise_message(member, msgspec.json.decode(raw, type=AdvertiseKeysBody))
        )
    elif stage == "share_keys":
        session.receive_share_keys(
            share_keys_message(member, msgspec.json.decode(raw, type=ShareKeysBody))
        )
    elif stage == "masked_input":
        session.receive_masked_input(MaskedInput(member, raw))
    elif stage == "consistency":
        session.receive_consistency(
            consistency_message(member, msgspec.json.decode(raw, type=ConsistencyBody))
        )
    elif stage == "unmask":
        session.receive_unmask(
            unmask_message(member, msgspec.json.decode(raw, type=UnmaskResponseBody))
        )
    else:
        raise ValueError(f"unknown SecAgg+ stage {stage!r}")
