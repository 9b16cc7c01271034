"""One peer's side of gossip averaging, as a sans-I/O state machine.

A round ``r`` of peer i: it starts from its model x_i, trains locally to x_i + Δ_i and
sends (x_i, Δ_i) to its neighbours (:meth:`GossipPeer.own_model`); meanwhile it keeps the
newest round each neighbour sent (:meth:`GossipPeer.receive`, which validates a message
completely before it keeps anything, so a refused one leaves the peer as it was); when
every neighbour's round is in, or the round's timeout has passed, it combines
(:meth:`GossipPeer.combine`):

- neighbours whose newest round is more than ``staleness`` rounds old are skipped;
- with filtering on, a neighbour whose update Δ_j is longer than ``max_norm_ratio`` times
  the peer's own Δ_i is refused (the own update is the one length the peer knows is
  honest, so no honest majority among its neighbours is assumed); of the others, one
  whose update has cosine below ``min_cosine`` to the reference is refused, each reason
  in the journal: FLTrust's trust test
  (:func:`fedsec.learning.robust.fltrust`).  The reference is the coordinate-wise median
  of Δ_i and the updates of the *other* neighbours the length test kept
  (:func:`fedsec.learning.robust.median`), the direction the peer and its honest
  neighbours agree on while they are the majority, or Δ_i alone (``reference = "own"``).
  The judged update is left out of its own reference: honest updates share only a small
  common part, and a median it votes in follows it on every coordinate where it lies
  between the others (measured: 92 % of −1.5Δ flips passed a median with them in, 20 %
  pass one without);
- each accepted neighbour contributes its round's end relative to x_i, its start's pull
  x_j − x_i clipped to :data:`~fedsec.peer.limits.CONSENSUS_CLIP_OVER_MEDIAN` times the
  median pull of the round's neighbours (so a start far from the neighbourhood, honest
  or forged, moves x_i no further than a typical one) plus Δ_j;
- the new model is x_i plus the mean of Δ_i and those contributions weighted by the
  records each was trained on (:func:`fedsec.learning.robust.fedavg`).

That is the round's first exchange.  Each of its ``exchanges − 1`` further ones is one
more averaging step with no training (:meth:`GossipPeer.mixing_model`): every peer sends
its mixed model, and x_i moves by the volume-weighted mean of 0 (itself) and the pulls of
the neighbours the first exchange accepted, each clipped as above.  A neighbour refused
for its update is not heard again in that round; one that passed can move x_i by no more
than the clipped pull per exchange.  Mixing is post-processing of what training released,
so it spends no privacy budget.

The update is judged on its own, not as the neighbour's end minus x_i: models drift
apart between peers, and that difference is mostly the drift (measured: 69 % of honest
neighbours refused, 62 % accuracy against 93 % for FedAvg, ``fedsec bench gossip``).

Refusals of the messages themselves (wrong federation, replayed or stale round, a sender
that is not a neighbour, a malformed vector) are raised, never journalled: a sender can
send any number of them, and the journal keeps what the peer used.  The one trace a
refused message leaves is a note that a neighbour's round was too far ahead
(:meth:`GossipPeer.noticed_behind`): the peer may have missed rounds, and the runner asks
its neighbours for offers to catch up from; only their signed offers' median can move it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsec.errors import (
    AggregationImpossible,
    AuthError,
    ConfigError,
    NotFound,
    PayloadError,
    ProtocolError,
    RateLimited,
    ReplayError,
    StaleUpdate,
    UnknownMember,
)
from fedsec.learning import robust
from fedsec.peer import messages
from fedsec.peer.catchup import CatchUp, VersionStep, judge_offers, version_step
from fedsec.peer.journal import PeerJournal
from fedsec.peer.limits import (
    CONSENSUS_CLIP_OVER_MEDIAN,
    DEFAULT_EXCHANGES,
    DEFAULT_MAX_NORM_RATIO,
    DEFAULT_MIN_COSINE,
    DEFAULT_STALENESS,
    MAX_AHEAD,
    MAX_EXCHANGES,
    MAX_MODEL_VALUES,
    MAX_OFFER_HISTORY,
    MAX_OFFERS_PER_ROUND,
)
from fedsec.peer.messages import PeerModel, Vector
from fedsec.protocol.limits import MAX_ID
from fedsec.protocol.peer_journal import (
    PeerCaughtUp,
    PeerCombined,
    PeerOfferSent,
    PeerReceived,
    PeerRefused,
    PeerSent,
)


@dataclass(frozen=True)
class GossipSettings:
    """How a peer combines: ``robust`` filters by agreement with its own direction."""

    robust: bool = True
    min_cosine: float = DEFAULT_MIN_COSINE
    staleness: int = DEFAULT_STALENESS
    #: what a neighbour's update is judged against: "median", the coordinate-wise median
    #: of the peer's own update and the round's other neighbours' (the neighbourhood's
    #: direction, which an honest majority decides); "own", the peer's own update alone
    reference: Literal["median", "own"] = "median"
    #: model exchanges per round, the first with the round's training
    exchanges: int = DEFAULT_EXCHANGES
    #: a neighbour's update longer than this many times the peer's own is refused; 0: off
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO

    def __post_init__(self) -> None:
        robust.check_parameter("min_trust_score", self.min_cosine)
        robust.check_parameter("max_norm_ratio", self.max_norm_ratio)
        if not 0 <= self.staleness <= MAX_ID:
            raise ConfigError(f"peer.staleness must be in 0..{MAX_ID}, got {self.staleness}")
        if not 1 <= self.exchanges <= MAX_EXCHANGES:
            raise ConfigError(f"gossip.exchanges must be in 1..{MAX_EXCHANGES}")


@dataclass(frozen=True)
class RoundOutcome:
    """What :meth:`GossipPeer.combine` made of an exchange of a round (key ids in sorted
    order); refusals happen in exchange 0 only."""

    round: int
    model: Vector
    accepted: tuple[str, ...]
    refused: dict[str, str]  # key id -> reason
    missing: tuple[str, ...]  # no model within the staleness bound
    exchange: int = 0


@dataclass(frozen=True)
class _Held:
    message: PeerModel
    sha256: str


class GossipPeer:
    """Peer ``me`` of ``federation_id`` gossiping with ``neighbours`` (key ids).

    Args:
        model: the starting model (every peer of a federation starts from the same one).
        samples: records this peer trains on: its weight in its neighbours' averages.
        journal: where what the peer sends, uses and refuses is chained.

    Raises:
        ConfigError: no neighbours, the peer among them, or a model with no values or
            more than :data:`~fedsec.peer.limits.MAX_MODEL_VALUES`.
    """

    def __init__(
        self,
        federation_id: str,
        me: str,
        neighbours: Collection[str],
        model: Vector,
        samples: int,
        journal: PeerJournal,
        settings: GossipSettings | None = None,
    ) -> None:
        if not neighbours or me in neighbours:
            raise ConfigError("a peer needs at least one neighbour other than itself")
        if not 0 < model.size <= MAX_MODEL_VALUES:
            raise ConfigError(f"a peer's model holds 1..{MAX_MODEL_VALUES} values")
        self.federation_id = federation_id
        self.me = me
        self.neighbours = frozenset(neighbours)
        self.samples = samples
        self.journal = journal
        self.settings = settings or GossipSettings()
        self.round = 0
        self.exchange = 0
        self.model = np.asarray(model, dtype=np.float64).copy()
        self._held: dict[str, _Held] = {}  # each neighbour's newest message
        self._trained: dict[str, _Held] = {}  # each neighbour's newest exchange 0
        self._own_update: Vector | None = None
        self._accepted: tuple[str, ...] = ()  # the round's exchange 0 accepted these
        self._newest_trained: PeerModel | None = None  # what a catch-up offer carries
        self._history: deque[VersionStep] = deque(maxlen=MAX_OFFER_HISTORY)
        self._ahead_seen: int | None = None  # newest round heard too far ahead to use
        self._offers_made: dict[str, tuple[int, int]] = {}  # requester -> (round, count)

    @property
    def values(self) -> int:
        return int(self.model.size)

    def own_model(self, trained: Vector) -> PeerModel:
        """Record this round's locally trained model and return the message carrying it
        (the round's exchange 0).

        Raises:
            BadVector: ``trained`` holds NaN or an infinity.
            ConfigError: ``trained`` is not the size of the peer's model.
            ProtocolError: the peer is in a later exchange of the round.
        """
        if self.exchange:
            raise ProtocolError(f"round {self.round} trains in exchange 0, not {self.exchange}")
        if trained.shape != self.model.shape:
            raise ConfigError(f"trained model has shape {trained.shape}, not {self.model.shape}")
        message = messages.make_model(
            self.federation_id, self.round, self.me, self.samples, self.model, trained - self.model
        )
        self._own_update = message.update_vector()
        self._newest_trained = message
        self._history.append(version_step(message))
        return message

    def offer(self) -> tuple[PeerModel, list[VersionStep]]:
        """The peer's newest trained message, as it sent it, and its version history
        (oldest first, ending at that message): what it offers a returning neighbour.

        Raises:
            NotFound: the peer has not trained a round yet.
        """
        if self._newest_trained is None:
            raise NotFound("this peer has not trained a round yet: nothing to offer")
        return self._newest_trained, list(self._history)

    def record_offer(self, to: str, nonce: str, message: PeerModel) -> None:
        """Journal that ``message`` (this peer's newest trained one) is offered to the
        neighbour ``to`` for its request ``nonce``, before the offer leaves: an auditor
        matches the requester's catch-up with it.

        Raises:
            RateLimited: ``to`` already had
                :data:`~fedsec.peer.limits.MAX_OFFERS_PER_ROUND` offers in this peer's
                round; nothing is journalled.
        """
        round_, count = self._offers_made.get(to, (self.round, 0))
        if round_ != self.round:
            count = 0
        if count >= MAX_OFFERS_PER_ROUND:
            raise RateLimited(
                f"{to} had {count} offers in round {self.round}, the most one round gives"
            )
        self._offers_made[to] = (self.round, count + 1)
        self.journal.append(
            PeerOfferSent(round=message.round, to=to, sha256=message.sha256, nonce=nonce)
        )

    def noticed_behind(self) -> bool:
        """Whether a neighbour sent a round too far ahead to use since the last call (the
        peer may have missed rounds); the note is cleared."""
        ahead, self._ahead_seen = self._ahead_seen, None
        return ahead is not None and ahead > self.round + MAX_AHEAD

    def mixing_model(self) -> PeerModel:
        """The message carrying the peer's mixed model in a later exchange of the round.

        Raises:
            ProtocolError: the peer is in exchange 0 (it sends its training then).
        """
        if not self.exchange:
            raise ProtocolError(f"round {self.round}: exchange 0 carries the training")
        return messages.make_mix(
            self.federation_id, self.round, self.exchange, self.me, self.samples, self.model
        )

    def catch_up(self, offers: Mapping[str, bytes], nonce: str = "") -> CatchUp:
        """Rejoin after missing rounds from the neighbours' newest trained rounds
        (key id that signed each -> its bytes; :mod:`fedsec.peer.catchup` says how),
        continuing at the round after the newest; ``nonce`` is the request the offers
        answered, which the journal records with them.

        Raises:
            see :func:`fedsec.peer.catchup.judge_offers`; the peer is unchanged then.
        """
        caught = judge_offers(
            self.federation_id,
            self.neighbours,
            self.values,
            self.settings.staleness,
            self.round,
            offers,
        )
        self.round, self.exchange, self.model = caught.round, 0, caught.model
        self._own_update, self._accepted, self._ahead_seen = None, (), None
        sources = sorted(caught.sources)
        self.journal.append(
            PeerCaughtUp(
                round=caught.round,
                sources=sources,
                sha256=[caught.sources[s] for s in sources],
                model_sha256=_model_sha256(caught.model),
                nonce=nonce,
            )
        )
        return caught

    def record_sent(self, to: str, message: PeerModel) -> None:
        self.journal.append(
            PeerSent(round=message.round, to=to, sha256=message.sha256, exchange=message.exchange)
        )

    def receive(self, sender: str, raw: bytes, path_federation: str, path_round: int) -> PeerModel:
        """Validate a neighbour's message completely, then keep it as its newest.

        Args:
            sender: the key id the request's signature verified under.
            raw: the message bytes.
            path_federation, path_round: what the signed request path names.

        Raises:
            PayloadTooLarge, PayloadError, BadVector: see :func:`fedsec.peer.messages.decode`.
            ProtocolError: the message and the path it came on name another federation
                or round.
            AuthError: the message names a sender other than the one that signed it.
            UnknownMember: the sender is not one of this peer's neighbours.
            ReplayError: a round and exchange the sender already sent (or an earlier one).
            StaleUpdate: a round further behind than the staleness bound, or ahead of
                the peer by more than :data:`~fedsec.peer.limits.MAX_AHEAD`.
            PayloadError: an exchange beyond the federation's ``exchanges``.
        """
        message = messages.decode(raw, self.values)
        if message.federation_id != path_federation or message.round != path_round:
            raise ProtocolError(
                f"the message names federation {message.federation_id!r} round "
                f"{message.round}, its path {path_federation!r} round {path_round}"
            )
        if message.federation_id != self.federation_id:
            raise ProtocolError(f"this peer is in federation {self.federation_id!r}")
        if message.sender != sender:
            raise AuthError(f"the message names sender {message.sender}, but {sender} signed it")
        if sender not in self.neighbours:
            raise UnknownMember(f"{sender} is not a neighbour of this peer")
        if message.exchange >= self.settings.exchanges:
            raise PayloadError(
                f"exchange {message.exchange}: this federation's rounds have "
                f"{self.settings.exchanges}"
            )
        self._check_round(sender, message.round, message.exchange)
        held = _Held(message, message.sha256)
        self._held[sender] = held
        if message.exchange == 0:
            self._trained[sender] = held
        self.journal.append(
            PeerReceived(
                round=message.round,
                sender=sender,
                sha256=held.sha256,
                samples=message.samples,
                exchange=message.exchange,
            )
        )
        return message

    def _check_round(self, sender: str, round_: int, exchange: int) -> None:
        held = self._held.get(sender)
        if held is not None and (round_, exchange) <= _position(held):
            raise ReplayError(
                f"{sender} already sent round {held.message.round} exchange "
                f"{held.message.exchange}; round {round_} exchange {exchange} is a replay"
            )
        if round_ < self.round - self.settings.staleness:
            raise StaleUpdate(
                f"round {round_} is more than {self.settings.staleness} rounds behind "
                f"this peer's round {self.round}"
            )
        if round_ > self.round + MAX_AHEAD:
            self._ahead_seen = max(round_, self._ahead_seen or 0)
            raise StaleUpdate(
                f"round {round_} is more than {MAX_AHEAD} ahead of this peer's round {self.round}"
            )

    def ready(self) -> bool:
        """Whether every neighbour this exchange waits for has sent it (or a later one):
        in exchange 0 every neighbour's training, later the first exchange's accepted."""
        if not self.exchange:
            return all(
                (h := self._trained.get(n)) is not None and h.message.round >= self.round
                for n in self.neighbours
            )
        now = (self.round, self.exchange)
        return all(
            (h := self._held.get(n)) is not None and _position(h) >= now for n in self._accepted
        )

    def combine(self) -> RoundOutcome:
        """Average the usable neighbours into the peer's model and move to the next
        exchange (after the round's last, to the next round's first).

        Raises:
            ProtocolError: the peer has not trained this round (:meth:`own_model`).
        """
        outcome = self._mix() if self.exchange else self._combine_trained()
        self.model = outcome.model
        self.exchange += 1
        if self.exchange == self.settings.exchanges:
            self.round, self.exchange = self.round + 1, 0
        return outcome

    def _combine_trained(self) -> RoundOutcome:
        own = self._own_update
        if own is None:
            raise ProtocolError(f"round {self.round}: combine before the local model")
        fresh, missing = self._fresh()
        refused = self._filter(own, fresh)
        accepted = sorted(n for n in fresh if n not in refused)
        pulls = {n: h.message.start_vector() - self.model for n, h in fresh.items()}
        radius = _clip_radius(list(pulls.values()))
        rows = np.stack(
            [own] + [_clip(pulls[n], radius) + fresh[n].message.update_vector() for n in accepted]
        )
        weights = np.array(
            [float(self.samples)] + [float(fresh[n].message.samples) for n in accepted]
        )
        model = self.model + robust.fedavg(rows, weights).update
        outcome = RoundOutcome(self.round, model, tuple(accepted), refused, tuple(missing))
        self._journal_outcome(outcome, fresh)
        self._own_update, self._accepted = None, tuple(accepted)
        return outcome

    def _mix(self) -> RoundOutcome:
        """One averaging step with the neighbours the round's exchange 0 accepted, each
        heard at this exchange or later (the others are missing)."""
        now = (self.round, self.exchange)
        heard = sorted(n for n in self._accepted if _position(self._held[n]) >= now)
        pulls = [self._held[n].message.start_vector() - self.model for n in heard]
        radius = _clip_radius(pulls)
        rows = np.stack([np.zeros_like(self.model)] + [_clip(p, radius) for p in pulls])
        weights = np.array(
            [float(self.samples)] + [float(self._held[n].message.samples) for n in heard]
        )
        model = self.model + robust.fedavg(rows, weights).update
        missing = tuple(n for n in self._accepted if n not in heard)
        outcome = RoundOutcome(self.round, model, tuple(heard), {}, missing, self.exchange)
        self._journal_outcome(outcome, {})
        return outcome

    def _fresh(self) -> tuple[dict[str, _Held], list[str]]:
        oldest = self.round - self.settings.staleness
        fresh = {n: h for n, h in self._trained.items() if h.message.round >= oldest}
        return fresh, sorted(self.neighbours - fresh.keys())

    def _filter(self, own: Vector, fresh: dict[str, _Held]) -> dict[str, str]:
        """Neighbours refused for an update longer than the own allows, or pointing away
        from the reference direction."""
        if not self.settings.robust or not fresh:
            return {}
        refused = self._too_long(own, fresh)
        names = sorted(n for n in fresh if n not in refused)
        if not names:
            return refused
        rows = np.stack([fresh[n].message.update_vector() for n in names])
        for k, name in enumerate(names):
            reference = own
            if self.settings.reference == "median":  # of all but the one judged
                others = np.vstack([own[None, :], np.delete(rows, k, axis=0)])
                reference = robust.median(others, np.ones(len(others))).update
            try:  # FLTrust's trust test of one update: it raises when that one is refused
                robust.fltrust(rows[k : k + 1], np.ones(1), reference, self.settings.min_cosine)
            except AggregationImpossible:
                refused[name] = (
                    f"its update's cosine {_cosine(rows[k], reference):.3f} to the "
                    f"{self.settings.reference} direction is not above "
                    f"{self.settings.min_cosine:g}"
                )
        return refused

    def _too_long(self, own: Vector, fresh: dict[str, _Held]) -> dict[str, str]:
        ratio = self.settings.max_norm_ratio
        if not ratio:
            return {}
        limit = ratio * _norm(own)
        norms = {n: _norm(h.message.update_vector()) for n, h in fresh.items()}
        return {
            n: f"its update norm {norm:.4g} is over {ratio:g} times this peer's own "
            f"{_norm(own):.4g}"
            for n, norm in sorted(norms.items())
            if norm > limit
        }

    def _journal_outcome(self, outcome: RoundOutcome, fresh: dict[str, _Held]) -> None:
        for sender, reason in sorted(outcome.refused.items()):
            self.journal.append(
                PeerRefused(
                    round=outcome.round, sender=sender, sha256=fresh[sender].sha256, reason=reason
                )
            )
        digest = _model_sha256(outcome.model)
        self.journal.append(
            PeerCombined(
                round=outcome.round,
                accepted=list(outcome.accepted),
                refused=sorted(outcome.refused),
                missing=list(outcome.missing),
                model_sha256=digest,
                exchange=outcome.exchange,
            )
        )


def _model_sha256(model: Vector) -> str:
    return hashlib.sha256(model.astype(messages.WIRE_DTYPE).tobytes()).hexdigest()


def _position(held: _Held) -> tuple[int, int]:
    return held.message.round, held.message.exchange


def _clip_radius(pulls: list[Vector]) -> float:
    """How far one neighbour may pull: a multiple of the median pull (limits.py)."""
    norms = [_norm(p) for p in pulls]
    return CONSENSUS_CLIP_OVER_MEDIAN * float(np.median(norms or [0.0]))


def _norm(v: Vector) -> float:
    return float(np.sqrt(np.einsum("i,i->", v, v)))


def _cosine(a: Vector, b: Vector) -> float:
    scale = _norm(a) * _norm(b)
    return float(np.einsum("i,i->", a, b)) / scale if scale > 0 else 0.0


def _clip(v: Vector, radius: float) -> Vector:
    """``v`` scaled down to length ``radius`` if it is longer."""
    norm = _norm(v)
    return v * (radius / norm) if norm > radius else v
