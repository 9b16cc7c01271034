"""The auditor's reference for a round: what honest DP training on the control sample
looks like, derived from the control sample's per-sample gradients and the auditor's own
DP reference runs (:mod:`fedsec.audit.control` states the tests and their calibration).

A reference holds the control sample's clipped mean gradient ``ḡ``, its top principal
directions and their energies, the step scale of the declared training, and
:data:`REFERENCE_RUNS` honest runs, each with the reference built from the control
records it did not draw (:func:`build_reference`), so that the runs are scored as a
member's update is: on records they never trained on, after the member's rounding
(:func:`honest_run_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from torch.func import functional_call, grad, vmap

from fedsec.crypto.quantize import clip_l2
from fedsec.errors import ConfigError
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

FloatVec = npt.NDArray[np.float64]
#: A control sample's targets, by the task's schema: int64 class indices ``(n,)``, or
#: float32 regression values or multi-label labels ``(n, k)``.
Targets = npt.NDArray[np.int64] | npt.NDArray[np.float32]
#: The consortium's control sample ``(x, y)``.
ControlSample = tuple[npt.NDArray[np.float32], Targets]

#: Principal gradient directions used by the signal test.  Weights r/(1+r) decay fast, so
#: more components add little power; 100 keeps the SVD of the control gradients cheap.
SIGNAL_COMPONENTS: Final = 100
#: DP reference runs per (round, declared size): their median norm is the magnitude
#: test's reference (it varies by ~1 % between runs) and their scores are the expected
#: honest scores (:func:`honest_thresholds`), whose spread needs more than a few runs:
#: with 8 the sample standard deviation is within about ±27 % (one standard error).
REFERENCE_RUNS: Final = 8
#: Per-sample gradients are computed in chunks of this many records to bound memory.
GRADIENT_CHUNK: Final = 256


@dataclass(frozen=True)
class RoundTraining:
    """How the round asked members to train, and the quantization clip C."""

    params: TrainingParams
    dp: DPParams | None
    clip: float


@dataclass(frozen=True)
class Reference:
    """What the auditor derives once per round (and declared size) from the control sample."""

    round: int
    global_params: npt.NDArray[np.float32]
    mean_gradient: FloatVec  # mean clipped per-sample gradient ḡ at the global model
    basis: FloatVec  # (k, d) top right-singular vectors of the clipped gradients
    energies: FloatVec  # (k,) per-record second moment along each basis vector
    step_scale: float  # η_eff: how far the declared training moves along a gradient
    samples: int
    reference_norm: float  # median |Δ| of DP reference runs, capped at the clip
    loss_before: float
    # z_direction and z_signal of each run as a member would send it (honest_run_scores)
    honest_direction: tuple[float, ...] = ()
    honest_signal: tuple[float, ...] = ()
    honest_runs: tuple[HonestRun, ...] = ()  # the runs themselves, for the loss test
    seed: int = 0  # the reference runs' seed; also seeds their simulated rounding


@dataclass(frozen=True, eq=False)
class HonestRun:
    """One of the auditor's DP reference runs: its update, clipped to the quantization
    clip as a member's is, the control records it did not draw, and the reference
    built from those alone (the global model's loss on them in ``loss_before``)."""

    delta: npt.NDArray[np.float32]
    unseen: npt.NDArray[np.int64]
    scorer: Reference  # the unseen records' gradients and loss, which the run is scored on


# --- the reference -----------------------------------------------------------------------


def model_at(task: Task, flat: npt.NDArray[np.float32]) -> torch.nn.Module:
    model = task.build_model(0)
    load_flat_params(model, flat)
    return model


class _Bound(torch.nn.Module):
    """``model`` with its parameters replaced by ``params`` (:func:`functional_call`), for
    a task's batch step, which takes a module, under ``vmap``."""

    def __init__(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.inner = model
        self.params = params

    def forward(self, *args: Any) -> Any:
        return functional_call(self.inner, self.params, args)


def _clipped_gradients(
    task: Task,
    model: torch.nn.Module,
    x: npt.NDArray[np.float32],
    y: Targets,
    max_norm: float | None,
) -> FloatVec:
    """(n, d) per-sample gradients of the task's loss (its batch step where it declares
    one) in flatten_params order, clipped like DP-SGD: the gradients members clip."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        batch = (xi.unsqueeze(0), yi.unsqueeze(0))
        if task.batch_step is not None:
            return task.batch_step(_Bound(model, p), batch)
        return task.loss(functional_call(model, p, (batch[0],)), batch[1])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    rows: list[FloatVec] = []
    for start in range(0, len(y), GRADIENT_CHUNK):
        xb = torch.from_numpy(x[start : start + GRADIENT_CHUNK])
        yb = torch.from_numpy(y[start : start + GRADIENT_CHUNK])
        g = per_sample(params, xb, yb)
        flat = torch.cat([g[n].reshape(len(yb), -1) for n in names], dim=1)
        rows.append(flat.double().numpy())
    grads = np.concatenate(rows)
    if max_norm is not None:
        norms = np.linalg.norm(grads, axis=1)
        grads /= np.maximum(1.0, norms / max_norm)[:, None]
    return grads


def control_loss(
    task: Task, model: torch.nn.Module, x: npt.NDArray[np.float32], y: Targets
) -> float:
    """The task's loss (the batch mean, as members minimise it) of ``model`` on the
    control records ``(x, y)``.

    Raises:
        InvalidTask: the task's loss is not a 0-d floating tensor.
    """
    model.eval()
    with torch.no_grad():
        return float(task.batch_loss(model, (torch.from_numpy(x), torch.from_numpy(y))))


def _step_scale(training: RoundTraining, samples: int, steps: int, grads: FloatVec) -> float:
    """η_eff: the length of the declared training along a unit of mean gradient.

    SGD moves ``lr / (1 - momentum)`` per step.  Adam divides by √v, which under DP-SGD
    is dominated by the per-coordinate noise σC/B; without DP, by the gradients' own
    per-coordinate RMS at the expected batch size.
    """
    params = training.params
    if params.optimizer == "sgd":
        return params.lr * steps / (1.0 - params.momentum)
    sample_rate, _ = plan_round(samples, params)
    batch = max(1.0, samples * sample_rate)
    second = float(np.mean(grads**2)) / batch
    noise = (
        0.0
        if training.dp is None
        else (training.dp.noise_multiplier * training.dp.max_grad_norm / batch) ** 2
    )
    return params.lr * steps / math.sqrt(second + noise)


def _subset(rng: np.random.Generator, n_control: int, samples: int) -> npt.NDArray[np.int64]:
    # Drawn with replacement (a bootstrap sample): the reference must see the member's
    # batch geometry (sample rate, expected batch size) and, for the honest scores'
    # spread, a member's sampling variation, which a subset without replacement of a
    # control sample not much larger than the declared size would shrink; and the
    # records it does not draw (a share e^(−samples/N): 61 % for 200 of 400) measure the
    # honest loss change on unseen data.
    return np.sort(rng.choice(n_control, size=samples, replace=True)).astype(np.int64)


def _top_directions(grads: FloatVec, components: int) -> tuple[FloatVec, FloatVec]:
    """The top right-singular vectors of the (n, d) gradients, (k, d), and the
    per-record second moment along each, (k,): from the n x n Gram matrix (n records
    << d parameters, so this costs n²d rather than a full SVD's larger constant).
    Directions with no energy are left out."""
    eigenvalues, vectors = np.linalg.eigh(grads @ grads.T)
    order = np.argsort(eigenvalues)[::-1][: min(components, grads.shape[1])]
    order = order[eigenvalues[order] > eigenvalues.max(initial=0.0) * 1e-12]
    singular = np.sqrt(eigenvalues[order])
    basis = (vectors[:, order].T @ grads) / singular[:, None]
    return basis, singular**2 / grads.shape[0]


def _summarise(
    grads: FloatVec,
    training: RoundTraining,
    global_params: npt.NDArray[np.float32],
    samples: int,
    round: int,
    loss_before: float,
) -> Reference:
    """A reference's gradient part from clipped per-sample gradients (no runs yet)."""
    _, steps = plan_round(samples, training.params)
    basis, energies = _top_directions(grads, SIGNAL_COMPONENTS)
    return Reference(
        round=round,
        global_params=np.asarray(global_params, dtype=np.float32),
        mean_gradient=grads.mean(axis=0),
        basis=basis,
        energies=energies,
        step_scale=_step_scale(training, samples, steps, grads),
        samples=samples,
        reference_norm=0.0,
        loss_before=loss_before,
    )


def build_reference(
    task: Task,
    global_params: npt.NDArray[np.float32],
    training: RoundTraining,
    control: ControlSample,
    samples: int,
    round: int,
    seed: int,
    device: str = "cpu",
) -> Reference:
    """Derive the round's reference from the control sample (once per declared size).

    The auditor's own DP reference runs, each on a bootstrap sample of the declared
    size, set the magnitude reference and the expected honest scores.  Each is scored
    against the gradients of the control records it did not draw, so that, as with a
    member, its data shares no sampling error with them (scored against records it
    trained on, a run agrees with them by that error too and scores higher than any
    member could).  Those records are most of the sample (a share e^(−samples/N)), so
    the runs' scores err only slightly low: towards passing.  Their control loss
    change is measured on the same unseen records.

    Args:
        task: the federation's task.
        global_params: the flat parameters the round started from.
        training: the round's training settings and quantization clip.
        control: the consortium's control sample ``(x, y)``.
        samples: the declared record count the reference mimics.
        round: the round number (for the verdicts).
        seed: seeds the auditor's own reference runs.
        device: where the reference runs train.

    Raises:
        ConfigError: empty control sample or a non-positive sample count.
    """
    x, y = control
    if len(y) == 0 or samples < 1:
        raise ConfigError("a reference needs a non-empty control sample and samples >= 1")
    model = model_at(task, global_params)
    max_norm = None if training.dp is None else training.dp.max_grad_norm
    grads = _clipped_gradients(task, model, x, y, max_norm)
    reference = _summarise(
        grads, training, global_params, samples, round, control_loss(task, model, x, y)
    )
    rng = np.random.default_rng(seed)
    norms, runs = [], []
    for run in range(REFERENCE_RUNS):
        idx = _subset(rng, len(y), samples)
        delta, honest = _reference_run(
            task, reference, training, control, (model, grads), idx, device, seed * 1009 + run
        )
        norms.append(float(np.linalg.norm(delta)))
        runs.append(honest)
    return replace(
        reference,
        reference_norm=min(float(np.median(norms)), training.clip),
        honest_runs=tuple(runs),
        seed=seed,
    )


def _reference_run(
    task: Task,
    reference: Reference,
    training: RoundTraining,
    control: ControlSample,
    at_global: tuple[torch.nn.Module, FloatVec],
    idx: npt.NDArray[np.int64],
    device: str,
    seed: int,
) -> tuple[FloatVec, HonestRun]:
    """One DP reference run on the control records ``idx``: its update, and the run as
    kept (clipped as a member's update is, with the reference of the records it did
    not draw as its scorer; the whole sample's when it drew nearly all of them).
    ``at_global``: the global model and the control sample's clipped gradients at it,
    built once per reference."""
    x, y = control
    start, grads = at_global
    model = model_at(task, reference.global_params)
    train_local(model, x[idx], y[idx], training.params, training.dp, device, seed, task=task)
    delta = (flatten_params(model) - reference.global_params).astype(np.float64)
    unseen = np.setdiff1d(np.arange(len(y)), idx).astype(np.int64)
    scorer = reference
    if len(unseen) > 1:
        before = control_loss(task, start, x[unseen], y[unseen])
        scorer = _summarise(
            grads[unseen], training, reference.global_params, reference.samples,
            reference.round, before,
        )  # fmt: skip
    return delta, HonestRun(clip_l2(delta, training.clip), unseen, scorer)


def _rounded_like_a_member(
    reference: Reference, run: int, honest: HonestRun, step: float
) -> npt.NDArray[np.float32]:
    """A reference run's update after the stochastic rounding a member's revealed update
    carries (``step`` wide, in update units).  The draws come from the auditor's own
    generator, seeded by the reference: they simulate, they protect nothing."""
    if step <= 0.0:
        return honest.delta
    rng = np.random.default_rng([reference.seed, run, int(reference.round)])
    # the member's grid: an odd number of levels spans [-C, C], so zero lies midway
    # between two points, at odd multiples of step/2
    uniform = rng.random(honest.delta.size)
    grid = np.floor(honest.delta / step - 0.5 + uniform) + 0.5
    return (grid * step).astype(np.float32)


def honest_run_scores(
    task: Task,
    reference: Reference,
    control: ControlSample | None,
    step: float,
) -> tuple[Reference, tuple[float, ...]]:
    """The reference runs scored as a member's update is: after the member's rounding
    (``step`` wide, in update units), which adds white noise and so lowers the signal
    scores and raises the control loss, more as the model sharpens.

    Returns:
        ``reference`` with ``honest_direction``/``honest_signal`` set to the rounded
        runs' scores, and each run's control-loss change on the records it did not
        draw (empty without ``control``).
    """
    direction, signal, losses = [], [], []
    for run, honest in enumerate(reference.honest_runs):
        rounded = _rounded_like_a_member(reference, run, honest, step)
        scores = signal_scores(honest.scorer, rounded.astype(np.float64))
        direction.append(scores["z_direction"])
        signal.append(scores["z_signal"])
        if control is not None and len(honest.unseen) > 1:
            x, y = control
            after = model_at(task, (reference.global_params + rounded).astype(np.float32))
            loss = control_loss(task, after, x[honest.unseen], y[honest.unseen])
            losses.append(loss - honest.scorer.loss_before)
    if not reference.honest_runs:
        return reference, ()
    scored = replace(reference, honest_direction=tuple(direction), honest_signal=tuple(signal))
    return scored, tuple(losses)


def _noise_var(basis: FloatVec, u: FloatVec) -> float:
    """Per-coordinate variance of ``u`` outside the gradient subspace: its white noise."""
    coords = basis @ u
    outside = max(float(u @ u) - float(coords @ coords), 0.0)
    return outside / max(u.size - coords.size, 1)


def _signal_ratios(reference: Reference, noise_var: float) -> FloatVec:
    """r_j: expected honest signal energy along v_j over the noise variance.

    An honest step's energy along v_j: the mean gradient's share (ḡ·v_j)² in full, plus
    the record-to-record spread (λ_j − (ḡ·v_j)²) averaged over the declared records.
    """
    mean_part = (reference.basis @ reference.mean_gradient) ** 2
    spread_part = np.maximum(reference.energies - mean_part, 0.0) / reference.samples
    ratio: FloatVec = reference.step_scale**2 * (mean_part + spread_part) / noise_var
    return ratio


def signal_scores(reference: Reference, u: FloatVec) -> dict[str, float]:
    """z_dir, z_quad and their combination (see module docstring)."""
    coords = reference.basis @ u
    noise_var = _noise_var(reference.basis, u)
    if noise_var <= 0.0:
        # u lies entirely in the gradient subspace: no white noise at all, which neither
        # DP training nor quantization produces; score it as overwhelming signal.
        noise_var = 1e-30
    gnorm = float(np.linalg.norm(reference.mean_gradient))
    z_dir = 0.0
    if gnorm > 0.0:
        z_dir = float(-(u @ reference.mean_gradient) / gnorm) / math.sqrt(noise_var)
    ratio = _signal_ratios(reference, noise_var)
    weights = ratio / (1.0 + ratio)
    spread = math.sqrt(2.0 * float(weights @ weights))
    z_quad = 0.0
    if spread > 0.0:
        z_quad = (float(weights @ (coords**2)) / noise_var - float(weights.sum())) / spread
    return {
        "z_direction": z_dir,
        "z_energy": z_quad,
        "z_signal": (z_dir + z_quad) / math.sqrt(2.0),
        "noise_rms": math.sqrt(noise_var),
    }
