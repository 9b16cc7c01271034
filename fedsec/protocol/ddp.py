"""Distributed DP in a round: what a signed round spec prescribes, derived identically by
every member and the aggregator.

A spec with ``dp.mode = "distributed"`` asks each member for one DP-SGD step's share:
Poisson sampling at ``dp.sample_rate``, per-record clipping at ``dp.max_grad_norm``,
the member's sum clipped to ``clip_norm``, discretised with
:func:`fedsec.crypto.discretize.encode` and a noise share sized for ``dp.min_survivors``
survivors out of the cohort.  :func:`ddp_spec` turns the spec into that
:class:`~fedsec.crypto.discretize.DdpSpec`, refusing with a sentence a spec whose bit
budget the ring cannot meet; :func:`rotation_seed` is the shared rotation, fresh for
every attempt because the spec's seed is.

The guarantee's assumption (:func:`assumption`): the ε a member reports holds against
anyone who sees only the SecAgg+ sum (the aggregator included) as long as at least
``dp.min_survivors`` members add their noise share honestly; a coalition that also
knows some members' noise shares can subtract them.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from fedsec.crypto.discretize import DdpSpec
from fedsec.errors import ProtocolError, QuantizationError
from fedsec.protocol.compat import check_spec

if TYPE_CHECKING:
    from fedsec.protocol.spec import RoundSpec

_ROTATION_DOMAIN = b"fedsec/v1/ddp/rotation"

#: A member's floor on ``dp.min_survivors`` (agent.toml ``privacy.min_survivors``).
#: Each member adds 1/min_survivors of the noise's variance, so a member colluding with
#: the aggregator, who knows its own share, removes that much.  2: the smallest sum that
#: is a sum, and every distributed spec fedsec itself derives for a cohort of two or
#: more (``dp.min_survivors_fraction`` x cohort, rounded up) passes it; a member that
#: wants one colluder to remove at most 10 % of the variance sets 10.
DEFAULT_MIN_SURVIVORS = 2


def is_distributed(spec: RoundSpec) -> bool:
    """Whether ``spec`` asks for distributed DP."""
    return spec.dp.enabled and spec.dp.mode == "distributed"


def rotation_seed(spec: RoundSpec) -> bytes:
    """The round's shared rotation seed: SHA-256 of a domain and the spec's signed,
    per-attempt seed (no member chooses it after seeing the data)."""
    return hashlib.sha256(_ROTATION_DOMAIN + bytes.fromhex(spec.seed)).digest()


def ddp_spec(spec: RoundSpec) -> DdpSpec:
    """The discretisation ``spec`` prescribes.

    Raises:
        ProtocolError: not a distributed-DP spec, features it does not go with
            (:func:`fedsec.protocol.compat.check_spec`: a summation mode other than
            SecAgg+, whose ring sums the noise shares), or fields that contradict it (no
            sampling rate, a survivor count outside the cohort).
        QuantizationError: a bit budget the ring cannot meet; the message says why.
    """
    dp = spec.dp
    where = f"round {spec.round} asks for distributed DP"
    if not is_distributed(spec):
        raise ProtocolError(f"round {spec.round} does not ask for distributed DP")
    check_spec(spec)  # a summation mode whose sum is the SecAgg+ ring, the round sync, ...
    record = dp.unit == "record"
    if record and not 0.0 < dp.sample_rate <= 1.0:
        raise ProtocolError(f"{where} without a sampling rate in (0, 1]: {dp.sample_rate}")
    cohort = len(spec.cohort)
    if not 1 <= dp.min_survivors <= cohort:
        raise ProtocolError(
            f"{where} with noise sized for {dp.min_survivors} survivors of a cohort of "
            f"{cohort}; it must be 1..{cohort}"
        )
    try:
        return DdpSpec(
            dim=spec.dim,
            ring_bits=spec.ring_bits,
            clip=spec.clip_norm,
            sensitivity=dp.max_grad_norm if record else spec.clip_norm,
            noise_multiplier=dp.noise_multiplier,
            min_survivors=dp.min_survivors,
            max_members=cohort,
        )
    except QuantizationError as exc:
        raise QuantizationError(f"{where}, but its bit budget cannot be met: {exc}") from exc


def realised_noise_multiplier(spec: RoundSpec | None, survivors: int) -> float:
    """The noise multiplier the sum of ``survivors`` members' shares carries (relative
    to the sensitivity; ≥ the spec's z once survivors ≥ min_survivors); 0 for a round
    without distributed DP.

    Raises:
        ProtocolError / QuantizationError: see :func:`ddp_spec`.
    """
    if spec is None or not is_distributed(spec) or survivors < 1:
        return 0.0
    return ddp_spec(spec).effective_noise_multiplier(survivors)


def member_weight(spec: RoundSpec, samples: int) -> float:
    """A member's weight coordinate in a distributed round: its expected batch q·n at
    record level (the sum of weights is then the union's expected batch, the DP-SGD
    step's denominator), 1 at member level (the mean over contributors).  Public: it
    depends on the declared sample count, never on which records were sampled."""
    return spec.dp.sample_rate * samples if spec.dp.unit == "record" else 1.0


def assumption(spec: RoundSpec) -> str:
    """The trust assumption a member's ε rests on in this round, in one sentence."""
    if not is_distributed(spec):
        return "local DP: holds against everyone; each member adds all of its noise itself"
    return (
        f"distributed DP: holds against anyone who sees only the SecAgg+ sum, the "
        f"aggregator included, if at least {spec.dp.min_survivors} of the "
        f"{len(spec.cohort)} members add their noise share honestly"
    )
