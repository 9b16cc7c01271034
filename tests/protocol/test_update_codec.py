"""The update codec: decoding commutes with summation for every codec setting, the
shared subset and rotation are the same on every member and fresh every round, and
inputs no honest member encodes are refused."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import prg
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import default_ring_bits
from fedsec.errors import BadVector, ProtocolError, QuantizationError
from fedsec.protocol import codec_subset, ring_width, update_codec
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.wire import CodecSpec, DPSpec, RoundSpec
from fedsec.tasks import get_task
from tests.support.agent import signed_spec

SIGNER = SigningIdentity(bytes(range(32, 64)))
TASK = get_task("mnist1d")


def _spec(
    dim: int, members: int = 5, bits: int = 4, seed: str = "11" * 32, **changes: Any
) -> RoundSpec:
    fields: dict[str, Any] = {
        "secure_sum": "secagg",
        "quant_bits": bits,
        "ring_bits": default_ring_bits(bits, members),
        "clip_norm": 1.0,
        "seed": seed,
    }
    fields.update(changes)
    cohort = tuple(f"m{i:03d}" for i in range(members))
    return signed_spec(
        SIGNER, TASK, federation_id="fed", model_sha256="ab" * 32, dim=dim, cohort=cohort, **fields
    )


def _updates(rng: np.random.Generator, n: int, d: int) -> list[np.ndarray]:
    return [(rng.standard_normal(d) * rng.uniform(0.01, 0.5)).astype(np.float32) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    d=st.integers(1, 300),
    bits=st.sampled_from([2, 4, 8]),
    rotation=st.sampled_from(["none", "hadamard"]),
    keep=st.sampled_from([1.0, 0.5, 0.1]),
    feedback=st.booleans(),
    stddevs=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decoding_commutes_with_summation(
    n: int, d: int, bits: int, rotation: str, keep: float, feedback: bool, stddevs: float, seed: int
) -> None:
    stddevs = stddevs if rotation == "hadamard" else 0.0
    codec_spec = CodecSpec(
        rotation=rotation,
        keep=keep,
        range_stddevs=stddevs,
        error_feedback=feedback,  # type: ignore[arg-type]
    )
    _assert_the_sum_decodes_as_the_inputs(
        _spec(d, members=max(n, 3), bits=bits, codec=codec_spec), n, seed
    )


def _assert_the_sum_decodes_as_the_inputs(spec: RoundSpec, n: int, seed: int) -> np.ndarray:
    """Encode ``n`` random updates with ``spec``'s codec, check each as the aggregator
    does, and assert that their ring sum decodes to the sum of their decodings; returns
    the ring sum."""
    codec = codec_for(spec)
    rng = np.random.default_rng(seed)
    rings = [
        codec.encode(u, float(rng.uniform(0, 1)), os.urandom(32)).ring
        for u in _updates(rng, n, spec.dim)
    ]
    for r in rings:
        codec.check_input(r)
    ring_sum = np.zeros(codec.length, dtype=np.uint64)
    for r in rings:
        ring_sum += r.astype(np.uint64)
    ring_sum &= np.uint64((1 << spec.ring_bits) - 1)
    total, weight = codec.decode_sum(ring_sum.astype(spec.quant_spec().dtype), n)
    singles = [codec.decode_one(r) for r in rings]
    assert total.shape == (spec.dim,)
    np.testing.assert_allclose(total, sum(s[0] for s in singles), rtol=1e-9, atol=1e-9)
    assert weight == pytest.approx(sum(s[1] for s in singles), abs=1e-9)
    return ring_sum


def test_a_compressed_encoding_is_unbiased_and_near_the_update() -> None:
    d = 2000
    spec = _spec(d, bits=4, codec=CodecSpec(rotation="hadamard", range_stddevs=4.0))
    codec = codec_for(spec)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(d).astype(np.float32)
    x *= np.float32(0.8 / np.linalg.norm(x))
    draws = np.mean(
        [codec.decode_one(codec.encode(x, 1.0, os.urandom(32)).ring)[0] for _ in range(200)], axis=0
    )
    # 200 unbiased draws: the mean is within a small fraction of the norm
    assert np.linalg.norm(draws - x) < 0.1 * np.linalg.norm(x)
    one, weight = codec.decode_one(codec.encode(x, 1.0, os.urandom(32)).ring)
    assert weight == 1.0
    assert np.dot(one, x) / (np.linalg.norm(one) * np.linalg.norm(x)) > 0.7


def test_the_subset_and_rotation_are_shared_by_the_attempt_and_fresh_for_the_next() -> None:
    codec_spec = CodecSpec(rotation="hadamard", keep=0.25)
    a = codec_for(_spec(1000, codec=codec_spec))
    b = codec_for(_spec(1000, codec=codec_spec))  # another member derives the same spec
    c = codec_for(_spec(1000, codec=codec_spec, seed="22" * 32))  # the next attempt
    sa, sb, sc = a.subset(), b.subset(), c.subset()
    assert sa is not None and sb is not None and sc is not None
    assert a.keep == 250 == sa.size and np.array_equal(sa, sb)
    assert not np.array_equal(sa, sc)
    assert np.all(np.diff(sa) > 0) and sa.max() < 1024  # distinct, in the rotated frame
    assert a.rotation_seed == b.rotation_seed != c.rotation_seed
    assert a.length == 251


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200_000),
    fraction=st.floats(0.0, 1.0),
    seed=st.binary(min_size=32, max_size=32),
)
def test_the_subset_is_the_k_smallest_keys_ties_broken_by_index(
    n: int, fraction: float, seed: bytes
) -> None:
    k = max(1, min(n, round(fraction * n)))
    keys = prg.expand(seed, codec_subset.SUBSET_DOMAIN, n, np.uint32)
    expected = np.sort(np.lexsort((np.arange(n), keys))[:k])
    assert np.array_equal(codec_subset.subset(seed, n, k), expected)


def test_the_subset_breaks_a_tie_at_the_boundary_by_the_lower_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = np.array([7, 3, 3, 9, 3, 1], dtype=np.uint32)
    monkeypatch.setattr(codec_subset.prg, "expand", lambda *_: keys)
    codec_subset.subset.cache_clear()
    try:
        assert codec_subset.subset(b"t" * 32, 6, 3).tolist() == [1, 2, 5]
        assert codec_subset.subset(b"t" * 32, 6, 5).tolist() == [0, 1, 2, 4, 5]
    finally:
        codec_subset.subset.cache_clear()


def test_wrong_length_and_out_of_range_vectors_are_refused() -> None:
    codec = codec_for(_spec(100, codec=CodecSpec(rotation="hadamard", keep=0.5)))
    good = codec.encode(np.ones(100, np.float32) * 0.01, 0.5, os.urandom(32)).ring
    codec.check_input(good)
    with pytest.raises(BadVector, match="has 51 elements, got 50"):
        codec.check_input(good[:-1])
    bad = good.copy()
    bad[3] = 16
    with pytest.raises(BadVector, match="above 15 levels"):
        codec.check_input(bad)
    with pytest.raises(QuantizationError, match="has 51 elements"):
        codec.decode_sum(good[:-1], 1)
    with pytest.raises(QuantizationError, match="must have 100 values"):
        codec.encode(np.ones(99, np.float32), 0.5, os.urandom(32))


def test_the_plain_codec_is_todays_quantization() -> None:
    spec = _spec(50, bits=8)
    codec = codec_for(spec)
    assert (codec.kind, codec.length, codec.range) == ("plain", 51, 1.0)
    assert spec.secagg_params().vector_length == 51


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"codec": CodecSpec(keep=0.0)}, "outside"),
        ({"codec": CodecSpec(range_stddevs=3.0)}, "without rotation"),
        ({"codec": CodecSpec(rotation="hadamard", range_stddevs=0.5)}, "outside"),
        (
            {"codec": CodecSpec(rotation="hadamard"), "secure_sum": "he"},
            "codec: compression cannot be on with round.secure_sum = 'he'",
        ),
        (
            {
                "codec": CodecSpec(error_feedback=True),
                "dp": DPSpec(
                    True, 1.0, 1.0, 1e-5, mode="distributed", sample_rate=0.1, min_survivors=3
                ),
                "quant_bits": 16,
                "ring_bits": 19,
            },
            "codec.error_feedback: cannot be on with distributed DP",
        ),
    ],
)
def test_contradictory_codecs_are_refused_with_the_reason(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        codec_for(_spec(100, **changes))


def test_a_distributed_codec_sums_noise_shares_and_weights() -> None:
    d, n = 300, 5
    dp = DPSpec(True, 0.0 + 1e-9, 1.0, 1e-5, mode="distributed", sample_rate=0.5, min_survivors=4)
    spec = _spec(d, members=n, bits=16, ring_bits=default_ring_bits(16, n), clip_norm=5.0, dp=dp)
    codec = codec_for(spec)
    assert codec.kind == "distributed" and codec.length == 512 + 1
    rng = np.random.default_rng(2)
    xs = [x / np.float32(np.linalg.norm(x)) for x in _updates(rng, n, d)]  # within the clip
    rings = [codec.encode(x, 10.0 + i, os.urandom(32)).ring for i, x in enumerate(xs)]
    ring_sum = np.zeros(codec.length, dtype=np.uint64)
    for r in rings:
        ring_sum += r.astype(np.uint64)
    total, weight = codec.decode_sum(ring_sum & np.uint64((1 << spec.ring_bits) - 1), n)
    assert weight == 60.0  # the integer weights, summed exactly
    np.testing.assert_allclose(total, np.sum(xs, axis=0), atol=0.05)
    assert codec.edge_count(ring_sum, n) == 0
    with pytest.raises(QuantizationError, match="distributed-DP weight"):
        codec.encode(xs[0], -1.0, os.urandom(32))


# -- fewer headroom bits: a ring that may wrap ----------------------------------------------------


def _wrapping(d: int, members: int, bits: int, headroom: int, **changes: Any) -> RoundSpec:
    codec = CodecSpec(rotation="hadamard", keep=0.5, range_stddevs=3.0, headroom_bits=headroom)
    ring = ring_width.ring_bits_for(bits, members, headroom)
    return _spec(d, members=members, bits=bits, ring_bits=ring, codec=codec, **changes)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 8),
    d=st.integers(1, 300),
    bits=st.sampled_from([2, 4, 8]),
    headroom=st.sampled_from([3, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_wrapping_ring_decodes_every_sum_that_stays_inside_it(
    n: int, d: int, bits: int, headroom: int, seed: int
) -> None:
    """Up to 8 members' centred sums stay within ±4·(L + 1) ≤ half a ring of b + 3 bits,
    so none wraps and the centred decoding is exact: it commutes with summation, and the
    weight's digits sum to the total weight."""
    spec = _wrapping(d, 20, bits, headroom)  # 20 members would need 5 headroom bits
    codec = codec_for(spec)
    assert codec.wraps and spec.ring_bits == bits + headroom
    assert codec.length == codec.keep + codec.weight_elements
    ring_sum = _assert_the_sum_decodes_as_the_inputs(spec, n, seed)
    if n < 8:  # ±3.5·L is short of the edge region, beyond 7/8 of 4·(L + 1)
        assert codec.edge_count(ring_sum, n) == 0


