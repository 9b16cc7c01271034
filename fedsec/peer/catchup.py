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

Over the network (:mod:`fedsec.peer.http`) the returning peer asks each neighbour with a
signed :class:`OfferRequest` carrying a fresh nonce, and each answers an :class:`Offer`:
its newest trained message as it sent it, with its version history (the chain of
(round, model SHA-256) it started its last rounds from, at most
:data:`~fedsec.peer.limits.MAX_OFFER_HISTORY`), all signed with its key (domain
``peer-offer``) and bound to federation, requester and nonce, so an offer is neither
forged, nor made for another peer, federation or request (an old one replayed).
:func:`open_offer` checks all of it, the size first, before anything is decoded.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.errors import (
    AuthError,
    IntegrityError,
    PayloadError,
    ProtocolError,
    ReplayError,
    StaleUpdate,
    UnknownMember,
)
from fedsec.learning import robust
from fedsec.peer import messages
from fedsec.peer.limits import (
    MAX_FEDERATION_ID,
    MAX_OFFER_HISTORY,
    MAX_OFFER_REQUEST_BYTES,
    max_offer_bytes,
)
from fedsec.peer.messages import PeerModel, Vector
from fedsec.protocol import body
from fedsec.protocol.limits import MAX_ID

OFFER_DOMAIN: Final = "peer-offer"
#: A nonce is 32 random bytes in hex: fresh for every catch-up, so no offer made for one
#: fits another.
NONCE_HEX: Final = 64
_HEX64: Final = re.compile(r"[0-9a-f]{64}")


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


class VersionStep(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A round the offering peer trained and the SHA-256 of the model it started from
    (float32 little-endian, as the journal's ``peer_combined.model_sha256``)."""

    round: int
    model_sha256: str


class OfferRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A returning peer's signed request for a neighbour's newest trained round."""

    federation_id: str
    requester: str  # the key id that signs the request
    nonce: str  # NONCE_HEX hex characters, fresh for this catch-up


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A neighbour's answer: its newest exchange-0 message (as it sent it) and its version
    history, oldest first, ending at that message's round and start; ``signature`` by the
    sender over :func:`offer_statement`."""

    federation_id: str
    sender: str
    requester: str
    nonce: str
    model: bytes
    history: list[VersionStep]
    signature: bytes


def version_step(message: PeerModel) -> VersionStep:
    """The step of the round ``message`` trained."""
    return VersionStep(message.round, hashlib.sha256(message.start).hexdigest())


def offer_statement(
    federation_id: str,
    sender: str,
    requester: str,
    nonce: str,
    model: bytes,
    history: Sequence[VersionStep],
) -> bytes:
    """What an offer's signature covers: every field but the signature, the model as its
    SHA-256."""
    return canonical_json(
        {
            "federation_id": federation_id,
            "sender": sender,
            "requester": requester,
            "nonce": nonce,
            "model_sha256": hashlib.sha256(model).hexdigest(),
            "history": [[s.round, s.model_sha256] for s in history],
        }
    )


def decode_request(raw: bytes) -> OfferRequest:
    """A catch-up request from ``raw``, its size checked first.

    Raises:
        PayloadTooLarge: longer than :data:`~fedsec.peer.limits.MAX_OFFER_REQUEST_BYTES`.
        PayloadError: not a request, or a field out of range.
    """
    request = body.decode_msgpack(
        raw, OfferRequest, max_bytes=MAX_OFFER_REQUEST_BYTES, what="a catch-up request"
    )
    if not 0 < len(request.federation_id) <= MAX_FEDERATION_ID:
        raise PayloadError(f"federation id must be 1..{MAX_FEDERATION_ID} characters")
    if not _HEX64.fullmatch(request.nonce):
        raise PayloadError(f"the nonce must be {NONCE_HEX} lower-case hex characters")
    return request


def make_offer(
    signer: SigningIdentity,
    request: OfferRequest,
    newest: PeerModel,
    history: Sequence[VersionStep],
) -> Offer:
    """The offer answering ``request`` with ``newest``, the signer's newest trained
    message, and its ``history`` (oldest first, ending at ``newest``'s round)."""
    model = messages.encode(newest)
    steps = list(history)[-MAX_OFFER_HISTORY:]
    statement = offer_statement(
        request.federation_id, signer.key_id, request.requester, request.nonce, model, steps
    )
    return Offer(
        request.federation_id,
        signer.key_id,
        request.requester,
        request.nonce,
        model,
        steps,
        signer.sign(OFFER_DOMAIN, statement),
    )


@dataclass(frozen=True)
class Asked:
    """What a returning peer asked one neighbour: what its offer must be bound to."""

    federation_id: str
    requester: str  # this peer's key id
    nonce: str
    sender: str  # the neighbour's key id
    sender_public: bytes
    values: int  # the federation's model size
    current_round: int  # the round this peer is at


def open_offer(raw: bytes, asked: Asked) -> PeerModel:
    """The model message of a neighbour's offer, once every binding has been checked.

    Raises:
        PayloadTooLarge: ``raw`` is longer than any offer of the model's size (checked
            before it is decoded).
        PayloadError, BadVector: not an offer, a history that is empty, too long or out of
            order, or a model message that does not decode (:func:`messages.decode`).
        ProtocolError: an offer for another federation, or of a mixing exchange.
        AuthError: an offer or message naming a sender other than the neighbour asked.
        ReplayError: an offer made for another peer or another request (nonce).
        SignatureError: the signature is not the neighbour's over the offer.
        IntegrityError: the history does not end at the offered model.
        StaleUpdate: an offer of a round behind this peer's own.
    """
    offer = body.decode_msgpack(
        raw, Offer, max_bytes=max_offer_bytes(asked.values), what="a catch-up offer"
    )
    if offer.federation_id != asked.federation_id:
        raise ProtocolError(f"an offer for federation {offer.federation_id[:MAX_FEDERATION_ID]!r}")
    if offer.sender != asked.sender:
        raise AuthError(f"the offer names sender {offer.sender[:80]}, not {asked.sender}")
    if offer.requester != asked.requester or offer.nonce != asked.nonce:
        raise ReplayError("the offer was made for another request (requester or nonce)")
    _check_history(offer.history)
    statement = offer_statement(
        offer.federation_id, offer.sender, offer.requester, offer.nonce, offer.model, offer.history
    )
    PublicIdentity(asked.sender_public).verify(OFFER_DOMAIN, statement, offer.signature)
    message = messages.decode(offer.model, asked.values)
    if message.federation_id != asked.federation_id or message.sender != asked.sender:
        raise AuthError("the offered message names another federation or sender than its offer")
    if message.exchange != 0:
        raise ProtocolError("a catch-up offer is a round's training (exchange 0)")
    if offer.history[-1] != version_step(message):
        raise IntegrityError("the offer's history does not end at the offered model")
    if message.round < asked.current_round:
        raise StaleUpdate(
            f"the offer is of round {message.round}, behind this peer's round {asked.current_round}"
        )
    return message


def _check_history(history: Sequence[VersionStep]) -> None:
    if not 1 <= len(history) <= MAX_OFFER_HISTORY:
        raise PayloadError(f"an offer's history holds 1..{MAX_OFFER_HISTORY} rounds")
    rounds = [s.round for s in history]
    if any(not 0 <= r <= MAX_ID for r in rounds) or rounds != sorted(set(rounds)):
        raise PayloadError("an offer's history rounds must rise, each in 0..MAX_ID")
    if not all(_HEX64.fullmatch(s.model_sha256) for s in history):
        raise PayloadError("an offer's history holds SHA-256 digests in lower-case hex")
