"""``fedsec audit check``: open the reveals sealed to this auditor and judge each update.

For every reveal: open it with the auditor's key, check it against the commitment the
member signed (from the transparency log), then run the control-sample checks of
:mod:`fedsec.audit.control` against the global model the round started from (read from
the model store and checked against the signed spec's sha256), the round's signed
training settings and the member's signed privacy report (records and steps).
A reveal that cannot be opened or does not match its commitment fails outright.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedsec.audit.challenge import ClosedRound, closed_rounds, open_reveal_checked
from fedsec.audit.control import (
    MemberClaim,
    Reference,
    RevealedUpdate,
    RoundTraining,
    build_reference,
    check_update,
    load_control_sample,
)
from fedsec.audit.log import read_log
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import FedsecError, IntegrityError
from fedsec.learning.training import DPParams
from fedsec.modelfile import decode_model
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.protocol.log_entries import kind_of
from fedsec.protocol.weights import volume_weight
from fedsec.tasks import TrainingParams, get_task
from fedsec.tasks.params import arrays_to_state, flatten_params


@dataclass
class _RoundContext:
    closed: ClosedRound
    training: RoundTraining
    global_params: npt.NDArray[np.float32]


def _reports(log_path: Path) -> dict[tuple[str, int, int], wire.PrivacyReport]:
    out = {}
    kind = kind_of(wire.PrivacyReport)
    for entry in read_log(log_path):
        if entry.kind == kind and isinstance(report := entry.decode(), wire.PrivacyReport):
            out[(report.member, report.round, report.attempt)] = report
    return out


def _global_params(models_root: Path, closed: ClosedRound) -> npt.NDArray[np.float32]:
    spec = closed.spec
    data = (models_root / "models" / f"{spec.model_sha256}.safetensors").read_bytes()
    if hashlib.sha256(data).hexdigest() != spec.model_sha256:
        raise IntegrityError(f"model file of version {spec.model_version} does not match its hash")
    model = get_task(spec.task).build_model(0)
    arrays_to_state(model, decode_model(data, max_bytes=MAX_MODEL_BYTES))
    return flatten_params(model)


def _round_training(spec: wire.RoundSpec) -> RoundTraining:
    """The training the signed spec of a round sets, as the control checks replay it."""
    task = get_task(spec.task)
    return RoundTraining(
        TrainingParams(
            lr=spec.training.lr,
            batch_size=spec.training.batch_size,
            local_epochs=spec.training.local_epochs,
            optimizer=spec.training.optimizer,  # type: ignore[arg-type]
            momentum=task.defaults.momentum,
        ),
        (
            DPParams(spec.dp.noise_multiplier, spec.dp.max_grad_norm, spec.dp.delta)
            if spec.dp.enabled
            else None
        ),
        spec.clip_norm,
    )


def _failed(base: dict[str, Any], test: str, detail: str) -> dict[str, Any]:
    return {**base, "passed": False, "failed": [test], "detail": detail, "scores": {}}


class _Judge:
    """Judges reveals in order, each against the updates revealed before it."""

    def __init__(
        self,
        auditor: SigningIdentity,
        log_path: Path,
        models_root: Path,
        control_sample: Path,
        seed: int,
    ) -> None:
        self.auditor = auditor
        self.rounds = closed_rounds(log_path)
        self.reports = _reports(log_path)
        self.models_root = models_root
        self.control_sample = control_sample
        self.seed = seed
        self.contexts: dict[tuple[int, int], _RoundContext] = {}
        self.references: dict[tuple[int, int, int], Reference] = {}
        self.history: list[RevealedUpdate] = []

    def _context(self, key: tuple[int, int]) -> _RoundContext:
        if key not in self.contexts:
            closed = self.rounds[key]
            training = _round_training(closed.spec)
            self.contexts[key] = _RoundContext(
                closed, training, _global_params(self.models_root, closed)
            )
        return self.contexts[key]

    def verdict(self, reveal: wire.Reveal) -> dict[str, Any]:
        """The verdict on one reveal (see the module docstring)."""
        base = {"member": reveal.member, "round": reveal.round, "attempt": reveal.attempt}
        try:
            opened = open_reveal_checked(self.auditor, reveal, self.rounds)
        except FedsecError as exc:
            return _failed(base, "commitment", exc.detail)
        ctx = self._context((reveal.round, reveal.attempt))
        spec = ctx.closed.spec
        task = get_task(spec.task)
        control = load_control_sample(self.control_sample, task)
        report = self.reports.get((reveal.member, reveal.round, reveal.attempt))
        if report is None:
            return _failed(base, "claim", "no signed privacy report for this round")
        # the weight the signed record count allows; the exact quality weight needs the
        # member's signed data summary, which the log does not carry yet (weights.py)
        claim = MemberClaim(
            reveal.member,
            reveal.round,
            report.samples,
            report.steps,
            weight_cap=volume_weight(report.samples, spec, reveal.member),
        )
        ref_key = (reveal.round, reveal.attempt, report.samples)
        if ref_key not in self.references:
            self.references[ref_key] = build_reference(
                task,
                ctx.global_params,
                ctx.training,
                control,
                report.samples,
                reveal.round,
                self.seed,
            )
        encoding = codec_for(spec)
        weighted, weight = encoding.decode_one(opened.quantized)
        step = 2.0 * encoding.range / spec.quant_spec().levels
        revealed = RevealedUpdate(
            reveal.member, reveal.round, weighted, weight, step, 1.0 / spec.quant_spec().levels
        )
        verdict = check_update(
            task, self.references[ref_key], ctx.training, claim, revealed, self.history, control
        )
        self.history.append(revealed)
        return {
            **base,
            "passed": verdict.passed,
            "failed": list(verdict.failed),
            "scores": {k: float(v) for k, v in verdict.scores.items()},
        }


def check_reveals(
    auditor: SigningIdentity,
    reveals: list[wire.Reveal],
    log_path: Path,
    models_root: Path,
    control_sample: Path,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One verdict per reveal (see the module docstring), in (round, attempt, member)
    order.

    Raises:
        IntegrityError: the log is broken, or the model a round started from does not
            match the hash its signed spec names.
        TaskMismatch: the control sample is not the task's.
        OSError: a model file cannot be read.
    """
    judge = _Judge(auditor, log_path, models_root, control_sample, seed)
    return [
        judge.verdict(reveal)
        for reveal in sorted(reveals, key=lambda r: (r.round, r.attempt, r.member))
    ]
