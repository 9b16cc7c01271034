"""Control-sample checks: did a revealed update come from honest DP training on real data?

For a challenged (member, round) the auditor holds the revealed update ``u = Δ``
(dequantized, divided by the weight), the global model the round started from, the
round's training settings and a *control sample*: records from the task's
distribution that no member trains on.  From the control sample at the global model
it derives a :class:`Reference`: the per-sample gradients, clipped as DP-SGD clips
them, summarised by their mean ``ḡ`` and their top principal directions ``v_j``.

Why gradients and not only a reference training run: under DP-SGD the Gaussian noise
dominates one member's update (on MNIST-1D with 200 records at ε = 8 over 5 rounds
the noise is ~10x the signal in L2 norm, so an honest update's cosine with any
reference is only ~0.04-0.1; see the calibration notes below).  An update is
``signal + white noise``; the only evidence of honest training is the signal, which
lives where real gradients live.  So the checks are hypothesis tests against white
noise with a known null distribution:

* **direction** ``z_dir = <u, -ḡ/|ḡ|> / σ̂``: N(0, 1) for noise, positive for a real
  descent step, negative for a flipped one (σ̂ is the per-coordinate noise level of
  ``u``, measured outside the gradient subspace, so it includes quantization noise);
* **signal** ``z_sig``: the weighted energy of ``u`` in the top gradient directions
  (weights ``r_j / (1 + r_j)``, the Neyman-Pearson weights for a Gaussian signal of
  expected variance ``r_j σ̂²`` along ``v_j``), standardised under the white-noise null,
  combined with ``z_dir``.  Zero, pure-noise and random updates score ~0;
* **loss**: the control loss after applying Δ must not rise by more than a tolerance
  (DP noise makes honest steps near loss-neutral, so this catches gross poisoning);
* **magnitude**: ``|Δ|`` (quantization noise removed) over the norm of DP reference
  runs the auditor trains from the same global model on control subsets of the
  declared size, with the round's settings; DP noise makes the honest norm nearly
  deterministic (±1 % here), so a scaled update is caught while clipping leaves room;
* **replay**: cosine with the member's and others' earlier revealed updates; fresh DP
  noise makes honest updates of different rounds nearly orthogonal (|cos| < 0.07).

Calibration (``fedsec bench audit --trials 6``, MNIST-1D, 20 members x 200 records,
5 rounds, full-batch DP-SGD: SGD lr 0.3, batch 200, 10 local epochs = 10 steps, DP
max_grad_norm 1.0, 8-bit quantization, C = 2.5x the honest norm): at eps 8 (noise
multiplier 4.51) every attack was caught (TPR 1.0 on 18-30 pairs each) at FPR
2/480 = 0.4 %; at eps 3 (noise multiplier 10.6) the signal test no longer separates
honest from noise (FPR 69 %), while replay, scale and zero remain detectable.  The
training recipe matters: at batch 20 (50 steps, noise multiplier 1.28 for eps 8) the
weakest honest first-round updates scored z ~ 0.4-2 and FPR was 3.1 %, because at a
fixed eps a larger batch buys more signal per unit of noise (see fedsec.bench.audit).
The numbers behind each threshold are next to it.

Those fixed thresholds hold where one honest update shows its signal.  With more noise
per round (ε 8 spent over 15 rounds: noise multiplier 7.4) honest scores fall towards the
null and the fixed signal threshold failed about half the honest updates of a round, so
automatic quarantine removed nearly every honest member.  The signal, direction and loss
thresholds are therefore set per round from the round's own noise
(:func:`honest_thresholds`): the auditor's DP reference runs are honest updates of that
round, and a test fails an update only where an honest one would score that low with
probability about Φ(−:data:`HONEST_MARGIN_Z`).  Where the noise drowns one update's
signal, the signal and direction tests stop failing anyone rather than fail the honest;
magnitude (the DP noise makes the honest norm nearly deterministic), weight and replay
still catch zero, scaled and sign-flipped (−4Δ) updates there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedsec.crypto.quantize import QuantSpec, RingVector, clip_l2, dequantize_one
from fedsec.errors import ConfigError, TaskMismatch
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

__all__ = [
    "DIRECTION_MIN_Z",
    "HONEST_MARGIN_Z",
    "LOSS_MAX_INCREASE",
    "MAGNITUDE_BAND",
    "REPLAY_MAX_COSINE",
    "SIGNAL_MIN_Z",
    "MemberClaim",
    "Reference",
    "RevealedUpdate",
    "RoundTraining",
    "Verdict",
    "build_reference",
    "check_update",
    "honest_thresholds",
    "load_control_sample",
]

FloatVec = npt.NDArray[np.float64]

# --- thresholds (calibrated; see the module docstring and fedsec.bench.audit) -------------

#: Minimum combined signal z-score.  Under white noise it is ~N(0, 1) (slightly right
#: skewed), so 2.5 passes ~0.6 % of zero/noise updates.  Calibration at eps 8 (6 trials,
#: 480 honest pairs): honest min 1.30 / 1st percentile 3.42 / median 10.3 (2 of 480 below
#: 2.5); zero and noise max 1.95.  At eps 3 the honest median is only 1.9: the per-round
#: signal is below what one update can show.
SIGNAL_MIN_Z: Final = 2.5
#: Minimum descent-direction z-score.  0 splits honest (median +5.2 at eps 8, min +0.11,
#: none of 480 below 0) from sign-flipped updates (median -4.2, max -0.09): a flipped
#: update is the mirror image of an honest one, so the threshold sits in the middle.
DIRECTION_MIN_Z: Final = 0.0
#: Largest tolerated rise of the control loss (nats) when Δ is applied.  Honest DP steps
#: moved it by -0.07..+0.014 at eps 8 (max +0.06 at eps 3, 26 of 480 above 0.02); a
#: clipped scaled step raised it by 0.04-0.63 at eps 3.  DP noise dominates one update,
#: so this is a backstop.
LOSS_MAX_INCREASE: Final = 0.02
#: Accepted ratio |Δ| / median |reference DP update|.  Honest ratios fell in 0.955-1.048
#: (DP noise makes the norm nearly deterministic); zero updates 0.40-0.41, scaled ones
#: clipped to C = 2.5x honest gave 2.42-2.53.
MAGNITUDE_BAND: Final = (0.8, 1.25)
#: Cosine at which an update counts as a copy of an earlier one.  Honest updates had
#: cos <= 0.07 with every earlier update; a re-quantized replay >= 0.75, an exact one 1.0.
REPLAY_MAX_COSINE: Final = 0.5
#: How many honest standard deviations below the expected honest score the signal and
#: direction tests may fail an update (:func:`honest_thresholds`).  Φ(−3) ≈ 0.13 % per
#: test with the spread known; 3 rather than 2.5 because the spread is estimated from
#: :data:`REFERENCE_RUNS` runs (if under-estimated by 27 %, Φ(−2.2) ≈ 1.4 %).
HONEST_MARGIN_Z: Final = 3.0
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

TEST_NAMES: Final = ("claim", "weight", "signal", "direction", "loss", "magnitude", "replay")


@dataclass(frozen=True)
class RoundTraining:
    """How the round asked members to train, and the quantization clip C."""

    params: TrainingParams
    dp: DPParams | None
    clip: float


@dataclass(frozen=True)
class MemberClaim:
    """What a member declared for the round: record count and DP-SGD steps, and the
    weight its declared statistics allow (``fedsec.protocol.weights``).

    ``weight_cap``: the most its signed record count gives (volume, capped by the
    roster); ``weight``: the exact quality weight, when its signed data summary is known.
    None skips that part of the ``weight`` test.
    """

    member: str
    round: int
    samples: int
    steps: int
    weight_cap: float | None = None
    weight: float | None = None


@dataclass(frozen=True)
class RevealedUpdate:
    """One member's revealed update as (w·Δ, w), with its quantization step."""

    member: str
    round: int
    weighted_delta: FloatVec
    weight: float
    quant_step: float
    weight_step: float = 0.0  # the weight's rounding step, 1 / levels

    @classmethod
    def from_quantized(
        cls, member: str, round: int, quantized: RingVector, spec: QuantSpec
    ) -> RevealedUpdate:
        """Dequantize a revealed ring vector (weight last)."""
        weighted, weight = dequantize_one(quantized, spec)
        return cls(member, round, weighted, weight, spec.step(), 1.0 / spec.levels)

    def delta(self) -> FloatVec | None:
        """Δ = (w·Δ) / w, or None for a zero weight."""
        if self.weight <= 0.0:
            return None
        return self.weighted_delta / self.weight


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
    honest_direction: tuple[float, ...] = ()  # z_direction of each of those runs
    honest_signal: tuple[float, ...] = ()  # z_signal of each
    honest_shrink: float = 1.0  # ρ: a member's expected score over a run's (in-sample bias)
    honest_runs: tuple[HonestRun, ...] = ()  # the runs themselves, for the loss test
    seed: int = 0  # the reference runs' seed; also seeds their simulated rounding


