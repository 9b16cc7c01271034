"""Small gossip neighbourhoods for the peer tests: keys, a journal per peer, models."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.peer.gossip import GossipPeer, GossipSettings
from fedsec.peer.journal import PeerJournal

FED = "fed-gossip"
DIM = 8


@dataclass
class Neighbourhood:
    """Peer ``me`` and the identities of its neighbours and of one member that is not."""

    me: SigningIdentity
    neighbours: list[SigningIdentity]
    stranger: SigningIdentity
    peer: GossipPeer

    @property
    def roster(self) -> dict[str, bytes]:
        everyone = [self.me, *self.neighbours, self.stranger]
        return {i.key_id: i.public_bytes for i in everyone}


def make_neighbourhood(
    neighbours: int = 3,
    settings: GossipSettings | None = None,
    samples: int = 10,
    exchanges: int = 1,
) -> Neighbourhood:
    """A peer whose rounds have ``exchanges`` exchanges (one: each combine ends a round,
    what the tests of a round's training and filtering need)."""
    settings = dataclasses.replace(settings or GossipSettings(), exchanges=exchanges)
    me = SigningIdentity.generate()
    others = [SigningIdentity.generate() for _ in range(neighbours)]
    stranger = SigningIdentity.generate()
    peer = GossipPeer(
        FED,
        me.key_id,
        [o.key_id for o in others],
        np.zeros(DIM),
        samples,
        PeerJournal(FED, me),
        settings,
    )
    return Neighbourhood(me, others, stranger, peer)


@pytest.fixture
def hood() -> Neighbourhood:
    return make_neighbourhood()
