"""Control-sample checks: an honest DP update passes; lazy, replayed and poisoned ones fail;
a control sample file that does not fit the task is refused with the difference named."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsec.audit.control import (
    MAGNITUDE_BAND,
    MemberClaim,
    Reference,
    RevealedUpdate,
    RoundTraining,
    Verdict,
    build_reference,
    check_update,
    honest_run_scores,
    load_control_sample,
)
from fedsec.crypto.quantize import QuantSpec, quantize
from fedsec.errors import TaskMismatch
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.tasks import get_task
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

TASK = get_task("mnist1d")
PARAMS = TrainingParams(lr=0.05, batch_size=20, local_epochs=3, optimizer="sgd")
# Less noise and more records than the benchmark, so a single fixed-seed update carries
# an unmistakable signal and the test does not sit near a threshold.
DP = DPParams(noise_multiplier=0.6, max_grad_norm=1.0, delta=1e-5)
SAMPLES = 400


@dataclass(frozen=True)
class Setup:
    task: Task
    training: RoundTraining
    spec: QuantSpec
    reference: Reference
    control: tuple[np.ndarray, np.ndarray]
    honest: np.ndarray
    claim: MemberClaim


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = TASK.load()
        # the whole test split, as the audit's calibration used: with 400 records the
        # sample's own error hides the mean gradient at the initial model, and the
        # signal and direction tests are relaxed
        control = (data.x_test, data.y_test)
        global_params = flatten_params(TASK.build_model(0))
        model = TASK.build_model(0)
        train_local(model, data.x_train[:SAMPLES], data.y_train[:SAMPLES], PARAMS, DP, "cpu", 1)
        honest = flatten_params(model) - global_params
        clip = 2.5 * float(np.linalg.norm(honest))
        training = RoundTraining(PARAMS, DP, clip)
        reference = build_reference(TASK, global_params, training, control, SAMPLES, 2, seed=7)
        steps = plan_round(SAMPLES, PARAMS)[1]
        yield Setup(
            TASK,
            training,
            QuantSpec(8, clip, 12),
            reference,
            control,
            honest,
            MemberClaim("alice", 2, SAMPLES, steps),
        )
    finally:
        torch.set_num_threads(threads)


def _reveal(
    s: Setup, delta: np.ndarray, round: int = 2, weight: float = 1.0, seed: bytes | None = None
) -> RevealedUpdate:
    """``delta`` as member alice reveals it; ``seed``: its rounding seed (None: fresh)."""
    q = quantize(delta, weight, s.spec, os.urandom(32) if seed is None else seed)
    return RevealedUpdate.from_quantized("alice", round, q, s.spec)


def _check(
    s: Setup, revealed: RevealedUpdate, history: list[RevealedUpdate] | None = None
) -> Verdict:
    return check_update(
        s.task, s.reference, s.training, s.claim, revealed, history or [], s.control
    )


def test_honest_update_passes(setup: Setup) -> None:
    verdict = _check(setup, _reveal(setup, setup.honest, weight=0.8))
    assert verdict.passed, verdict
    assert verdict.failed == ()
    assert verdict.scores["z_direction"] > 0
    assert 0.8 < verdict.scores["norm_ratio"] < 1.25


def test_zero_update_fails(setup: Setup) -> None:
    verdict = _check(setup, _reveal(setup, np.zeros_like(setup.honest)))
    assert not verdict.passed
    # A zero update reaches the auditor as stochastic-rounding noise from a fresh seed;
    # the signal test lets pure noise through with probability P(z > SIGNAL_MIN_Z)
    # (about 0.6 %), so only the magnitude test is certain to catch it.
    assert "magnitude" in verdict.failed
    assert verdict.scores["norm_ratio"] < MAGNITUDE_BAND[0]  # too small, not too large


def test_noise_update_fails(setup: Setup) -> None:
    z = np.random.default_rng(3).standard_normal(setup.honest.size)
    noise = z * (np.linalg.norm(setup.honest) / np.linalg.norm(z))
    verdict = _check(setup, _reveal(setup, noise))
    assert "signal" in verdict.failed


def test_signflip_fails(setup: Setup) -> None:
    verdict = _check(setup, _reveal(setup, -setup.honest))
    assert "direction" in verdict.failed


def test_scaled_update_fails_after_clipping(setup: Setup) -> None:
    verdict = _check(setup, _reveal(setup, 10 * setup.honest))
    assert verdict.failed == ("magnitude",)
    assert verdict.scores["norm_ratio"] > 2.0  # clipped to C = 2.5x the honest norm


def test_replay_fails(setup: Setup) -> None:
    earlier = _reveal(setup, setup.honest, round=1)
    verdict = _check(setup, _reveal(setup, setup.honest), [earlier])
    assert verdict.failed == ("replay",)
    assert verdict.scores["replay_cosine"] > 0.5
    # the same update from a *later* round is not evidence of a replay
    later = replace(earlier, round=3)
    assert _check(setup, _reveal(setup, setup.honest), [later]).passed


def test_wrong_claim_and_zero_weight_fail(setup: Setup) -> None:
    lying = replace(setup.claim, steps=setup.claim.steps + 1)
    verdict = check_update(
        setup.task, setup.reference, setup.training, lying, _reveal(setup, setup.honest)
    )
    assert verdict.failed == ("claim",)
    weightless = _reveal(setup, setup.honest, weight=0.0)
    assert "weight" in _check(setup, weightless).failed


def test_a_weight_above_what_the_declared_statistics_give_is_caught(setup: Setup) -> None:
    # the member declared records worth a weight of 0.4 (volume, capped) but committed
    # an update weighted 1.0: it would pull the sum 2.5 times harder than it may
    declared = replace(setup.claim, weight_cap=0.4)
    forged = check_update(
        setup.task, setup.reference, setup.training, declared,
        _reveal(setup, setup.honest, weight=1.0), [], setup.control,
    )  # fmt: skip
    assert _deterministic(forged) == {"weight"}
    assert forged.scores["weight"] == pytest.approx(1.0) and forged.scores["weight_cap"] == 0.4
    # the declared weight passes (within its rounding step of 1/255), a lower one too
    # (much lower weights fail magnitude: quantization noise of Δ grows as 1/w)
    for weight in (0.4, 0.38):
        honest = check_update(
            setup.task, setup.reference, setup.training, declared,
            _reveal(setup, setup.honest, weight=weight), [], setup.control,
        )  # fmt: skip
        assert not _deterministic(honest), (weight, honest)
    # with the exact quality weight known, a lowered one no longer matches
    exact = replace(setup.claim, weight_cap=0.4, weight=0.3)
    lowered = check_update(
        setup.task, setup.reference, setup.training, exact,
        _reveal(setup, setup.honest, weight=0.38), [], setup.control,
    )  # fmt: skip
    assert _deterministic(lowered) == {"weight"}


#: The tests that judge one DP-noised update against honest statistics: an honest
#: update fails one now and then (the fixture's update is trained with noise from a
#: CSPRNG, which no seed fixes, and each reveal is rounded afresh).
STATISTICAL = frozenset({"signal", "direction", "loss"})


def _deterministic(verdict: Verdict) -> set[str]:
    """The failed tests that no honest update fails by chance."""
    return set(verdict.failed) - STATISTICAL


def test_reference_is_unchanged_by_checks(setup: Setup) -> None:
    before = setup.reference.global_params.copy()
    _check(setup, _reveal(setup, -setup.honest))
    assert np.array_equal(before, setup.reference.global_params)
    model = TASK.build_model(0)
    load_flat_params(model, before)  # still a valid parameter vector


# --- control sample files ------------------------------------------------------------


def test_load_control_sample(tmp_path: Path) -> None:
    path = tmp_path / "control.npz"
    x = np.zeros((5, 1, 40), dtype=np.float64)
    y = np.array([0, 1, 2, 3, 9], dtype=np.int32)
    np.savez(path, x=x, y=y)
    cx, cy = load_control_sample(path, TASK)
    assert cx.dtype == np.float32 and cy.dtype == np.int64
    assert cx.shape == (5, 1, 40) and list(cy) == [0, 1, 2, 3, 9]


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((5, 1, 40), np.float32)}, r"lacks array\(s\) \['y'\]"),
        ({"x": np.zeros((5, 40), np.float32), "y": np.zeros(5, np.int64)}, "x has shape"),
        ({"x": np.zeros((5, 1, 40), np.float32), "y": np.zeros(4, np.int64)}, "y has shape"),
        ({"x": np.zeros((2, 1, 40), np.float32), "y": np.array([0, 10])}, r"labels span 0\.\.10"),
        ({"x": np.zeros((2, 1, 40), np.int64), "y": np.array([0, 1])}, "x has dtype int64"),
        ({"x": np.zeros((2, 1, 40), np.float32), "y": np.array([0.0, 1.0])}, "y has dtype"),
        ({"x": np.full((2, 1, 40), np.nan, np.float32), "y": np.array([0, 1])}, "NaN"),
    ],
)
def test_control_sample_mismatch_refused(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = tmp_path / "control.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(TaskMismatch, match=message) as info:
        load_control_sample(path, TASK)
    assert str(path) in info.value.detail


def test_control_sample_with_pickled_objects_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(TaskMismatch, match="without pickles"):
        load_control_sample(path, TASK)


def test_control_sample_not_a_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.npz"
    with pytest.raises(TaskMismatch, match=r"missing\.npz"):
        load_control_sample(path, TASK)


def test_the_loss_test_tolerates_the_rise_the_members_rounding_adds(setup: Setup) -> None:
    """The reference runs' loss changes are taken after rounding as coarse as the
    member's: a member with a small weight (a wide step in update units) is allowed the
    larger rise its rounding noise causes, not judged against unrounded runs."""
    ref, control = setup.reference, setup.control
    assert len(ref.honest_runs) > 1
    fine = honest_run_scores(setup.task, ref, control, 0.0)[1]
    assert honest_run_scores(setup.task, ref, control, 0.0)[1] == fine  # deterministic
    # at this untrained model only coarse rounding moves the loss: weight 0.02, 50x the step
    coarse = honest_run_scores(setup.task, ref, control, setup.spec.step() / 0.02)[1]
    assert np.mean(coarse) > np.mean(fine) + 0.01, (coarse, fine)
    # A fixed rounding seed: the tolerance is μ + 3 s of the reference runs, which an
    # honest update at this weight exceeds about once in a hundred draws (6 of 600 fresh
    # seeds), so a fresh seed would fail this test at that rate.
    verdict = _check(setup, _reveal(setup, setup.honest, weight=0.02, seed=bytes(32)))
    assert verdict.scores["loss_max_increase"] >= np.mean(coarse)
    assert "loss" not in verdict.failed, verdict