@dataclass(frozen=True, eq=False)
class HonestRun:
    """One of the auditor's DP reference runs: its update, clipped to the quantization
    clip as a member's is, the control records it did not draw, and the global model's
    loss on those."""

    delta: npt.NDArray[np.float32]
    unseen: npt.NDArray[np.int64]
    loss_before: float


@dataclass(frozen=True)
class Verdict:
    """Pass/fail for one (member, round) with every score and the failed tests."""

    member: str
    round: int
    passed: bool
    failed: tuple[str, ...]
    scores: dict[str, float] = field(default_factory=dict)


# --- control sample --------------------------------------------------------------------


def load_control_sample(
    path: str | Path, task: Task
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Read a control sample ``.npz`` with arrays ``x`` and ``y`` and check it fits ``task``.

    Returns:
        ``(x, y)`` as float32 features and int64 labels.

    Raises:
        TaskMismatch: unreadable file, missing arrays, or shape/dtype/classes that differ
            from the task's schema; the message names the file and the difference.
    """
    where = f"control sample {path}"
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = sorted({"x", "y"} - names)
            if missing:
                raise TaskMismatch(f"{where} lacks array(s) {missing}; found {sorted(names)}")
            x = np.asarray(archive["x"])
            y = np.asarray(archive["y"])
    except (OSError, ValueError) as exc:
        raise TaskMismatch(f"{where} cannot be read as .npz without pickles: {exc}") from None
    schema = task.schema
    if x.dtype.kind != "f":
        raise TaskMismatch(f"{where}: x has dtype {x.dtype}, expected floating point features")
    if y.dtype.kind not in "iu":
        raise TaskMismatch(f"{where}: y has dtype {y.dtype}, expected integer class indices")
    if x.ndim < 1 or tuple(x.shape[1:]) != schema.input_shape:
        raise TaskMismatch(
            f"{where}: x has shape {x.shape}, task '{task.name}' expects (n, *{schema.input_shape})"
        )
    if y.shape != (x.shape[0],):
        raise TaskMismatch(f"{where}: y has shape {y.shape}, expected ({x.shape[0]},)")
    if x.shape[0] == 0:
        raise TaskMismatch(f"{where} holds no records")
    if not np.all(np.isfinite(x)):
        raise TaskMismatch(f"{where}: x contains NaN or infinite values")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= schema.num_classes:
        raise TaskMismatch(
            f"{where}: labels span {lo}..{hi}, task '{task.name}' has classes "
            f"0..{schema.num_classes - 1}"
        )
    return np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64)


# --- the reference -----------------------------------------------------------------------


def _model_at(task: Task, flat: npt.NDArray[np.float32]) -> torch.nn.Module:
    model = task.build_model(0)
    load_flat_params(model, flat)
    return model


def _clipped_gradients(
    model: torch.nn.Module,
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    max_norm: float | None,
) -> FloatVec:
    """(n, d) per-sample gradients in flatten_params order, clipped like DP-SGD."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

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


def _control_loss(
    model: torch.nn.Module, x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]
) -> float:
    model.eval()
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))


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


