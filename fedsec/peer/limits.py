"""Limits and defaults of the decentralised mode, each declared once with its reason."""

from __future__ import annotations

from typing import Final

from fedsec.protocol.limits import MAX_MODEL_BYTES

#: Most values a peer's model may hold: the largest model file anyone reads
#: (:data:`fedsec.protocol.limits.MAX_MODEL_BYTES`) in float32, so the decentralised
#: mode trains nothing the aggregator-based one could not.
MAX_MODEL_VALUES: Final = MAX_MODEL_BYTES // 4
#: Bytes a model message holds besides its two vectors: federation id, sender key id and a
#: few integers in msgpack are under 300 bytes; 4 KiB leaves room without letting a
#: sender make a peer buffer more than one model's worth.
MESSAGE_OVERHEAD_BYTES: Final = 4096
#: Longest federation id a message may name (the aggregator's ids are far shorter).
MAX_FEDERATION_ID: Final = 128
#: Rounds a neighbour's model may trail the peer's own and still be averaged: the
#: asynchronous schedule lets a slow neighbour lag, and buffered mode's default
#: (``round.max_staleness``) is 4; gossip mixes every round, so a model two rounds old
#: already carries most of the neighbourhood's progress and older ones mostly drag.
DEFAULT_STALENESS: Final = 2
#: Rounds a neighbour may run ahead of the peer and still be heard: one, so a neighbour
#: that finished its round first is not refused, and a sender cannot make a peer hold a
#: model for a round far in the future (one slot per neighbour is kept either way).
MAX_AHEAD: Final = 1
#: Least cosine between a neighbour's update and the peer's reference direction for the
#: neighbour to be averaged in.  0: an update that points away is refused (FLTrust refuses
#: cosine ≤ 0 at any setting), one at a right angle or closer is kept; a sign-flipped update
#: lies far below it, while honest IID updates late in training scatter around the
#: reference and a higher bar refuses them too.
DEFAULT_MIN_COSINE: Final = 0.0
#: Longest a neighbour's update may be, over the peer's own update's length, before it is
#: refused.  Honest members train the same recipe from nearly the same model, so their
#: updates' lengths differ by tens of percent (Adam's steps are normalised); an update
#: boosted to outweigh its neighbours (the sign-flip attack sends 4x) is refused, and one
#: kept within 2x can outweigh at most two honest ones.
DEFAULT_MAX_NORM_RATIO: Final = 2.0
#: How far a neighbour's start may pull the peer's model, over the median pull of the
#: round's neighbours: ClippedGossip's remedy (He, Karimireddy & Jaggi 2022) with a radius
#: set by the neighbourhood itself.  While fewer than half the neighbours are forged the
#: median is an honest one, and twice it clips few honest starts (consensus is slowed
#: little) while a start forged to replace the model moves it no further than that.
CONSENSUS_CLIP_OVER_MEDIAN: Final = 2.0
#: Model exchanges per round.  The first carries the round's training (start and update,
#: judged by the filter); each further one carries only the peer's mixed model, one more
#: averaging step with the same neighbours.  Training rounds are the expensive part and
#: an exchange costs only a model's bytes per neighbour, so a round mixes until the peers'
#: models are close: the consensus error shrinks by the mixing matrix's second eigenvalue
#: per exchange (about 0.78 for 20 members of degree 4 averaged uniformly over the random
#: topology, so eight exchanges leave an eighth of it), and one exchange a round left the
#: peers' models far apart and 10 pt below FedAvg (docs/decentralised.md, measured).
DEFAULT_EXCHANGES: Final = 8
#: Most exchanges a round may have: each one can hold the round open for up to a round
#: timeout, and after 32 the consensus error of 20 members of degree 4 is under 0.1 % of
#: what it was, so more buys nothing measurable.
MAX_EXCHANGES: Final = 32
#: Seconds a peer waits for its neighbours' models of an exchange before it averages what
#: it has: a slow or missing neighbour is skipped, not waited for.
DEFAULT_ROUND_TIMEOUT_S: Final = 30.0
#: Seconds one send to a neighbour may take: the neighbour's model is skipped after the
#: round timeout anyway, so a send that has not finished by then is not worth keeping.
DEFAULT_SEND_TIMEOUT_S: Final = 10.0


def max_message_bytes(values: int) -> int:
    """The largest model message a peer with ``values`` parameters reads."""
    return 2 * 4 * values + MESSAGE_OVERHEAD_BYTES


#: Rounds of version history an offer carries: (round, SHA-256 of the model the offering
#: peer started that round from), newest last.  A returning peer checks that the newest
#: step is the offered model's and an auditor can match the steps with the offering
#: peer's journal; 16 rounds cover any absence the staleness bound could bridge many
#: times over, at 16 short pairs (about 1.2 KiB) per offer.
MAX_OFFER_HISTORY: Final = 16
#: Offers a peer makes one neighbour within one of its own rounds.  Every offer is a line
#: in the peer's journal (the auditor matches catch-ups with it), so a neighbour must not
#: be able to grow it without bound; an honest returning peer asks once at start and at
#: most once a round after that, so four leave room for retries after lost answers.
MAX_OFFERS_PER_ROUND: Final = 4
#: Bytes an offer holds besides its model message: federation id, two key ids, a nonce,
#: a signature and the history (under 80 bytes a step in msgpack); 4 KiB leaves room.
OFFER_OVERHEAD_BYTES: Final = 4096
#: Bytes of a catch-up request (federation id, requester key id, nonce in msgpack: under
#: 300); anything longer is refused before it is read.
MAX_OFFER_REQUEST_BYTES: Final = 1024
#: Seconds a returning peer waits for a neighbour's offer: an offer is one model's bytes,
#: as a send is, so the send timeout's reasoning holds.
DEFAULT_OFFER_TIMEOUT_S: Final = DEFAULT_SEND_TIMEOUT_S


def max_offer_bytes(values: int) -> int:
    """The largest catch-up offer a peer with ``values`` parameters reads."""
    return max_message_bytes(values) + MAX_OFFER_HISTORY * 80 + OFFER_OVERHEAD_BYTES
