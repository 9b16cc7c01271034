"""The DP-SGD noise of :func:`fedsec.learning.dp_noise.secure_gaussian`: its
definition (4 Box-Muller normals a value from the AES-CTR stream), computed in blocks
on threads bit for bit as one pass over the whole tensor, never from ln 0, normal with
the asked standard deviation, and the same formula where torch computes it (GPUs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsec.crypto import prg
from fedsec.learning import dp_noise
from fedsec.learning.dp_noise import secure_gaussian as _secure_gaussian

SEED = b"s" * 32
DOMAIN = b"dp-sgd-noise/3/1"


def _one_pass(std: float, count: int, dtype: type[np.floating]) -> np.ndarray:
    """The docstring's definition over the whole tensor at once, each operation
    rounded once in ``dtype``."""
    word, radius_bits, angle_bits = (
        (np.uint32, 32, 24) if dtype is np.float32 else (np.uint64, 53, 53)
    )
    words = prg.expand(SEED, DOMAIN, 4 * count, word).reshape(count, 4).T
    x = ((words[:2] & word((1 << radius_bits) - 1)).astype(dtype) + dtype(1)) * dtype(
        2.0**-radius_bits
    )
    radius = np.sqrt(np.log(x) * dtype(-2.0))
    angle = (words[2:] & word((1 << angle_bits) - 1)).astype(dtype) * dtype(
        2.0 * math.pi * 2.0**-angle_bits
    )
    cosine, sine = radius * np.cos(angle), radius * np.sin(angle)
    out: np.ndarray = (cosine[0] + cosine[1] + sine[0] + sine[1]) * dtype(std / 2)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("count", [1, 63, 4097, 3 * 256 + 17])
def test_blocks_on_threads_give_the_one_pass_noise_bit_for_bit(
    dtype: torch.dtype, threads: int, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small blocks, so a few thousand values cross many block and thread boundaries
    monkeypatch.setattr(dp_noise, "NOISE_BLOCK", 256)
    monkeypatch.setattr(dp_noise, "MAX_NOISE_THREADS", threads)
    like = torch.zeros(count, dtype=dtype)
    noise = _secure_gaussian(SEED, DOMAIN, 0.7, like)
    assert noise.shape == like.shape and noise.dtype == dtype
    reference = _one_pass(0.7, count, np.float32 if dtype == torch.float32 else np.float64)
    assert np.array_equal(noise.numpy(), reference)


def test_the_noise_is_a_function_of_seed_and_domain() -> None:
    like = torch.zeros(5, 7)
    noise = _secure_gaussian(SEED, DOMAIN, 1.0, like)
    assert noise.shape == (5, 7)
    assert torch.equal(noise, _secure_gaussian(SEED, DOMAIN, 1.0, like))
    assert not torch.equal(noise, _secure_gaussian(SEED, DOMAIN + b"x", 1.0, like))
    assert not torch.equal(noise, _secure_gaussian(bytes(32), DOMAIN, 1.0, like))
    assert torch.equal(_secure_gaussian(SEED, DOMAIN, 0.0, like), torch.zeros(5, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_noise_has_mean_zero_and_the_asked_std(dtype: torch.dtype) -> None:
    noise = _secure_gaussian(bytes(range(32)), b"stats", 3.0, torch.zeros(200_000, dtype=dtype))
    assert noise.dtype == dtype
    values = noise.double().numpy()
    # 4 standard errors of the mean, and the std within 1 % (its standard error: 0.16 %)
    assert abs(values.mean()) < 4 * 3.0 / math.sqrt(values.size)
    assert values.std() == pytest.approx(3.0, rel=0.01)
    assert float(np.mean((values / values.std()) ** 4)) == pytest.approx(3.0, abs=0.05)


@pytest.mark.parametrize("precision", [dp_noise._FLOAT32, dp_noise._FLOAT64])
def test_the_extreme_words_give_finite_noise_within_the_largest_radius(
    precision: dp_noise._Precision,
) -> None:
    # radius words all clear: x = 2^-bits, the largest radius √(2·bits·ln 2), angle 0;
    # every bit set: x = 1 (float32 rounds 2^32 - 1 + 1 to 2^32), radius 0
    largest = math.sqrt(2 * precision.radius_bits * math.log(2))
    words = np.zeros((64, 4), dtype=precision.word)
    words[32:] = np.iinfo(precision.word).max
    draws = np.empty((4, 64), dtype=precision.word)
    work = np.empty((9, 64), dtype=precision.dtype)
    total = dp_noise._normals_sum(np, words, draws, precision, 1.0, work)
    assert np.all(np.isfinite(total))
    assert total[:32] == pytest.approx(2 * largest, rel=1e-6)  # cos 0 = 1, sin 0 = 0
    assert np.all(total[32:] == 0)
    # |r₀(cos θ₀ + sin θ₀) + r₁(cos θ₁ + sin θ₁)|·std/2 <= √2·largest·std
    noise = _secure_gaussian(SEED, DOMAIN, 2.0, torch.zeros(10_000)).numpy()
    assert np.all(np.abs(noise) <= math.sqrt(2) * largest * 2.0)


def test_no_32_bit_radius_word_reaches_ln_0() -> None:
    # float32(m) + 1 is exact below 2^24, where it is small, and rounds monotonically
    # above, so the smallest x is 2^-32 and the largest 1: ln is finite over every word
    below = np.arange(1 << 24, dtype=np.uint32)
    x = (below.astype(np.float32) + np.float32(1)) * np.float32(2.0**-32)
    assert np.array_equal(x.astype(np.float64), (below + 1.0) * 2.0**-32)
    edges = np.array([0, 1, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, 2**32 - 2, 2**32 - 1])
    x = (edges.astype(np.uint32).astype(np.float32) + np.float32(1)) * np.float32(2.0**-32)
    assert np.all(np.diff(x) >= 0) and x[0] == 2.0**-32 and x[-1] == 1.0
    assert np.all(np.isfinite(np.log(x)))
    assert float(np.sqrt(-2 * np.log(x[0]))) == pytest.approx(math.sqrt(64 * math.log(2)))


def test_torch_computes_the_same_formula_as_numpy() -> None:
    # the GPU path (torch on the device) run on the CPU: the same operations, so the
    # values agree up to the last bit of the transcendentals (SLEEF against numpy's)
    count = 10_000
    on_device = dp_noise._device_noise(
        SEED, DOMAIN, count, 0.35, dp_noise._FLOAT32, torch.device("cpu")
    )
    assert on_device.dtype == torch.float32 and on_device.shape == (count,)
    cpu = _secure_gaussian(SEED, DOMAIN, 0.7, torch.zeros(count)).numpy()
    np.testing.assert_allclose(on_device.numpy(), cpu, rtol=1e-5, atol=1e-6)
