"""What the privacy ledger is asked to pay for one training, what it charged, and the
update trained on that charge: plain records the round machines, their actions and the
runtime pass around (the decisions about them are :mod:`fedsec.agent.charging`'s)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedsec.protocol.wire import ChargeRecord

#: noise multiplier, sample rate, steps: what the ledger accounts for one training
Cost = tuple[float, float, int]


@dataclass(frozen=True)
class ChargeRequest:
    """A training the ledger is asked to pay for, before it starts."""

    key: tuple[object, ...]
    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    dp_enabled: bool  # False only with privacy.require_dp = false: nothing is charged

    @property
    def cost(self) -> Cost:
        return (self.noise_multiplier, self.sample_rate, self.steps)


@dataclass(frozen=True)
class PrivacyCharge:
    """What one training cost, charged to the privacy ledger before it starts."""

    key: tuple[object, ...]
    epsilon: float  # total spent on the dataset once this round was charged
    steps: int
    sample_rate: float
    trained_round: int
    index: int = -1  # its place in the dataset's charge history; -1: nothing was charged
    unreported: tuple[ChargeRecord, ...] = ()  # earlier charges its report must declare


@dataclass(frozen=True, eq=False)
class TrainedUpdate:
    """An update trained for one round, reusable by a retried attempt of that round."""

    key: tuple[object, ...]
    delta: npt.NDArray[np.float32]
    epsilon: float  # total spent on the dataset once this round was charged
    steps: int
    sample_rate: float
    base_version: int = 0  # the model version it was trained from
    trained_round: int = -1  # the round the ledger charged for this training
    index: int = -1  # see PrivacyCharge
    unreported: tuple[ChargeRecord, ...] = ()
