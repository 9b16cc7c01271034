"""What one training costs in privacy, and when a retried attempt costs nothing.

The ledger is charged *before* training, so a crash can never spend privacy off the
books.  A retried attempt of the same round reuses the update already trained on the
same model with the same settings; a charge whose training produced no update yet (the
model download refused, the attempt dropped) is reused rather than charged again.

Except after a release: once an update went into a SecAgg+ attempt's sum (its masked
input sent), a later attempt never gets it again; it is trained anew on a fresh charge.
Otherwise an aggregator could take attempt 0 to its unmask, abort it, sum the same
updates again without one member and subtract the two sums: that member's update comes
out.  A fresh training draws fresh DP noise for every member, so the difference of the
sums is the member's update plus more noise than the member's own; and each sum a
member's update entered is one charge in the ledger.  Released charges are durable in
the ledger (:meth:`fedsec.agent.ledger.PrivacyLedger.record_release`), which also
refuses a second release of one charge, so a restarted agent refuses too.  The mark is
set before the masked input leaves, not when the member answers unmask: once the
aggregator holds the masked input, the member's neighbours can reveal its self-mask
shares without the member answering anything.

:class:`Carryover` holds what crosses attempts; :func:`charge_step` is the decision,
for both round machines, written as a step that yields the Charge action when the
ledger must be asked.  The records it decides on (:class:`ChargeRequest`,
:class:`PrivacyCharge`, :class:`TrainedUpdate`) are :mod:`fedsec.agent.charges`'s,
re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from fedsec.agent.actions import Charge, Charged, Step, ask
from fedsec.agent.charges import ChargeRequest as ChargeRequest
from fedsec.agent.charges import Cost as Cost
from fedsec.agent.charges import PrivacyCharge as PrivacyCharge
from fedsec.agent.charges import TrainedUpdate as TrainedUpdate
from fedsec.agent.member import Member
from fedsec.agent.spec import training_params, update_key
from fedsec.errors import ConfigError
from fedsec.learning.training import plan_round
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.wire import RoundSpec
from fedsec.tasks import Task

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")


class Carryover:
    """What one attempt leaves to the next: the last update (until it is sent in
    buffered mode, refused as stale, or released to a SecAgg+ sum), a charge not yet
    trained on, the last cost, and the attempts already joined and handled (round,
    attempt).

    Args:
        released: the ledger's released charges (index -> round, attempt), so that a
            restarted agent never reuses their updates either.
    """

    def __init__(self, released: Mapping[int, tuple[int, int]] | None = None) -> None:
        self.update: TrainedUpdate | None = None
        self.unused_charge: PrivacyCharge | None = None
        self.last_cost: Cost | None = None
        self.joined: set[tuple[int, int]] = set()
        self.handled: set[tuple[int, int]] = set()
        # error feedback: what the codec left out of the last update the aggregator took
        self.residual: npt.NDArray[np.float32] | None = None
        # charge index -> (round, attempt) its update was released to (the ledger's
        # record, read at start), and the last release of this run (charged or not)
        self.released: dict[int, tuple[int, int]] = dict(released or {})
        self.last_release: tuple[int, int] | None = None

    def release(self, update: TrainedUpdate, round_: int, attempt: int) -> None:
        """``update`` goes into the sum of ``round_``'s ``attempt`` (its release is
        durable in the ledger already): no later attempt gets it."""
        if update.index >= 0:
            self.released[update.index] = (round_, attempt)
        self.last_release = (round_, attempt)
        if self.update is update:
            self.update = None

    def reusable(self, spec: RoundSpec, member: str) -> TrainedUpdate | PrivacyCharge | None:
        """The update or charge a retried attempt (or a buffered member) reuses; never
        one released to another attempt's sum (the member's log says so)."""
        self._drop_released(spec)
        key = update_key(spec)
        if self.update is not None and self.update.key == key:
            log.info("round_update_reused round=%d attempt=%d", spec.round, spec.attempt)
            return self.update
        if spec.mode == "buffered" and spec.cohort and self.update is not None:
            # buffered: the update was trained before joining, on the version we named
            base = spec.model_version - spec.staleness.get(member, 0)
            if self.update.base_version == base:
                return self.update
        if self.unused_charge is not None and self.unused_charge.key == key:
            log.info("privacy_charge_reused round=%d attempt=%d", spec.round, spec.attempt)
            return self.unused_charge
        last = self.last_release
        if last is not None and last[0] == spec.round and last[1] != spec.attempt:
            _not_reused(spec, last)
        return None

    def _drop_released(self, spec: RoundSpec) -> None:
        """Forget a kept update or charge the ledger records as released (a restarted
        agent's, or one kept by mistake): this attempt trains anew."""
        for kept in (self.update, self.unused_charge):
            if kept is None or kept.index < 0 or kept.index not in self.released:
                continue
            released = self.released[kept.index]
            _not_reused(spec, released)
            if kept is self.update:
                self.update = None
            else:
                self.unused_charge = None

    def trained(
        self, spec: RoundSpec, charge: PrivacyCharge, delta: npt.NDArray[np.float32]
    ) -> TrainedUpdate:
        """Keep the update trained on ``charge``; the charge is spent on it."""
        self.unused_charge = None
        self.update = TrainedUpdate(
            charge.key,
            delta,
            charge.epsilon,
            charge.steps,
            charge.sample_rate,
            base_version=spec.model_version,
            trained_round=charge.trained_round,
            index=charge.index,
            unreported=charge.unreported,
        )
        return self.update


def _not_reused(spec: RoundSpec, released: tuple[int, int]) -> None:
    log.warning(
        "round_update_not_reused round=%d attempt=%d released_round=%d released_attempt=%d "
        "reason=%r",
        spec.round,
        spec.attempt,
        *released,
        "the update went into that attempt's sum; training anew on a fresh charge",
    )


def plan_charge(
    spec: RoundSpec,
    task: Task,
    samples: int,
    require_dp: bool,
    allow_distributed: bool = False,
    min_survivors: int = 1,
) -> ChargeRequest:
    """What training on ``spec`` will cost.

    Raises:
        ConfigError: the round trains without DP and this agent requires it, asks for
            distributed DP and this agent does not allow it (or with noise sized for
            fewer than ``min_survivors`` members), or asks for an unknown optimiser.
        ProtocolError / QuantizationError: a distributed-DP spec that contradicts itself
            or whose bit budget cannot be met (:func:`fedsec.protocol.ddp.ddp_spec`).
    """
    params = training_params(spec, task)
    if not spec.dp.enabled and require_dp:
        raise ConfigError(
            f"round {spec.round} asks for training without differential privacy; this "
            "agent trains only with DP-SGD, so it refuses (ask the operator to set "
            "dp.enabled = true)"
        )
    if is_distributed(spec):
        check_distributed(spec, allow_distributed, min_survivors)
        # one DP-SGD step per round over the union (record), or one release of the
        # member's clipped update with no sampling the member could check (member)
        rate = spec.dp.sample_rate if spec.dp.unit == "record" else 1.0
        return ChargeRequest(update_key(spec), spec.round, spec.dp.noise_multiplier, rate, 1, True)
    sample_rate, steps = plan_round(samples, params)
    return ChargeRequest(
        update_key(spec), spec.round, spec.dp.noise_multiplier, sample_rate, steps, spec.dp.enabled
    )


def check_distributed(spec: RoundSpec, allowed: bool, min_survivors: int = 1) -> None:
    """Refuse a distributed-DP round unless this member's agent.toml allows it, and
    unless its noise is sized for at least ``min_survivors`` members
    (``privacy.min_survivors``).

    Each member adds 1/``dp.min_survivors`` of the noise's variance: a member who
    colludes with the aggregator and knows its own share removes that much of it from
    the sum, so a small ``dp.min_survivors`` lets few colluders take most of the noise
    away (with m = 2, one colluder removes half).

    Raises:
        ConfigError: not allowed, or noise sized for too few survivors.
        ProtocolError / QuantizationError: see :func:`fedsec.protocol.ddp.ddp_spec`.
    """
    if not allowed:
        raise ConfigError(
            f"round {spec.round} asks for distributed DP, where this member would add only "
            f"a share of the noise and its privacy would rest on at least "
            f"{spec.dp.min_survivors} other members adding theirs; this agent's agent.toml "
            "does not allow that (privacy.allow_distributed = false), so it refuses"
        )
    if spec.dp.min_survivors < min_survivors:
        raise ConfigError(
            f"round {spec.round} asks for distributed DP with the noise sized for "
            f"{spec.dp.min_survivors} survivors, fewer than the {min_survivors} this "
            f"agent's agent.toml accepts (privacy.min_survivors = {min_survivors}): each "
            f"member would add 1/{spec.dp.min_survivors} of the noise, so each member "
            "colluding with the aggregator could remove that much of it; it refuses"
        )
    codec_for(spec)  # a bit budget the ring cannot meet is refused here, with the reason


def charge_step(
    spec: RoundSpec, carry: Carryover, member: Member
) -> Step[TrainedUpdate | PrivacyCharge]:
    """The update or charge to train on for ``spec``: reused when a retried attempt
    allows it, else charged to the ledger (the Charge action) before training.

    Raises:
        ConfigError: see :func:`plan_charge`.
        BudgetExhausted: the ledger refused the charge.
    """
    training_params(spec, member.task)  # an unknown optimiser is refused before any reuse
    reused = carry.reusable(spec, member.id)
    if reused is not None:
        return reused
    request = plan_charge(
        spec,
        member.task,
        member.samples,
        member.require_dp,
        member.allow_distributed,
        member.min_survivors,
    )
    carry.last_cost = request.cost
    answer = yield from ask(Charge(request), Charged)
    carry.unused_charge = answer.charge
    return answer.charge
