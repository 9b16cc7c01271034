"""Which features one round may combine: the summation mode, distributed DP, the update
codec's compression and error feedback, a robust aggregation rule and the round mode.

One table, :data:`RULES`, read twice: by the federation's configuration
(:mod:`fedsec.config`, at load time, naming the key to change) and by the signed round
spec (:func:`check_spec`, which :func:`fedsec.protocol.codec_choice.codec_for` runs, so
every member, the aggregator and the auditor refuse the same specs).  A federation that
loads therefore never opens a round its own spec refuses.

What a rule needs of a summation mode is one of its :class:`SummationTraits`, declared
here per mode (:data:`SUMMATION`): the protocol cannot import ``fedsec.summation``, whose
``MODES`` builds on this table, so a rule never names a mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fedsec.errors import ProtocolError
from fedsec.protocol.limits import MIN_SECURE_SUM

if TYPE_CHECKING:
    from fedsec.protocol.spec import RoundSpec


@dataclass(frozen=True, slots=True)
class SummationTraits:
    """What the protocol must know of a summation mode.

    Attributes:
        sees_updates: the aggregator reads each member's update (so a robust rule can
            judge and refuse them one by one).
        sums_in_ring: the sum is taken in the SecAgg+ ring, where distributed DP's
            discrete noise shares add up exactly.
        size_follows_bits: an upload's size follows the codec's bits per coordinate, so
            compression makes it smaller (a CKKS ciphertext's does not).
        min_contributors: fewest contributions one revealed sum may hold.
    """

    sees_updates: bool
    sums_in_ring: bool
    size_follows_bits: bool
    min_contributors: int


#: Each summation mode's traits (``round.secure_sum``, the spec's ``secure_sum``).
SUMMATION: Final[Mapping[str, SummationTraits]] = {
    "secagg": SummationTraits(
        sees_updates=False,
        sums_in_ring=True,
        size_follows_bits=True,
        min_contributors=MIN_SECURE_SUM,
    ),
    # a trusted aggregator reads every update, so a sum of one reveals nothing new
    "none": SummationTraits(
        sees_updates=True, sums_in_ring=False, size_follows_bits=True, min_contributors=1
    ),
    "he": SummationTraits(
        sees_updates=False,
        sums_in_ring=False,
        size_follows_bits=False,
        min_contributors=MIN_SECURE_SUM,
    ),
}


def traits(secure_sum: str) -> SummationTraits:
    """The traits of summation mode ``secure_sum``.

    Raises:
        ProtocolError: no such mode.
    """
    found = SUMMATION.get(secure_sum)
    if found is None:
        raise ProtocolError(f"unknown summation mode {secure_sum!r}")
    return found


@dataclass(frozen=True, slots=True)
class Features:
    """The features of a round that constrain one another, as the config or the spec
    sets them."""

    secure_sum: str
    round_mode: str  # "sync" or "buffered"
    distributed_dp: bool
    compressed: bool  # a codec stage beyond plain rounding (CodecSpec.compresses)
    error_feedback: bool
    # the setting that makes aggregation more than plain FedAvg ("aggregation.rule", or
    # "aggregation.max_norm_ratio" for plain FedAvg with a norm threshold); "" = none
    robust: str

    @classmethod
    def of_spec(cls, spec: RoundSpec) -> Features:
        """The features ``spec`` asks for."""
        return cls(
            secure_sum=spec.secure_sum,
            round_mode=spec.mode,
            distributed_dp=spec.dp.enabled and spec.dp.mode == "distributed",
            compressed=spec.codec.compresses,
            error_feedback=spec.codec.error_feedback,
            robust=robust_key(spec.aggregation.rule) if spec.aggregation is not None else "",
        )


def robust_key(rule: str) -> str:
    """The key that makes aggregation by ``rule`` more than plain FedAvg: the rule, or
    for plain FedAvg the threshold set beside it."""
    return "aggregation.rule" if rule != "fedavg" else "aggregation.max_norm_ratio"


@dataclass(frozen=True, slots=True)
class Rule:
    """One combination a round may not have.

    Attributes:
        key: the configuration key a user changes to resolve it (given the features).
        refuses: whether ``Features`` break the rule.
        reason: the sentence saying why, given the features (after the key).
    """

    key: Callable[[Features], str]
    refuses: Callable[[Features], bool]
    reason: Callable[[Features], str]


#: Every rule, in the order a refusal lists them.
RULES: Final[tuple[Rule, ...]] = (
    Rule(
        lambda f: "dp.mode",
        lambda f: f.distributed_dp and not traits(f.secure_sum).sums_in_ring,
        lambda f: (
            "distributed DP needs round.secure_sum = 'secagg' (the noise shares are "
            f"summed in its ring), not {f.secure_sum!r}"
        ),
    ),
    Rule(
        lambda f: "dp.mode",
        lambda f: f.distributed_dp and f.round_mode != "sync",
        lambda f: (
            "distributed DP needs round.mode = 'sync' (the noise is sized for the "
            f"cohort fixed with the spec), not {f.round_mode!r}"
        ),
    ),
    Rule(
        lambda f: "codec",
        lambda f: f.compressed and f.distributed_dp,
        lambda f: (
            "compression cannot be on with distributed DP, which rotates and "
            "discretises on its own terms (round.quant_bits sizes its ring)"
        ),
    ),
    Rule(
        lambda f: "codec",
        lambda f: f.compressed and not traits(f.secure_sum).size_follows_bits,
        lambda f: (
            f"compression cannot be on with round.secure_sum = {f.secure_sum!r}: a "
            "ciphertext's size does not depend on the bits; use 'secagg' or 'none'"
        ),
    ),
    Rule(
        lambda f: "codec.error_feedback",
        lambda f: f.error_feedback and f.distributed_dp,
        lambda f: (
            "cannot be on with distributed DP: a member would carry what the codec "
            "left out of its update into rounds its privacy accounting does not cover"
        ),
    ),
    Rule(
        lambda f: f.robust,
        lambda f: bool(f.robust) and not traits(f.secure_sum).sees_updates,
        lambda f: (
            f'needs round.secure_sum = "none": with {f.secure_sum} the aggregator sees '
            "only the sum of the updates, never one member's, so it cannot judge or refuse them "
            "one by one"
        ),
    ),
)


@dataclass(frozen=True, slots=True)
class Conflict:
    """A broken rule: the key to change and why."""

    key: str
    reason: str


def conflicts(features: Features) -> list[Conflict]:
    """Every rule ``features`` break, in :data:`RULES` order (empty: compatible).

    Raises:
        ProtocolError: an unknown summation mode.
    """
    return [Conflict(r.key(features), r.reason(features)) for r in RULES if r.refuses(features)]


def check_spec(spec: RoundSpec) -> None:
    """Refuse a spec whose features do not go together.

    Raises:
        ProtocolError: the first broken rule, named by its key and reason.
    """
    found = conflicts(Features.of_spec(spec))
    if found:
        raise ProtocolError(f"round {spec.round}: {found[0].key}: {found[0].reason}")
