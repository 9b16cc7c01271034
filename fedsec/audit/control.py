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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedsec.crypto.quantize import QuantSpec, RingVector, dequantize_one
from fedsec.errors import ConfigError, TaskMismatch
from fedsec.learning.training import DPParams, plan_round, train_local
from fedsec.tasks.base import Task, TrainingParams
from fedsec.tasks.params import flatten_params, load_flat_params

__all__ = [
    "DIRECTION_MIN_Z",
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
#: Principal gradient directions used by the signal test.  Weights r/(1+r) decay fast, so
#: more components add little power; 100 keeps the SVD of the control gradients cheap.
SIGNAL_COMPONENTS: Final = 100
#: DP reference runs per (round, declared size) for the magnitude test: the honest norm
#: varies by ~1 % between runs, so three give a stable median.
REFERENCE_RUNS: Final = 3
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
    # A control sample smaller than the declared size is resampled with replacement: the
    # reference must see the member's batch geometry (sample rate, expected batch size).
    replace = samples > n_control
    return np.sort(rng.choice(n_control, size=samples, replace=replace)).astype(np.int64)


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
    _, steps = plan_round(samples, training.params)
    model = _model_at(task, global_params)
    max_norm = None if training.dp is None else training.dp.max_grad_norm
    grads = _clipped_gradients(model, x, y, max_norm)
    mean_gradient = grads.mean(axis=0)
    k = min(SIGNAL_COMPONENTS, grads.shape[0], grads.shape[1])
    _, singular, vt = np.linalg.svd(grads, full_matrices=False)
    energies = singular[:k] ** 2 / grads.shape[0]
    rng = np.random.default_rng(seed)
    norms = []
    for run in range(REFERENCE_RUNS):
        ref_model = _model_at(task, global_params)
        idx = _subset(rng, len(y), samples)
        train_local(
            ref_model, x[idx], y[idx], training.params, training.dp, device, seed * 1009 + run
        )
        norms.append(float(np.linalg.norm(flatten_params(ref_model) - global_params)))
    return Reference(
        round=round,
        global_params=np.asarray(global_params, dtype=np.float32),
        mean_gradient=mean_gradient,
        basis=vt[:k].copy(),
        energies=energies,
        step_scale=_step_scale(training, samples, steps, grads),
        samples=samples,
        reference_norm=min(float(np.median(norms)), training.clip),
        loss_before=_control_loss(model, x, y),
    )


# --- the checks ------------------------------------------------------------------------


def _cosine(a: FloatVec, b: FloatVec) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a @ b) / (na * nb)


def _signal_scores(reference: Reference, u: FloatVec) -> dict[str, float]:
    """z_dir, z_quad and their combination (see module docstring)."""
    d = u.size
    coords = reference.basis @ u
    k = coords.size
    outside = max(float(u @ u) - float(coords @ coords), 0.0)
    noise_var = outside / max(d - k, 1)
    if noise_var <= 0.0:
        # u lies entirely in the gradient subspace: no white noise at all, which neither
        # DP training nor quantization produces; score it as overwhelming signal.
        noise_var = 1e-30
    gnorm = float(np.linalg.norm(reference.mean_gradient))
    z_dir = 0.0
    if gnorm > 0.0:
        z_dir = float(-(u @ reference.mean_gradient) / gnorm) / math.sqrt(noise_var)
    # Expected energy of an honest step along v_j: the mean gradient's share (ḡ·v_j)² in
    # full, plus the record-to-record spread (λ_j − (ḡ·v_j)²) averaged over n records.
    mean_part = (reference.basis @ reference.mean_gradient) ** 2
    spread_part = np.maximum(reference.energies - mean_part, 0.0) / reference.samples
    ratio = reference.step_scale**2 * (mean_part + spread_part) / noise_var
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
        control: the control sample, for the loss test (skipped when None).

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

    signal = _signal_scores(reference, delta)
    scores.update(signal)
    scores["cosine_reference"] = _cosine(delta, -reference.mean_gradient)
    if signal["z_signal"] < SIGNAL_MIN_Z:
        failed.append("signal")
    if signal["z_direction"] < DIRECTION_MIN_Z:
        failed.append("direction")

    if control is not None:
        model = _model_at(task, (reference.global_params + delta).astype(np.float32))
        after = _control_loss(model, *control)
        scores["loss_before"] = reference.loss_before
        scores["loss_change"] = after - reference.loss_before
        if after - reference.loss_before > LOSS_MAX_INCREASE:
            failed.append("loss")

    # Stochastic rounding adds ~step²/6 of variance per coordinate (step in Δ units).
    step = revealed.quant_step / revealed.weight
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
