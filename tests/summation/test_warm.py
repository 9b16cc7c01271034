"""Loading the (un)packing loops before serving: every ring width a cohort can have."""

from __future__ import annotations

import msgspec
import pytest

from fedsec.config import FederationConfig
from fedsec.crypto import packing
from fedsec.protocol.ring_width import ring_bits_for
from fedsec.summation import mode_named


def _cfg(secure_sum: str, headroom_bits: int = 0) -> FederationConfig:
    return msgspec.convert(
        {
            "federation": {"id": "f", "task": "breast_cancer"},
            "round": {"secure_sum": secure_sum, "min_agents": 3, "max_agents": 1000},
            "codec": {"headroom_bits": headroom_bits},
        },
        FederationConfig,
    )


def _peek(width: int) -> bool:
    # functools.cache keeps no public membership test: a hit leaves misses unchanged
    misses = packing._block_loops.cache_info().misses
    packing._block_loops(width)
    hit = packing._block_loops.cache_info().misses == misses
    return hit


@pytest.mark.parametrize(("secure_sum", "headroom"), [("secagg", 0), ("none", 0), ("secagg", 4)])
def test_every_width_a_cohort_can_have_is_loaded(secure_sum: str, headroom: int) -> None:
    cfg = _cfg(secure_sum, headroom)
    packing._block_loops.cache_clear()  # what an earlier test loaded does not count
    mode_named(secure_sum).warm(cfg, 700)
    widths = {ring_bits_for(cfg.round.quant_bits, n, headroom) for n in range(3, 701)}
    for width in widths - {8, 16, 32, 64}:
        assert _peek(width), f"ring width {width} was not loaded before serving"
        assert all(loop.signatures for loop in packing._block_loops(width))


def test_a_mode_without_ring_vectors_loads_nothing() -> None:
    assert mode_named("he").warm(_cfg("he"), 700) == 0