def _in_sample_shrink(grads: FloatVec) -> float:
    """ρ: how much of the control sample's mean gradient a member's data shares.

    A run trained on records drawn from the control sample agrees with its mean
    gradient ḡ by the sample's own sampling error e as well: E⟨ḡ_run, ḡ⟩ = |ḡ|², where
    a member's independent data gives ⟨μ, ḡ⟩ ≈ |ḡ|² − tr Σ / N (μ the population mean,
    Σ the per-record covariance, N records).  Displacement along ḡ is linear in that
    agreement, so a member's expected score is the run's times
    ρ = max(0, 1 − tr Σ / (N |ḡ|²)), the positive-part James-Stein estimate.  It errs
    low, towards passing: a control sample drawn without replacement from a balanced
    test split has less sampling error than N independent records would.  Measured at
    noise multiplier 7.4 (400 control records): members scored 0.45-0.55 of the runs'
    z_direction in rounds 1, 3 and 12, where ρ came out 0.0, 0.11 and 0.06.
    """
    mean = grads.mean(axis=0)
    signal = float(mean @ mean)
    if signal <= 0.0:
        return 0.0
    spread = float(np.mean(np.einsum("ij,ij->i", grads, grads))) - signal
    return max(0.0, 1.0 - spread / (len(grads) * signal))


