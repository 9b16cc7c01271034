"""Server optimisers: the pure rules of fedsec.learning and the aggregator's persisted state.

The aggregator and the auditor both step models with :func:`server_step`; these tests
pin its arithmetic to the formulas every published model version was computed with
(so no model hash in an existing log changes) and show that the aggregator's state
store round-trips FedAdam's moments bit for bit across a restart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsec.aggregator.optimizers import make_optimizer
from fedsec.aggregator.storage.sqlite import SqliteStateStore
from fedsec.config import ServerSection
from fedsec.learning.optimizers import (
    AdamMoments,
    FedAdam,
    FedAvg,
    server_rule,
    server_step,
)

DIM = 257
ADAM = FedAdam(server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)


def _vectors(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=DIM).astype(np.float32) for _ in range(count)]


def _reference_fedadam(
    current: np.ndarray, mean: np.ndarray, m: np.ndarray, v: np.ndarray, rule: FedAdam
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FedAdam as the aggregator and the auditor each computed it before fedsec.learning."""
    b1, b2, lr, tau = rule.beta1, rule.beta2, rule.server_lr, rule.tau
    m = (b1 * m + (1 - b1) * mean).astype(np.float32)
    v = (b2 * v + (1 - b2) * mean**2).astype(np.float32)
    return (current + lr * m / (np.sqrt(v) + tau)).astype(np.float32), m, v


def test_fedavg_is_params_plus_lr_times_mean_in_float32() -> None:
    current, mean = _vectors(0, 2)
    new, state = server_step(FedAvg(0.7), current, mean, None)
    assert new.dtype == np.float32
    assert np.array_equal(new, (current + np.float32(0.7) * mean).astype(np.float32))
    assert state is None
    assert np.array_equal(server_step(FedAvg(1.0), current, mean, None)[0], current + mean)


def test_fedadam_matches_the_published_formula_over_rounds() -> None:
    current, *means = _vectors(1, 4)
    state: AdamMoments | None = None
    ref, m, v = current, np.zeros(DIM, np.float32), np.zeros(DIM, np.float32)
    for mean in means:
        current, state = server_step(ADAM, current, mean, state)
        ref, m, v = _reference_fedadam(ref, mean, m, v, ADAM)
        assert state is not None
        assert np.array_equal(current, ref)
        assert np.array_equal(state.m, m) and np.array_equal(state.v, v)
        assert current.dtype == state.m.dtype == state.v.dtype == np.float32


def test_fedadam_refuses_moments_of_another_dimension() -> None:
    current, mean = _vectors(2, 2)
    before = AdamMoments.zeros(DIM - 1)
    with pytest.raises(ValueError, match="moments"):
        server_step(ADAM, current, mean, before)
    assert not before.m.any() and not before.v.any()


def test_server_rule_names_the_configured_optimiser() -> None:
    assert server_rule("fedavg", 1.0, 0.9, 0.99, 1e-3) == FedAvg(1.0)
    assert server_rule("fedadam", 0.01, 0.9, 0.99, 1e-3) == ADAM


def _config(optimizer: str) -> ServerSection:
    return ServerSection(optimizer=optimizer, server_lr=ADAM.server_lr)


def test_aggregator_fedadam_resumes_its_moments_after_a_restart(tmp_path: Path) -> None:
    current, *means = _vectors(3, 3)
    store = SqliteStateStore(tmp_path / "state.db")
    optimizer = make_optimizer(_config("fedadam"), DIM, store)
    after_one = optimizer.step(current, means[0])
    optimizer.save()
    store.close()

    reopened = SqliteStateStore(tmp_path / "state.db")
    resumed = make_optimizer(_config("fedadam"), DIM, reopened)
    after_two = resumed.step(after_one, means[1])
    reopened.close()

    expected, state = server_step(ADAM, current, means[0], None)
    expected, state = server_step(ADAM, expected, means[1], state)
    assert np.array_equal(after_one, server_step(ADAM, current, means[0], None)[0])
    assert np.array_equal(after_two, expected)


def test_aggregator_ignores_stored_moments_of_another_model(tmp_path: Path) -> None:
    current, mean = _vectors(4, 2)
    store = SqliteStateStore(tmp_path / "state.db")
    small = make_optimizer(_config("fedadam"), DIM - 1, store)
    small.step(current[:-1], mean[:-1])
    small.save()
    fresh = make_optimizer(_config("fedadam"), DIM, store)
    assert np.array_equal(fresh.step(current, mean), server_step(ADAM, current, mean, None)[0])
    store.close()


def test_aggregator_fedavg_keeps_no_state(tmp_path: Path) -> None:
    current, mean = _vectors(5, 2)
    store = SqliteStateStore(tmp_path / "state.db")
    optimizer = make_optimizer(_config("fedavg"), DIM, store)
    expected, _ = server_step(FedAvg(0.01), current, mean, None)
    assert np.array_equal(optimizer.step(current, mean), expected)
    optimizer.save()
    assert store.values.get("fedadam.m") is None and store.values.get("fedadam.v") is None
    store.close()
