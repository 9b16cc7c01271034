"""A peer that missed rounds rejoins from its neighbours' newest models.

Each neighbour offers the newest round it trained (its exchange-0 message, as it sent it to
its neighbours; the I/O layer has checked that the neighbour's key signed it, as it does
before :meth:`fedsec.peer.gossip.GossipPeer.receive`).  Every offer is checked completely
before the peer changes: it decodes for the peer's model size, names the peer's
federation and exchange 0, names as sender the key that signed it, and that key is one of
the peer's neighbours.  Offers more than ``staleness`` rounds behind the newest are left
out (a neighbour that is itself behind).  The peer adopts the coordinate-wise median
(:func:`fedsec.learning.robust.median`) of the offered rounds' ends x_j + Δ_j, so one
forged offer among three or more cannot move it outside the honest ones' range, and the
round after the newest offered, so its next message is at most one round ahead of any
neighbour (:data:`~fedsec.peer.limits.MAX_AHEAD`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from fedsec.errors import AuthError, ProtocolError, UnknownMember
from fedsec.learning import robust
from fedsec.peer import messages
from fedsec.peer.messages import PeerModel, Vector


@dataclass(frozen=True)
class CatchUp:
    """Where a returning peer continues: ``round`` from ``model``, made of ``sources``
    (key id -> the SHA-256 of the offer used)."""

    round: int
    model: Vector
    sources: dict[str, str]


def judge_offers(
    federation_id: str,
    neighbours: Collection[str],
    values: int,
    staleness: int,
    current_round: int,
    offers: Mapping[str, bytes],
) -> CatchUp:
    """The model and round a peer at ``current_round`` rejoins with, from ``offers``
    (key id that signed it -> message bytes).

    Raises:
        PayloadTooLarge, PayloadError, BadVector: see :func:`fedsec.peer.messages.decode`.
        ProtocolError: an offer of another federation or of a mixing exchange; no offer;
            or none newer than the peer's own round (nothing to catch up).
        AuthError: an offer naming a sender other than the key that signed it.
        UnknownMember: an offer from a key that is not the peer's neighbour.
    """
    offered: dict[str, PeerModel] = {}
    for sender, raw in sorted(offers.items()):
        message = messages.decode(raw, values)
        if message.federation_id != federation_id:
            raise ProtocolError(f"an offer of federation {message.federation_id!r}")
        if message.sender != sender:
            raise AuthError(f"the offer names sender {message.sender}, but {sender} signed it")
        if sender not in neighbours:
            raise UnknownMember(f"{sender} is not a neighbour of this peer")
        if message.exchange != 0:
            raise ProtocolError("a catch-up offer is a round's training (exchange 0)")
        offered[sender] = message
    if not offered:
        raise ProtocolError("no neighbour offered a model to catch up from")
    newest = max(m.round for m in offered.values())
    if newest < current_round:
        raise ProtocolError(f"no neighbour is past this peer's round {current_round}")
    used = {s: m for s, m in offered.items() if m.round >= newest - staleness}
    ends = np.stack([m.start_vector() + m.update_vector() for m in used.values()])
    model = robust.median(ends, np.ones(len(ends))).update
    return CatchUp(newest + 1, model, {s: m.sha256 for s, m in used.items()})