def build_reference(
    task: Task,
    global_params: npt.NDArray[np.float32],
    training: RoundTraining,
    control: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]],
    samples: int,
    round: int,
    seed: int,
    device: str = "cpu",
) -> Reference:
    """Derive the round's reference from the control sample (once per declared size).

    The auditor's own DP reference runs, each on a bootstrap sample of the declared
    size drawn from the control sample, set the magnitude reference and the expected
    honest scores (:func:`honest_thresholds`).  They are scored against the control
    sample's gradients, which contain their own records; :func:`_in_sample_shrink`
    takes out what that shared sampling error adds to their scores.  Their control
    loss change is measured on the records each run did not draw, so it is an honest
    step's change on unseen data, as a member's is.

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
    model = _model_at(task, global_params)
    max_norm = None if training.dp is None else training.dp.max_grad_norm
    grads = _clipped_gradients(model, x, y, max_norm)
    reference = _summarise(
        grads, training, global_params, samples, round, _control_loss(model, x, y)
    )
    rng = np.random.default_rng(seed)
    norms, direction, signal, runs = [], [], [], []
    for run in range(REFERENCE_RUNS):
        ref_model = _model_at(task, global_params)
        idx = _subset(rng, len(y), samples)
        train_local(
            ref_model, x[idx], y[idx], training.params, training.dp, device, seed * 1009 + run
        )
        delta = (flatten_params(ref_model) - global_params).astype(np.float64)
        norms.append(float(np.linalg.norm(delta)))
        scores = _signal_scores(reference, delta)
        direction.append(scores["z_direction"])
        signal.append(scores["z_signal"])
        unseen = np.setdiff1d(np.arange(len(y)), idx)
        if len(unseen):
            before = _control_loss(model, x[unseen], y[unseen])
            runs.append(HonestRun(clip_l2(delta, training.clip), unseen.astype(np.int64), before))
    return replace(
        reference,
        reference_norm=min(float(np.median(norms)), training.clip),
        honest_direction=tuple(direction),
        honest_signal=tuple(signal),
        honest_shrink=_in_sample_shrink(grads),
        honest_runs=tuple(runs),
        seed=seed,
    )


def honest_loss_changes(
    task: Task,
    reference: Reference,
    control: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]],
    step: float,
) -> tuple[float, ...]:
    """Each reference run's control-loss change on the records it did not draw, after
    the stochastic rounding a member's revealed update carries (``step`` wide, in update
    units): the loss test compares like with like, since rounding noise raises the loss
    too, and more as the model sharpens.  The rounding draws come from the auditor's
    own generator (seeded by the reference): they simulate, they protect nothing.
    """
    x, y = control
    changes = []
    for run, honest in enumerate(reference.honest_runs):
        rng = np.random.default_rng([reference.seed, run, int(reference.round)])
        rounded = honest.delta
        if step > 0.0:
            # the member's grid: an odd number of levels spans [-C, C], so zero lies
            # midway between two points, at odd multiples of step/2
            uniform = rng.random(honest.delta.size)
            grid = np.floor(honest.delta / step - 0.5 + uniform) + 0.5
            rounded = (grid * step).astype(np.float32)
        after = _model_at(task, (reference.global_params + rounded).astype(np.float32))
        loss = _control_loss(after, x[honest.unseen], y[honest.unseen])
        changes.append(loss - honest.loss_before)
    return tuple(changes)


# --- the checks ------------------------------------------------------------------------


def _cosine(a: FloatVec, b: FloatVec) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a @ b) / (na * nb)


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


def _signal_scores(reference: Reference, u: FloatVec) -> dict[str, float]:
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


def honest_thresholds(reference: Reference, loss_changes: Sequence[float] = ()) -> dict[str, float]:
    """The signal, direction and loss thresholds for this round's noise, and why.

    The fixed thresholds (:data:`SIGNAL_MIN_Z`, :data:`DIRECTION_MIN_Z`) were set where
    one honest update carries a clear signal (ε 8 over 5 rounds at the bench recipe).
    With more noise per round (a smaller ε, or the same ε over more rounds) honest scores
    fall towards the white-noise null, and the fixed thresholds fail honest members
    (measured: at noise multiplier 7.4 honest ``z_signal`` had mean 2.4, sd 1.3 in the
    first round, so about half failed).  So the expected honest scores are measured,
    not assumed: the auditor's own DP reference runs (:data:`REFERENCE_RUNS`, trained
    with the round's noise multiplier, clip, steps and the declared record count) are
    honest updates of this round, but they share records with the control sample the
    scores are taken against, which inflates their scores; ``reference.honest_shrink``
    (ρ, :func:`_in_sample_shrink`) takes that out.  The honest mean μ is ρ times the
    runs' mean and the spread s is ρ times theirs (the part of the spread that comes
    from the signal scales with it), but at least 1, what the white noise alone gives.
    A test fails an update only below ``min(fixed, μ − HONEST_MARGIN_Z·s)``: an honest
    update scores that low with probability about Φ(−HONEST_MARGIN_Z) at most.  ρ is
    a James-Stein estimate that errs low (it also scales the energy part of
    ``z_signal``, of which only the mean-gradient share is inflated, and a control
    sample drawn more evenly than at random has less sampling error than it assumes:
    measured members' scores were 0.45-0.55 of the runs' where ρ was 0.0-0.11), so the
    thresholds err towards passing.
    Where noise drowns the signal the thresholds fall below what pure noise scores, so
    these two tests stop failing anyone: one update cannot show then what it was trained
    on, and the magnitude, weight and replay tests are what still bite.

    The loss test likewise: DP noise raises the control loss of an honest step more as
    the model sharpens (measured: up to +0.14 nats by round 13 of 15 at noise
    multiplier 7.4, against the fixed :data:`LOSS_MAX_INCREASE` of 0.02), so the
    tolerated rise is the larger of the fixed one and μ + HONEST_MARGIN_Z·s of
    ``loss_changes``: the runs' own loss changes on the control records they did not
    draw, after the member's rounding (:func:`honest_loss_changes`); none given, the
    fixed one.

    Returns:
        ``honest_z_direction``/``honest_z_signal``/``honest_loss_change`` (μ),
        ``honest_sd_direction``/``honest_sd_signal``/``honest_sd_loss_change`` (s), and
        the thresholds ``direction_min_z``, ``signal_min_z`` and ``loss_max_increase``
        the verdict applies.
    """
    out: dict[str, float] = {}
    for name, runs, fixed in (
        ("direction", reference.honest_direction, DIRECTION_MIN_Z),
        ("signal", reference.honest_signal, SIGNAL_MIN_Z),
    ):
        rho = reference.honest_shrink
        mean = rho * float(np.mean(runs))
        spread = max(rho * float(np.std(runs, ddof=1)) if len(runs) > 1 else 0.0, 1.0)
        out[f"honest_z_{name}"] = mean
        out[f"honest_sd_{name}"] = spread
        out[f"{name}_min_z"] = min(fixed, mean - HONEST_MARGIN_Z * spread)
    allowed = LOSS_MAX_INCREASE
    if len(loss_changes) > 1:
        mean = float(np.mean(loss_changes))
        spread = float(np.std(loss_changes, ddof=1))
        out["honest_loss_change"], out["honest_sd_loss_change"] = mean, spread
        allowed = max(allowed, mean + HONEST_MARGIN_Z * spread)
    out["loss_max_increase"] = allowed
    return out


def _weight_as_declared(
    claim: MemberClaim, revealed: RevealedUpdate, scores: dict[str, float]
) -> bool:
    """The committed weight (stochastically rounded to ``weight_step``) is what the
    member's declared statistics give: at most the volume cap, and the exact quality
    weight when known.  Lowering one's own weight is allowed (it costs only oneself)."""
    tolerance = revealed.weight_step + 1e-12
    ok = True
    if claim.weight_cap is not None:
        scores["weight_cap"] = claim.weight_cap
        ok = revealed.weight <= claim.weight_cap + tolerance
    if claim.weight is not None:
        scores["weight_declared"] = claim.weight
        ok = ok and abs(revealed.weight - claim.weight) <= tolerance
    return ok


