"""One peer's side of gossip averaging, as a sans-I/O state machine.

A round ``r`` of peer i: it starts from its model x_i, trains locally to x_i + Δ_i and
sends (x_i, Δ_i) to its neighbours (:meth:`GossipPeer.own_model`); meanwhile it keeps the
newest round each neighbour sent (:meth:`GossipPeer.receive`, which validates a message
completely before it keeps anything, so a refused one leaves the peer as it was); when
every neighbour's round is in, or the round's timeout has passed, it combines
(:meth:`GossipPeer.combine`):

- neighbours whose newest round is more than ``staleness`` rounds old are skipped;
- with filtering on, a neighbour whose update Δ_j has cosine below ``min_cosine`` to the
  reference is refused, the reason in the journal: FLTrust's trust test
  (:func:`fedsec.learning.robust.fltrust`).  The reference is the coordinate-wise median
  of Δ_i and the neighbours' updates (:func:`fedsec.learning.robust.median`), the
  direction the peer and its honest neighbours agree on while they are the majority, or
  Δ_i alone (``reference = "own"``), which refuses honest neighbours whenever the peer's
  own noisy update happens to point elsewhere;
- each accepted neighbour contributes its round's end relative to x_i, its start's pull
  x_j − x_i clipped to :data:`~fedsec.peer.limits.CONSENSUS_CLIP_OVER_MEDIAN` times the
  median pull of the round's neighbours (so a start far from the neighbourhood, honest
  or forged, moves x_i no further than a typical one) plus Δ_j;
- the new model is x_i plus the mean of Δ_i and those contributions weighted by the
  records each was trained on (:func:`fedsec.learning.robust.fedavg`).

The update is judged on its own, not as the neighbour's end minus x_i: models drift
apart between peers, and that difference is mostly the drift (measured: 69 % of honest
neighbours refused, 62 % accuracy against 93 % for FedAvg, ``fedsec bench gossip``).

Refusals of the messages themselves (wrong federation, replayed or stale round, a sender
that is not a neighbour, a malformed vector) are raised, never journalled: a sender can
send any number of them, and the journal keeps what the peer used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsec.errors import (
    AggregationImpossible,
    AuthError,
    ConfigError,
    ProtocolError,
    ReplayError,
    StaleUpdate,
    UnknownMember,
)
from fedsec.learning import robust
from fedsec.peer import messages
from fedsec.peer.journal import PeerCombined, PeerJournal, PeerReceived, PeerRefused, PeerSent
from fedsec.peer.limits import (
    CONSENSUS_CLIP_OVER_MEDIAN,
    DEFAULT_MIN_COSINE,
    DEFAULT_STALENESS,
    MAX_AHEAD,
    MAX_MODEL_VALUES,
)
from fedsec.peer.messages import PeerModel, Vector
from fedsec.protocol.limits import MAX_ID


@dataclass(frozen=True)
class GossipSettings:
    """How a peer combines: ``robust`` filters by agreement with its own direction."""

    robust: bool = True
    min_cosine: float = DEFAULT_MIN_COSINE
    staleness: int = DEFAULT_STALENESS
    #: what a neighbour's update is judged against: "median", the coordinate-wise median
    #: of the peer's own update and the round's neighbours' (the neighbourhood's direction,
    #: which an honest majority decides); "own", the peer's own update alone
    reference: Literal["median", "own"] = "median"

    def __post_init__(self) -> None:
        robust.check_parameter("min_trust_score", self.min_cosine)
        if not 0 <= self.staleness <= MAX_ID:
            raise ConfigError(f"peer.staleness must be in 0..{MAX_ID}, got {self.staleness}")


@dataclass(frozen=True)
class RoundOutcome:
    """What :meth:`GossipPeer.combine` made of a round (key ids in sorted order)."""

    round: int
    model: Vector
    accepted: tuple[str, ...]
    refused: dict[str, str]  # key id -> reason
    missing: tuple[str, ...]  # no model within the staleness bound


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
        self.model = np.asarray(model, dtype=np.float64).copy()
        self._held: dict[str, _Held] = {}
        self._own_update: Vector | None = None

    @property
    def values(self) -> int:
        return int(self.model.size)

    def own_model(self, trained: Vector) -> PeerModel:
        """Record this round's locally trained model and return the message carrying it.

        Raises:
            BadVector: ``trained`` holds NaN or an infinity.
            ConfigError: ``trained`` is not the size of the peer's model.
        """
        if trained.shape != self.model.shape:
            raise ConfigError(f"trained model has shape {trained.shape}, not {self.model.shape}")
        message = messages.make_model(
            self.federation_id, self.round, self.me, self.samples, self.model, trained - self.model
        )
        self._own_update = message.update_vector()
        return message

    def record_sent(self, to: str, message: PeerModel) -> None:
        self.journal.append(PeerSent(round=message.round, to=to, sha256=message.sha256))

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
            ReplayError: a round the sender already sent (or an earlier one).
            StaleUpdate: a round further behind than the staleness bound, or ahead of
                the peer by more than :data:`~fedsec.peer.limits.MAX_AHEAD`.
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
        self._check_round(sender, message.round)
        digest = message.sha256
        self._held[sender] = _Held(message, digest)
        self.journal.append(
            PeerReceived(round=message.round, sender=sender, sha256=digest, samples=message.samples)
        )
        return message

    def _check_round(self, sender: str, round_: int) -> None:
        held = self._held.get(sender)
        if held is not None and round_ <= held.message.round:
            raise ReplayError(
                f"{sender} already sent round {held.message.round}; round {round_} is a replay"
            )
        if round_ < self.round - self.settings.staleness:
            raise StaleUpdate(
                f"round {round_} is more than {self.settings.staleness} rounds behind "
                f"this peer's round {self.round}"
            )
        if round_ > self.round + MAX_AHEAD:
            raise StaleUpdate(
                f"round {round_} is more than {MAX_AHEAD} ahead of this peer's round {self.round}"
            )

    def ready(self) -> bool:
        """Whether every neighbour's model of the current round (or a later one) is in."""
        return all(
            (h := self._held.get(n)) is not None and h.message.round >= self.round
            for n in self.neighbours
        )

    def combine(self) -> RoundOutcome:
        """Average the round's usable neighbours into the peer's model and move to the
        next round.

        Raises:
            ProtocolError: the peer has not trained this round (:meth:`own_model`).
        """
        own = self._own_update
        if own is None:
            raise ProtocolError(f"round {self.round}: combine before the local model")
        fresh, missing = self._fresh()
        refused = self._filter(own, fresh)
        accepted = sorted(n for n in fresh if n not in refused)
        pulls = {n: h.message.start_vector() - self.model for n, h in fresh.items()}
        radius = CONSENSUS_CLIP_OVER_MEDIAN * float(
            np.median([np.sqrt(np.einsum("i,i->", p, p)) for p in pulls.values()] or [0.0])
        )
        rows = np.stack(
            [own] + [_clip(pulls[n], radius) + fresh[n].message.update_vector() for n in accepted]
        )
        weights = np.array(
            [float(self.samples)] + [float(fresh[n].message.samples) for n in accepted]
        )
        model = self.model + robust.fedavg(rows, weights).update
        outcome = RoundOutcome(self.round, model, tuple(accepted), refused, tuple(missing))
        self._journal_outcome(outcome, fresh)
        self.model, self._own_update = model, None
        self.round += 1
        return outcome

    def _fresh(self) -> tuple[dict[str, _Held], list[str]]:
        oldest = self.round - self.settings.staleness
        fresh = {n: h for n, h in self._held.items() if h.message.round >= oldest}
        return fresh, sorted(self.neighbours - fresh.keys())

    def _filter(self, own: Vector, fresh: dict[str, _Held]) -> dict[str, str]:
        """Neighbours refused for pointing away from the peer's own update."""
        if not self.settings.robust or not fresh:
            return {}
        names = sorted(fresh)
        rows = np.stack([fresh[n].message.update_vector() for n in names])
        weights = np.ones(len(names))
        reference = own
        if self.settings.reference == "median":
            everyone = np.vstack([own[None, :], rows])
            reference = robust.median(everyone, np.ones(len(everyone))).update
        try:
            judged = robust.fltrust(rows, weights, reference, self.settings.min_cosine)
        except AggregationImpossible as exc:  # every one refused, or no own direction
            return dict.fromkeys(names, str(exc))
        return {n: o.reason for n, o in zip(names, judged.outcomes, strict=True) if not o.accepted}

    def _journal_outcome(self, outcome: RoundOutcome, fresh: dict[str, _Held]) -> None:
        for sender, reason in sorted(outcome.refused.items()):
            self.journal.append(
                PeerRefused(
                    round=outcome.round, sender=sender, sha256=fresh[sender].sha256, reason=reason
                )
            )
        digest = hashlib.sha256(outcome.model.astype(messages.WIRE_DTYPE).tobytes()).hexdigest()
        self.journal.append(
            PeerCombined(
                round=outcome.round,
                accepted=list(outcome.accepted),
                refused=sorted(outcome.refused),
                missing=list(outcome.missing),
                model_sha256=digest,
            )
        )


def _clip(v: Vector, radius: float) -> Vector:
    """``v`` scaled down to length ``radius`` if it is longer."""
    norm = float(np.sqrt(np.einsum("i,i->", v, v)))
    return v * (radius / norm) if norm > radius else v
