"""A peer's privacy budget: the member's own ledger (:mod:`fedsec.agent.ledger`), charged
as the agent charges it.

A peer is one more topology of the same member, not a second agent: each round's local
training is charged to the member's :class:`~fedsec.agent.ledger.PrivacyLedger` (the same
file and format, so a member whose ``state_dir`` is its agent's shares one budget between
its federations and its gossip) for the cost the agent would charge for the same settings
(:func:`plan_peer_charge`: :func:`fedsec.learning.training.plan_round` and the DP noise,
as :func:`fedsec.agent.charging.plan_charge` plans a round of local DP).

The order is the agent's, and durable at each step:

1. :meth:`PeerCharging.charge` before training: the ledger checks the budget and records
   the charge in one locked step, or refuses (:class:`~fedsec.errors.BudgetExhausted`,
   with the numbers) and the peer neither trains nor sends: its state and journal stay
   as they were.
2. :meth:`PeerCharging.release` after training, before the update can leave (sent to a
   neighbour, or offered to a returning one): the charge is marked released to the round.
3. A restarted peer asks the ledger for its newest charge (each names the peer as its
   ``holder``); one never released, for the same cost and a round no later than the one
   it trains, paid for an update that never left, and pays for this one instead.  A
   released charge is never reused: that update may have left, and another training
   is another release.

Mixing exchanges and catch-up offers carry what training already released (or models
averaged from it): post-processing, charged nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fedsec.agent.charges import ChargeRequest, PrivacyCharge
from fedsec.agent.ledger import PrivacyLedger
from fedsec.errors import BudgetExhausted, ConfigError
from fedsec.learning.training import DPParams, TrainingParams, plan_round

log = logging.getLogger("fedsec.peer")

#: The attempt a peer's release names: gossip rounds have no attempts.
PEER_ATTEMPT = 0


def holder_of(federation_id: str) -> str:
    """How a peer's charges name it in the member's ledger (one peer per federation)."""
    return f"peer:{federation_id}"


def plan_peer_charge(
    round_: int, samples: int, params: TrainingParams, dp: DPParams | None
) -> ChargeRequest:
    """What training ``round_`` on ``samples`` records costs: the agent's plan for a round
    of local DP-SGD with the same settings (nothing, without DP).

    Raises:
        ConfigError: ``samples < 1``.
    """
    sample_rate, steps = plan_round(samples, params)
    noise = dp.noise_multiplier if dp is not None else 0.0
    return ChargeRequest(("peer", round_), round_, noise, sample_rate, steps, dp is not None)


@dataclass
class PeerCharging:
    """The member's ledger, charged for one peer's rounds of ``dataset_id``.

    Args:
        require_dp: refuse to train without DP (the agent's ``privacy.require_dp``).
    """

    ledger: PrivacyLedger
    dataset_id: str
    holder: str
    samples: int
    params: TrainingParams
    dp: DPParams | None
    require_dp: bool = True

    def __post_init__(self) -> None:
        if self.dp is None and self.require_dp:
            raise ConfigError(
                "training.noise_multiplier is 0, so the peer would train without "
                "differential privacy, and privacy.require_dp is true: set a noise "
                "multiplier, or require_dp = false for a simulation on public data"
            )

    def charge(self, round_: int) -> PrivacyCharge:
        """Pay for training ``round_``, before it starts: an unreleased charge this peer
        made before a restart, or a new one.

        Raises:
            BudgetExhausted: the round would exceed the budget; nothing is charged.
            ConfigError: the dataset has no budget.
        """
        request = plan_peer_charge(round_, self.samples, self.params, self.dp)
        if not request.dp_enabled:
            log.warning("event=training_without_dp round=%d dataset=%s", round_, self.dataset_id)
            return PrivacyCharge(request.key, self.ledger.spent(self.dataset_id), *_plan(request))
        held = self.ledger.last_held(self.dataset_id, self.holder)
        if held is not None:
            index, kept = held
            cost = (kept.noise_multiplier, kept.sample_rate, kept.steps)
            if kept.released_to is None and cost == request.cost and kept.round <= round_:
                log.info(
                    "event=privacy_charge_reused round=%d dataset=%s index=%d charged_round=%d",
                    round_,
                    self.dataset_id,
                    index,
                    kept.round,
                )
                spent = self.ledger.spent(self.dataset_id)
                return PrivacyCharge(request.key, spent, *_plan(request), index=index)
        try:
            charged = self.ledger.charge(self.dataset_id, round_, *request.cost, holder=self.holder)
        except BudgetExhausted as exc:
            log.error("event=privacy_budget_exhausted dataset=%s reason=%r", self.dataset_id, exc)
            raise
        log.info(
            "event=privacy_charged round=%d dataset=%s steps=%d sample_rate=%.4f noise=%g "
            "epsilon=%.3f",
            round_,
            self.dataset_id,
            request.steps,
            request.sample_rate,
            request.noise_multiplier,
            charged.epsilon,
        )
        return PrivacyCharge(request.key, charged.epsilon, *_plan(request), index=charged.index)

    def release(self, charge: PrivacyCharge, round_: int) -> None:
        """Mark ``charge`` released to ``round_``, durably, before its update leaves.

        Raises:
            IntegrityError: the charge was released before (its update may have left);
                the ledger is unchanged.
        """
        if charge.index >= 0:
            self.ledger.record_release(self.dataset_id, charge.index, round_, PEER_ATTEMPT)


def _plan(request: ChargeRequest) -> tuple[int, float, int]:
    return request.steps, request.sample_rate, request.round
