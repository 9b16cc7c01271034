"""The DP noise of a large tensor, computed in blocks on threads, is bit for bit the
noise of one pass over the whole tensor (the definition, below)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsec.crypto import prg
from fedsec.learning.dp_noise import NOISE_BLOCK as _NOISE_BLOCK
from fedsec.learning.dp_noise import secure_gaussian as _secure_gaussian


def _one_pass(seed: bytes, domain: bytes, std: float, count: int) -> np.ndarray:
    half = (count * 4 + 1) // 2
    words = prg.expand(seed, domain, 2 * half, np.uint64) >> np.uint64(11)
    u = (words.astype(np.float64) + 1.0) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(u[:half]))
    angle = (2.0 * math.pi) * u[half:]
    normals = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
    summed = normals[: count * 4].reshape(4, count).sum(axis=0)
    summed *= std / 2.0
    out: np.ndarray = summed.astype(np.float32)
    return out


@pytest.mark.parametrize("count", [1, 4097, _NOISE_BLOCK, 3 * _NOISE_BLOCK + 17])
def test_blocks_give_the_one_pass_noise_bit_for_bit(count: int) -> None:
    like = torch.zeros(count, dtype=torch.float32)
    noise = _secure_gaussian(b"s" * 32, b"dp-sgd-noise/3/1", 0.7, like)
    assert noise.shape == like.shape and noise.dtype == torch.float32
    assert np.array_equal(noise.numpy(), _one_pass(b"s" * 32, b"dp-sgd-noise/3/1", 0.7, count))
