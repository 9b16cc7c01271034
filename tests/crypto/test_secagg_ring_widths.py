"""SecAgg+ sums exactly in every ring width the codecs use, 8 to 32 bits, byte aligned
or not: the compiled packing (a loop per width, 64-element blocks and a tail) must
carry each masked element bit for bit, or the masks would not cancel."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsec.crypto.quantize import QuantSpec
from fedsec.crypto.secagg import masks
from fedsec.crypto.secagg.messages import SecAggParams
from fedsec.errors import RecoveryImpossible, RoundAborted
from tests.support.secagg import Round, make_params


@st.composite
def ring_rounds(draw: st.DrawFn) -> tuple[SecAggParams, set[str]]:
    ring_bits = draw(st.sampled_from(range(8, 33)))
    bits = draw(st.integers(2, min(16, ring_bits - 1)))
    n = draw(st.integers(3, 9))
    # across the packing's 64-element blocks: a tail only, whole blocks, blocks and a tail
    dim = draw(st.sampled_from([1, 7, 62, 63, 64, 100, 127, 128, 200]))
    params = make_params(n, bits=bits, dim=dim, seed=draw(st.binary(min_size=32, max_size=32)))
    quant = QuantSpec(bits, params.quant.clip, ring_bits)
    # a narrow ring may wrap: the sum is then exact modulo 2^ring_bits, which is the claim
    params = dataclasses.replace(params, quant=quant, wraps=n > quant.max_members())
    lost = set(draw(st.lists(st.sampled_from(params.cohort), max_size=2)))
    return params, lost


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ring_rounds())
def test_the_unmasked_sum_is_exact_in_every_ring_width(
    scenario: tuple[SecAggParams, set[str]],
) -> None:
    params, lost = scenario
    ring_bits = params.quant.ring_bits
    event("a dtype's width (copied)" if ring_bits in (8, 16, 32) else "packed")
    event("byte aligned" if ring_bits % 8 == 0 else "not byte aligned")
    r = Round(params)
    try:
        result = r.run(lost_masked=lost)  # dropped after sharing: pairwise masks recovered
    except (RoundAborted, RecoveryImpossible):
        event("too few members left")
        return
    assert result.ring_sum.dtype == params.quant.dtype
    mask = params.quant.ring_mask
    expected = [v & mask for v in r.plain_sum(result.survivors)]
    assert [int(v) for v in result.ring_sum] == expected
    # the wire carried exactly ring_bits bits per element
    for msg in r.masked.values():
        assert len(msg.vector) == (params.vector_length * ring_bits + 7) // 8


def test_a_mask_applied_from_the_reused_buffer_is_the_documented_mask() -> None:
    """apply_*_mask draws into one buffer per thread: the result must be the mask that
    self_mask and pair_mask define (an auditor or another implementation derives them
    from the same seeds), not just something both ends of a round agree on."""
    params = make_params(5, bits=8, dim=150)
    acc = np.arange(params.vector_length, dtype=params.quant.dtype)
    for seed in (b"\x01" * 32, b"\x02" * 32):
        for add in (True, False):
            for apply_mask, mask in (
                (masks.apply_self_mask, masks.self_mask),
                (masks.apply_pair_mask, masks.pair_mask),
            ):
                expected = acc.copy()
                masks.apply(expected, mask(seed, params), add)
                apply_mask(acc, seed, params, add)
                np.testing.assert_array_equal(acc, expected)
