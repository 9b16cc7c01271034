"""The robust rules' parameters (the ``[aggregation]`` keys but ``rule``): each one's valid
range and why, which rules read it, and the fewest updates a rule needs.  Declared once:
``fedsec.config`` validates the federation's file against them and
:mod:`fedsec.learning.robust` reads them when it aggregates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Protocol

from fedsec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ParameterRange:
    """Where one parameter is valid, and why there.

    ``off`` is a value outside the range that switches the parameter's check off.
    """

    low: float
    high: float | None  # None: no upper bound
    why: str
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    off: float | None = None

    def admits(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        if not math.isfinite(value) or (self.integer and value != int(value)):
            return False
        if value < self.low or (self.low_open and value == self.low):
            return False
        if self.high is None:
            return True
        return value < self.high if self.high_open else value <= self.high

    def describe(self) -> str:
        if self.integer:
            top = "" if self.high is None else f"..{self.high:g}"
            span = f"an integer in {self.low:g}{top}" if top else f"an integer >= {self.low:g}"
        elif self.high is None:
            span = f"a number {'>' if self.low_open else '>='} {self.low:g}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            span = f"a number in {left}{self.low:g}, {self.high:g}{right}"
        return span if self.off is None else f"{self.off:g} (off) or {span}"


#: Every parameter of the rules (the ``[aggregation]`` keys but ``rule``), declared once:
#: ``fedsec.config`` validates the federation's file against these.
PARAMETERS: Final[dict[str, ParameterRange]] = {
    "trim_fraction": ParameterRange(
        0.0,
        0.5,
        "β is the share cut at each end of every coordinate; at 1/2 nothing would remain",
        high_open=True,
    ),
    "byzantine": ParameterRange(
        0.0,
        1000.0,
        "f members assumed Byzantine; Krum's guarantee needs n > 2f + 2 updates",
        integer=True,
    ),
    "krum_selected": ParameterRange(
        0.0,
        100_000.0,
        "m updates averaged; 0 means n - f, Multi-Krum's usual choice (more than n - f would "
        "take in updates Krum counts as possibly Byzantine)",
        integer=True,
    ),
    "clip_radius": ParameterRange(
        0.0,
        None,
        "τ is how far one update may pull the centre per iteration; 0 would move nothing",
        low_open=True,
    ),
    "clip_iterations": ParameterRange(
        1.0,
        100.0,
        "passes over all updates; Karimireddy et al. find 1 to 3 enough, each costs one "
        "pass over n x d values",
        integer=True,
    ),
    "root_records": ParameterRange(
        1.0,
        100_000.0,
        "records of the aggregator's root dataset; FLTrust's paper needs about 100",
        integer=True,
    ),
    "min_trust_score": ParameterRange(
        0.0,
        1.0,
        "a trust score is a cosine clipped at 0, so it lies in [0, 1]; 0 refuses only "
        "updates pointing away from the reference",
    ),
    "max_norm_ratio": ParameterRange(
        1.0,
        None,
        "an update longer than this many times the median update's norm is refused; below "
        "1 the median member itself would be",
        off=0.0,
    ),
}

#: The parameters each rule reads; ``max_norm_ratio`` applies under every rule.
RULE_PARAMETERS: Final[dict[str, tuple[str, ...]]] = {
    "fedavg": (),
    "trimmed_mean": ("trim_fraction",),
    "median": (),
    "multi_krum": ("byzantine", "krum_selected"),
    "centered_clipping": ("clip_radius", "clip_iterations"),
    "dnc": ("byzantine",),
    "fltrust": ("root_records", "min_trust_score"),
}
EVERY_RULE: Final = ("max_norm_ratio",)

#: The rules that need at least 2f + extra updates, and why (``fedsec.config`` holds
#: round.min_agents to it, so every round that may close can run the rule).
LEAST_UPDATES: Final[dict[str, tuple[int, str]]] = {
    "multi_krum": (3, "Krum needs more than 2f + 2 updates"),
    "dnc": (1, "it refuses f updates and relies on an honest majority"),
}


def check_parameter(name: str, value: float) -> None:
    """Raises ConfigError: ``value`` is outside ``name``'s :data:`PARAMETERS` range."""
    bounds = PARAMETERS[name]
    if not bounds.admits(value):
        raise ConfigError(f"{name}: expected {bounds.describe()}, got {value} ({bounds.why})")


class RuleParameters(Protocol):
    """What :func:`aggregate` reads (``fedsec.protocol.wire.AggregationSpec`` is one)."""

    @property
    def rule(self) -> str: ...
    @property
    def trim_fraction(self) -> float: ...
    @property
    def byzantine(self) -> int: ...
    @property
    def krum_selected(self) -> int: ...
    @property
    def clip_radius(self) -> float: ...
    @property
    def clip_iterations(self) -> int: ...
    @property
    def min_trust_score(self) -> float: ...
    @property
    def max_norm_ratio(self) -> float: ...


def describe(params: RuleParameters) -> str:
    """The rule with the parameters it reads (root_records aside), e.g.
    ``multi_krum (byzantine=1, krum_selected=0, max_norm_ratio=0.0)``."""
    names = (*RULE_PARAMETERS[params.rule], *EVERY_RULE)
    shown = [f"{n}={getattr(params, n)}" for n in names if n != "root_records"]
    return f"{params.rule} ({', '.join(shown)})"