def test_a_sum_beyond_half_the_ring_wraps_and_is_counted_at_the_edge() -> None:
    """50 members at 2 bits need 6 headroom bits; with 4 a ring of 6 bits holds centred
    sums in [−32, 32) levels.  33 members all at the top level sum to +49.5 levels, which
    wraps to −14.5; 20 of them sum to +30 levels, at the edge but exact."""
    spec = _wrapping(64, 50, 2, 4)
    codec = codec_for(spec)
    assert (spec.ring_bits, codec.weight_digit_bits, codec.weight_elements) == (6, 1, 2)
    top = np.zeros(codec.length, dtype=spec.quant_spec().dtype)
    top[: codec.keep] = 3
    top[codec.keep :] = [1, 1]  # weight 3 = the top level: w = 1
    for members, centred in ((20, 30.0), (33, -14.5)):
        ring_sum = (top.astype(np.uint64) * np.uint64(members)) & np.uint64(63)
        sums, weight = codec._decode_centred(ring_sum, members)
        assert weight == members
        np.testing.assert_allclose(sums, centred * 2 * codec.range / 3)
        assert codec.edge_count(ring_sum, members) == (codec.keep if members == 20 else 0)
    middle = np.zeros_like(top)
    middle[: codec.keep] = [1, 2] * (codec.keep // 2)  # centred ±0.5 levels each
    assert codec.edge_count(middle.astype(np.uint64) * np.uint64(50) & np.uint64(63), 50) == 0


def test_a_wrapping_codec_refuses_what_no_honest_member_sends() -> None:
    codec = codec_for(_wrapping(64, 50, 2, 4))
    good = codec.encode(np.full(64, 0.01, np.float32), 1.0, os.urandom(32)).ring
    codec.check_input(good)
    bad = good.copy()
    bad[-1] = 2  # a weight digit of one bit
    with pytest.raises(BadVector, match="weight element above 1"):
        codec.check_input(bad)
    with pytest.raises(QuantizationError, match=r"holds the sums of 1\.\.50"):
        codec.decode_sum(good, 51)


def test_headroom_that_a_small_cohort_does_not_need_changes_nothing() -> None:
    """3 members need 2 headroom bits: asking for 4 gives the ring in which no sum wraps."""
    spec = _wrapping(64, 3, 4, 4)
    codec = codec_for(spec)
    assert spec.ring_bits == default_ring_bits(4, 3) == 6
    assert not codec.wraps and codec.length == codec.keep + 1
    assert codec.edge_count(np.zeros(codec.length, np.uint64), 3) == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"codec": CodecSpec(headroom_bits=4), "ring_bits": 6}, "without rotation"),
        (
            {"codec": CodecSpec(rotation="hadamard", headroom_bits=17), "ring_bits": 19},
            "outside 1..16",
        ),
        ({"codec": CodecSpec(rotation="hadamard", headroom_bits=4), "ring_bits": 8}, "make 6"),
        ({"codec": CodecSpec(rotation="hadamard", headroom_bits=3), "ring_bits": 5}, "weights"),
    ],
)
def test_headroom_bits_the_spec_cannot_carry_are_refused(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        codec_for(_spec(100, members=50, bits=2, **changes))


def test_a_wrapping_round_masks_a_cohort_its_ring_would_otherwise_refuse() -> None:
    spec = _wrapping(64, 50, 2, 4)
    params = spec.secagg_params()
    assert params.wraps and params.vector_length == codec_for(spec).length
    plain = _spec(64, members=50, bits=2, codec=CodecSpec(rotation="hadamard", keep=0.5))
    assert plain.secagg_params().digest() != params.digest()
    with pytest.raises(ProtocolError, match="overflow ring"):
        dataclasses.replace(params, wraps=False)


# -- decoding in runs: bit for bit the whole-vector decode -----------------------------------------


def _whole_decode(codec: Any, ring_sum: np.ndarray, members: int) -> tuple[Any, float, int]:
    """The decode as it was before it ran in blocks (kept here as the reference): the whole
    ring sum at once, through full-length int64 and float64 temporaries."""
    from fedsec.crypto import kernels, rotation
    from fedsec.crypto.discretize import recentre

    def unrotate(vec: np.ndarray, seed: bytes, d: int, scale: float = 1.0) -> np.ndarray:
        work = vec * (scale / np.sqrt(float(vec.size)))
        kernels.hadamard_inplace(work)
        kernels.apply_signs(work[:d], rotation._sign_bytes(seed, d), rotation._SIGN_TABLE)
        return work[:d]

    def dequantize(values: np.ndarray, quant: Any) -> tuple[np.ndarray, float]:
        q = values & quant.dtype.type(quant.ring_mask)
        total = q[:-1].astype(np.float64)
        total *= quant.step()
        total -= members * quant.clip
        return total, float(q[-1]) / quant.levels

    if codec.kind == "plain":
        return (*dequantize(ring_sum, codec.quant), 0)
    if codec.kind == "distributed":
        centred = recentre(ring_sum, codec.quant.ring_bits)
        body = centred[:-1].astype(np.float64) * (1.0 / codec.ddp.scale)
        edges = codec._count_edges(centred[:-1])
        return unrotate(body, codec.rotation_seed, codec.dim), float(centred[-1]), edges
    edges = 0
    if codec.wraps:
        twice = codec._twice_centred(ring_sum[: codec.keep], members)
        kept = twice.astype(np.float64) * (codec.range / codec.quant.levels)
        weight = codec._centred_weight(ring_sum, members)
        edges = codec._count_edges(twice)
    else:
        kept, weight = dequantize(ring_sum, codec._range_quant())
    idx = codec.subset()
    full = kept
    if idx is not None:
        full = np.zeros(codec.padded)
        full[idx] = kept
    if codec.rotation_seed is not None:
        return unrotate(full, codec.rotation_seed, codec.dim, codec.rescale), weight, edges
    return (full * codec.rescale if codec.rescale != 1.0 else full), weight, edges


def _random_sum(codec: Any, rng: np.random.Generator) -> np.ndarray:
    """A ring sum of random elements of the ring: any value the masks leave is possible."""
    m = codec.quant.ring_bits
    values = rng.integers(0, 1 << m, size=codec.length, dtype=np.uint64)
    return values.astype(codec.quant.dtype)


def _assert_runs_decode_as_whole(codec: Any, members: int, seed: int) -> None:
    ring_sum = _random_sum(codec, np.random.default_rng(seed))
    expected, weight, edges = _whole_decode(codec, ring_sum, members)
    for block in (1, 7, 64, 1000, update_codec.DECODE_BLOCK):
        got = codec._decode(ring_sum, members, count=True, block=block)
        assert got[0].shape == (codec.dim,) and got[0].dtype == np.float64
        assert got[0].tobytes() == np.ascontiguousarray(expected).tobytes(), block
        assert (got[1], got[2]) == (weight, edges)
        space = codec.decode_space()
        if space is not None:  # the sum at the end of the vector it is decoded in
            work, into = space
            into[...] = ring_sum
            got = codec._decode(into, members, count=True, block=block, work=work)
            assert got[0].tobytes() == np.ascontiguousarray(expected).tobytes(), block
            assert (got[1], got[2]) == (weight, edges)
    assert codec.decode_sum(ring_sum, members)[0].tobytes() == expected.tobytes()


@pytest.mark.parametrize("ring_bits", range(3, 57))
def test_a_plain_sum_decodes_in_runs_as_whole_at_every_ring_width(ring_bits: int) -> None:
    bits = min(16, ring_bits - 1)
    members = min(5, (1 << ring_bits) // (1 << bits))
    codec = codec_for(_spec(1001, members=members, bits=bits, ring_bits=ring_bits))
    assert codec.kind == "plain" and codec.quant.ring_bits == ring_bits
    _assert_runs_decode_as_whole(codec, members, ring_bits)


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(1, 3000),
    n=st.integers(1, 8),
    bits=st.sampled_from([2, 4, 6, 8, 12, 16]),
    extra=st.integers(0, 40),
    rotation=st.sampled_from(["none", "hadamard"]),
    keep=st.sampled_from([1.0, 0.9, 0.33, 0.01]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_compressed_sum_decodes_in_runs_as_whole(
    d: int, n: int, bits: int, extra: int, rotation: str, keep: float, seed: int
) -> None:
    """Ring widths from no-wrap up to 56 bits, odd lengths, with and without the subset
    and the rotation."""
    ring = min(56, default_ring_bits(bits, n) + extra)
    stddevs = 3.0 if rotation == "hadamard" else 0.0
    spec = _spec(
        d,
        members=n,
        bits=bits,
        ring_bits=ring,
        codec=CodecSpec(rotation=rotation, keep=keep, range_stddevs=stddevs),
    )
    codec = codec_for(spec)
    assert not codec.wraps  # (no rotation and every coordinate: the plain kind)
    _assert_runs_decode_as_whole(codec, n, seed)


@settings(max_examples=20, deadline=None)
@given(
    d=st.integers(1, 3000),
    n=st.integers(1, 50),
    bits=st.sampled_from([2, 4, 6, 8]),
    headroom=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_wrapping_sum_decodes_in_runs_as_whole_with_its_edge_count(
    d: int, n: int, bits: int, headroom: int, seed: int
) -> None:
    # a cohort of 50 needs a ring of at least 6 bits for its weight digits
    codec = codec_for(_wrapping(d, 50, bits, max(headroom, 6 - bits)))
    assert codec.wraps
    _assert_runs_decode_as_whole(codec, n, seed)


def test_a_sum_decoded_in_its_space_is_spent_and_the_unneeded_pages_given_back() -> None:
    # the aggregator's close: the sum is unmasked at the end of the vector it is decoded
    # in; afterwards the pages past d are the system's again and the spent sum reads zeros
    d, members = 3000, 10
    codec = codec_for(_wrapping(d, members, 6, 3))
    space = codec.decode_space()
    assert space is not None
    work, into = space
    assert work.shape == (codec.padded,) and into.shape == (codec.length,)
    ring_sum = _random_sum(codec, np.random.default_rng(1))
    into[...] = ring_sum
    got = codec.decode_counted(into, members, work)
    expected = _whole_decode(codec, ring_sum, members)
    assert got[0].tobytes() == np.ascontiguousarray(expected[0]).tobytes()
    assert got[1:] == expected[1:]
    assert not into.any()
    # sums that decode to zero: a coordinate that kept the sum's bytes would not be
    work, into = codec.decode_space() or (None, None)
    assert work is not None and into is not None
    into[: codec.keep] = members * codec.quant.levels // 2
    into[codec.keep :] = ring_sum[codec.keep :]
    assert not codec.decode_counted(into, members, work)[0].any()


def test_a_decode_refuses_a_work_vector_that_is_not_its_space() -> None:
    codec = codec_for(_wrapping(3000, 10, 6, 3))
    ring_sum = _random_sum(codec, np.random.default_rng(2))
    before = ring_sum.copy()
    for work in (np.zeros(codec.padded), np.zeros(codec.padded + 1)):
        with pytest.raises(QuantizationError, match="work vector"):
            codec.decode_counted(ring_sum, 10, work)
        assert not work.any()
    assert np.array_equal(ring_sum, before)


def test_only_a_rotated_compressed_codec_of_narrow_rings_offers_a_decode_space() -> None:
    assert codec_for(_spec(300)).decode_space() is None  # plain
    narrow = CodecSpec(rotation="hadamard", keep=0.5, range_stddevs=3.0)
    assert codec_for(_spec(300, bits=8, codec=narrow)).decode_space() is not None
    wide = _spec(300, bits=16, ring_bits=40, codec=narrow)  # 8-byte ring elements
    assert codec_for(wide).decode_space() is None


@pytest.mark.parametrize(("d", "members"), [(1, 3), (300, 5), (1025, 4)])
def test_a_distributed_sum_decodes_in_runs_as_whole_with_its_edge_count(
    d: int, members: int
) -> None:
    dp = DPSpec(True, 1.0, 1.0, 1e-5, mode="distributed", sample_rate=0.5, min_survivors=2)
    ring = default_ring_bits(16, members)
    spec = _spec(d, members=members, bits=16, ring_bits=ring, clip_norm=5.0, dp=dp)
    codec = codec_for(spec)
    assert codec.kind == "distributed"
    _assert_runs_decode_as_whole(codec, members, d)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 300_000),
    fraction=st.floats(0.0, 1.0),
    block=st.sampled_from([1, 3, 1000, 65_536, 1 << 18]),
    seed=st.binary(min_size=32, max_size=32),
)
def test_the_subset_in_runs_is_the_subset(n: int, fraction: float, block: int, seed: bytes) -> None:
    if block < 1000:
        n = min(n, 5000)  # a block of one element is the slow path, not the one used
    k = max(1, min(n, round(fraction * n)))
    runs = list(codec_subset.kept_runs(seed, n, k, block))
    assert [start for start, _ in runs] == list(range(0, n, block))
    joined = np.concatenate([start + kept for start, kept in runs])
    assert np.array_equal(joined, codec_subset.subset(seed, n, k))


@pytest.mark.parametrize("ring_bits", [3, 9, 16, 17, 33, 56])
@pytest.mark.parametrize("codec_spec", [CodecSpec(), CodecSpec(rotation="hadamard", keep=0.5)])
def test_adding_one_input_in_runs_is_adding_its_decoding(
    ring_bits: int, codec_spec: CodecSpec
) -> None:
    """What a trusted aggregator does per upload: the running sum after add_one is the
    sum after adding decode_one's vector, bit for bit; a wrong length changes nothing."""
    bits = min(8, ring_bits - 1)
    spec = _spec(
        update_codec.DECODE_BLOCK + 3, members=3, bits=bits, ring_bits=ring_bits, codec=codec_spec
    )
    codec = codec_for(spec)
    rng = np.random.default_rng(ring_bits)
    levels = rng.integers(0, codec.quant.levels + 1, size=codec.length, dtype=np.uint64)
    vector = levels.astype(codec.quant.dtype)
    start = rng.standard_normal(spec.dim)
    expected = start.copy()
    update, weight = codec.decode_one(vector)
    expected += update
    total = start.copy()
    assert codec.add_one(vector, total) == weight
    assert total.tobytes() == expected.tobytes()
    with pytest.raises(QuantizationError, match="elements"):
        codec.add_one(vector[:-1], total)
    assert total.tobytes() == expected.tobytes()


@pytest.mark.parametrize("ring_bits", [3, 8, 9, 16, 17, 32, 33, 56])
@pytest.mark.parametrize("dim", [5, update_codec.DECODE_BLOCK, update_codec.DECODE_BLOCK + 3])
def test_a_wire_vector_read_in_runs_is_checked_and_added_as_whole(ring_bits: int, dim: int) -> None:
    """A trusted aggregator's upload, read from its packed bytes a run at a time: the same
    sum as unpacking it whole, and the same refusals (the weight alone in the last run
    when d is a whole number of runs)."""
    from fedsec.crypto.quantize import pack

    bits = min(8, ring_bits - 1)
    codec = codec_for(_spec(dim, members=3, bits=bits, ring_bits=ring_bits))
    assert codec.kind == "plain"
    rng = np.random.default_rng(ring_bits + dim)
    levels = codec.quant.levels
    vector = rng.integers(0, levels + 1, size=codec.length, dtype=np.uint64)
    vector = vector.astype(codec.quant.dtype)
    start = rng.standard_normal(dim)
    expected = start.copy()
    weight = codec.add_one(vector, expected)
    raw = pack(vector, ring_bits)
    codec.check_packed(raw)
    total = start.copy()
    assert codec.add_packed(raw, total) == weight
    assert total.tobytes() == expected.tobytes()
    for where, message in ((dim - 1, f"values above {levels} levels"), (dim, "weight element")):
        bad = vector.copy()
        bad[where] = levels + 1
        with pytest.raises(BadVector, match=message):
            codec.check_input(bad)
        with pytest.raises(BadVector, match=message):
            codec.check_packed(pack(bad, ring_bits))
