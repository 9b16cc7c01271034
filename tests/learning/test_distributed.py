"""Record-level distributed DP-SGD: with the noise off, the members' discretised shares
sum to exactly one central DP-SGD step on the pooled records (up to quantisation)."""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch.nn import functional as F

from fedsec.crypto.discretize import DdpSpec, decode_sum, encode
from fedsec.errors import ConfigError
from fedsec.learning.distributed import apply_gradient_sum, clipped_gradient_sum, poisson_sample
from fedsec.tasks import get_task
from fedsec.tasks.params import flatten_params

SHARED = hashlib.sha256(b"round spec").digest()
RATE, CLIP, LR, MEMBERS = 0.25, 1.0, 0.5, 4


def _central_step(
    model: torch.nn.Module, x: np.ndarray, y: np.ndarray, expected_batch: float
) -> None:
    """One Opacus DP-SGD step (noise 0) on the pooled batch (x, y)."""
    gsm = GradSampleModule(model)
    optimizer = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=LR),
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        expected_batch_size=int(expected_batch),
    )
    optimizer.zero_grad()
    F.cross_entropy(gsm(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    optimizer.step()
    gsm.remove_hooks()


def test_the_summed_shares_are_one_central_dp_sgd_step_on_the_pooled_records() -> None:
    task = get_task("mnist1d")
    data = task.load()
    x, y = data.x_train[:400], data.y_train[:400]
    parts = np.array_split(np.arange(400), MEMBERS)
    model = task.build_model(0)
    dim = sum(p.numel() for p in model.parameters())
    spec = DdpSpec(dim, 30, 100.0, CLIP, 0.0, MEMBERS, MEMBERS)
    masks = [poisson_sample(len(p), RATE, b"member %d" % i) for i, p in enumerate(parts)]
    shares = []
    for i, (part, mask) in enumerate(zip(parts, masks, strict=True)):
        total, count = clipped_gradient_sum(model, x[part], y[part], mask, CLIP)
        assert count == int(mask.sum())
        shares.append(encode(total, spec, SHARED, hashlib.sha256(b"%d" % i).digest()))
    ring = sum(s.ring.astype(np.uint64) for s in shares)
    decoded = decode_sum(ring, spec, SHARED)

    expected_batch = RATE * 400
    federated = copy.deepcopy(model)
    apply_gradient_sum(
        federated, decoded, expected_batch, torch.optim.SGD(federated.parameters(), lr=LR)
    )
    central = copy.deepcopy(model)
    pooled = np.concatenate([part[mask] for part, mask in zip(parts, masks, strict=True)])
    _central_step(central, x[pooled], y[pooled], expected_batch)

    before = flatten_params(model).astype(np.float64)
    step_central = flatten_params(central).astype(np.float64) - before
    step_federated = flatten_params(federated).astype(np.float64) - before
    # quantisation: each member's rounding error is at most rounding_bound / γ in L2
    bound = LR / expected_batch * MEMBERS * spec.rounding_bound / spec.scale
    assert np.linalg.norm(step_federated - step_central) <= bound + 1e-5
    assert np.linalg.norm(step_central) > 100 * bound  # the step is not lost in the bound


def test_poisson_sampling_has_the_rate_and_is_reproducible_only_with_a_seed() -> None:
    mask = poisson_sample(100_000, 0.25, b"seed")
    assert abs(mask.mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 100_000)
    np.testing.assert_array_equal(mask, poisson_sample(100_000, 0.25, b"seed"))
    assert not np.array_equal(poisson_sample(1000, 0.5), poisson_sample(1000, 0.5))
    with pytest.raises(ConfigError, match=r"sampling rate must be in \(0, 1\]"):
        poisson_sample(10, 0.0)


def test_an_empty_sample_contributes_zero_and_bad_inputs_are_refused() -> None:
    task = get_task("breast_cancer")
    data = task.load()
    model = task.build_model(0)
    before = flatten_params(model).copy()
    total, count = clipped_gradient_sum(
        model, data.x_train[:10], data.y_train[:10], np.zeros(10, dtype=bool), CLIP
    )
    assert count == 0 and not total.any()
    with pytest.raises(ConfigError, match="differ in length"):
        clipped_gradient_sum(model, data.x_train[:10], data.y_train[:9], np.ones(10, bool), CLIP)
    with pytest.raises(ConfigError, match="gradient has 3 values"):
        apply_gradient_sum(model, np.zeros(3), 1.0, torch.optim.SGD(model.parameters(), lr=1))
    np.testing.assert_array_equal(flatten_params(model), before)  # nothing changed
