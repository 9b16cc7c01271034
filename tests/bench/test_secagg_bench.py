"""fedsec bench secagg in a ring wider than its cohort needs, and its two floors."""

from __future__ import annotations

import pytest

from fedsec.bench.secagg import run_secagg


@pytest.mark.parametrize("ring_bits", [24, 27, 32])
def test_a_wider_ring_sums_exactly_and_sends_its_width(ring_bits: int) -> None:
    record = run_secagg(10, 300, 0.2, "masked", 6, 4, bits=8, ring_bits=ring_bits)
    assert record["exact"] is True and record["ring_bits"] == ring_bits
    assert record["bytes_per_param"] == pytest.approx(301 * ring_bits / 8 / 300, abs=1 / 300)
    for key in ("floor_s", "client_floor_s", "server_over_floor", "client_over_floor"):
        assert record[key] > 0


def test_a_ring_narrower_than_the_rule_is_refused() -> None:
    # 8 bits and 10 members need 8 + 4 bits
    with pytest.raises(ValueError, match="at least 12"):
        run_secagg(10, 300, 0.2, "masked", 6, 4, bits=8, ring_bits=11)
