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
    word, bits = (np.uint32, 24) if dtype is np.float32 else (np.uint64, 53)
    words = prg.expand(SEED, DOMAIN, 4 * count, word).reshape(count, 4)
    m = (words & word((1 << bits) - 1)).T.astype(dtype)  # exact
    radius = np.sqrt(np.log1p(m[:2] * dtype(-(2.0**-bits))) * dtype(-2.0))
    angle = m[2:] * dtype(2.0 * math.pi * 2.0**-bits)
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


@pytest.mark.parametrize(("word", "bits"), [(np.uint32, 24), (np.uint64, 53)])
def test_the_extreme_words_give_finite_noise_within_the_largest_radius(
    word: type[np.unsignedinteger], bits: int
) -> None:
    # every bit set: u = 1 - 2^-bits, the smallest 1 - u, the largest radius √(2·bits·ln 2);
    # all clear: u = 0, radius 0
    dtype = np.float32 if bits == 24 else np.float64
    largest = math.sqrt(2 * bits * math.log(2))
    words = np.full((64, 4), np.iinfo(word).max, dtype=word)
    words[32:] = 0
    work = np.empty((9, 64), dtype=dtype)
    total = dp_noise._normals_sum(np, words, bits, 1.0, work)
    assert np.all(np.isfinite(total))
    # θ just below 2π: cos 1, sin 0, so the value is the two radii
    assert total[:32] == pytest.approx(2 * largest, rel=1e-5)
    assert np.all(total[32:] == 0)
    # |r₀(cos θ₀ + sin θ₀) + r₁(cos θ₁ + sin θ₁)|·std/2 <= √2·largest·std
    noise = _secure_gaussian(SEED, DOMAIN, 2.0, torch.zeros(10_000)).numpy()
    assert np.all(np.abs(noise) <= math.sqrt(2) * largest * 2.0)


def test_no_24_bit_uniform_reaches_ln_0() -> None:
    # all 2^24 float32 uniforms, exhaustively: ln(1 - u) is finite and the radius at
    # most √(48 ln 2) = 5.77
    m = np.arange(1 << 24, dtype=np.float32)
    logs = np.log1p(m * np.float32(-(2.0**-24)))
    assert np.all(np.isfinite(logs))
    assert float(np.sqrt(-2 * logs.min())) == pytest.approx(math.sqrt(48 * math.log(2)), rel=1e-6)


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