def check_update(
    task: Task,
    reference: Reference,
    training: RoundTraining,
    claim: MemberClaim,
    revealed: RevealedUpdate,
    history: Sequence[RevealedUpdate] = (),
    control: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]] | None = None,
) -> Verdict:
    """Run every control-sample test on one revealed update.

    Args:
        task: the federation's task.
        reference: from :func:`build_reference` for this round and declared size.
        training: the round's settings.
        claim: the member's declared record count and steps.
        revealed: the update, already checked against its commitment.
        history: earlier revealed updates (this member's and others') for the replay test;
            entries of this round or later are ignored.
        control: the control sample the reference was built from, for the loss test
            (skipped when None).

    Returns:
        The verdict; ``failed`` lists the tests in :data:`TEST_NAMES` order.
    """
    failed: list[str] = []
    scores: dict[str, float] = {"weight": revealed.weight}
    _, planned_steps = plan_round(max(claim.samples, 1), training.params)
    if claim.samples < 1 or claim.steps != planned_steps:
        failed.append("claim")
    delta = revealed.delta()
    if delta is None:
        failed.append("weight")
        return Verdict(claim.member, claim.round, False, tuple(failed), scores)
    if not _weight_as_declared(claim, revealed, scores):
        failed.append("weight")

    # Stochastic rounding adds ~step²/6 of variance per coordinate (step in Δ units).
    step = revealed.quant_step / revealed.weight
    signal = _signal_scores(reference, delta)
    scores.update(signal)
    scores["cosine_reference"] = _cosine(delta, -reference.mean_gradient)
    loss_runs = () if control is None else honest_loss_changes(task, reference, control, step)
    thresholds = honest_thresholds(reference, loss_runs)
    scores.update(thresholds)
    if signal["z_signal"] < thresholds["signal_min_z"]:
        failed.append("signal")
    if signal["z_direction"] < thresholds["direction_min_z"]:
        failed.append("direction")

    if control is not None:
        model = _model_at(task, (reference.global_params + delta).astype(np.float32))
        after = _control_loss(model, *control)
        scores["loss_before"] = reference.loss_before
        scores["loss_change"] = after - reference.loss_before
        if after - reference.loss_before > thresholds["loss_max_increase"]:
            failed.append("loss")

    energy = max(float(delta @ delta) - delta.size * step**2 / 6.0, 0.0)
    ratio = math.sqrt(energy) / reference.reference_norm if reference.reference_norm > 0 else 0.0
    scores["norm"] = math.sqrt(energy)
    scores["norm_ratio"] = ratio
    if not MAGNITUDE_BAND[0] <= ratio <= MAGNITUDE_BAND[1]:
        failed.append("magnitude")

    earlier = [h for h in history if h.round < claim.round]
    replay = 0.0
    for old in earlier:
        old_delta = old.delta()
        if old_delta is not None and old_delta.size == delta.size:
            replay = max(replay, _cosine(delta, old_delta))
    scores["replay_cosine"] = replay
    if replay >= REPLAY_MAX_COSINE:
        failed.append("replay")
    return Verdict(claim.member, claim.round, not failed, tuple(failed), scores)
