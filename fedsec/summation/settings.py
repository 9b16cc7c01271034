"""The federation settings a summation mode reads, as structural types.

``fedsec.config``'s sections satisfy them (its ``FederationConfig`` is what the
aggregator passes).  The mode objects type against these instead of importing
``fedsec.config``, which imports the modes: the layer stays free of an import circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class RoundSettings(Protocol):
    """``[round]``: the cohort bounds, the quantisation and each stage's window."""

    @property
    def min_agents(self) -> int: ...
    @property
    def max_agents(self) -> int: ...
    @property
    def neighbors(self) -> int: ...
    @property
    def threshold(self) -> int: ...
    @property
    def quant_bits(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def open_s(self) -> float: ...
    @property
    def advertise_s(self) -> float: ...
    @property
    def share_s(self) -> float: ...
    @property
    def masked_s(self) -> float: ...
    @property
    def unmask_s(self) -> float: ...
    @property
    def decrypt_s(self) -> float: ...


class HeSettings(Protocol):
    """``[he]``: the key custodian and the CKKS parameters."""

    @property
    def custodian(self) -> str: ...
    @property
    def poly_modulus_degree(self) -> int: ...
    @property
    def coeff_mod_bit_sizes(self) -> Sequence[int]: ...
    @property
    def scale_bits(self) -> int: ...
    @property
    def model_visible_to_aggregator(self) -> bool: ...


class _Enabled(Protocol):
    @property
    def enabled(self) -> bool: ...


class _Server(Protocol):
    @property
    def optimizer(self) -> str: ...
    @property
    def max_body_bytes(self) -> int: ...


class FederationSettings(Protocol):
    """``federation.toml``, as far as a mode's own problems need it."""

    @property
    def round(self) -> RoundSettings: ...
    @property
    def he(self) -> HeSettings: ...
    @property
    def validation(self) -> _Enabled: ...
    @property
    def server(self) -> _Server: ...
