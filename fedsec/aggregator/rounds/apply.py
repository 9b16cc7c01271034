"""Model application: an attempt's sum → the server optimiser's step → a new model
version, written once even across a crash between writing it and closing the round."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.derive import apply_mean
from fedsec.errors import FedsecError, RoundAborted
from fedsec.learning.optimizers import AdamMoments, ServerRule
from fedsec.modelfile import ModelManifest, model_sha256
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.tasks.evaluation import evaluate_sums


class ServerStep(Protocol):
    """The server optimiser (FedAvg, FedAdam) as model application uses it: the rule,
    its state before the next round (set after each), and saving that state."""

    rule: ServerRule
    state: AdamMoments | None

    def save(self) -> None: ...


@dataclass(frozen=True, slots=True)
class NewVersion:
    """What applying one attempt's sum produced."""

    manifest: ModelManifest  # the version written (or found written by a predecessor)
    parent: ModelManifest  # the version the sum was applied to
    metrics: dict[str, float]  # the task's metrics and loss on validation, when it is on


class ModelApplier:
    """Applies mean updates to the served model.

    Args:
        ctx: the round engine's shared context.
        model: the task's model, reused as scratch space for each application.
        optimizer: the server optimiser; its state is saved in the round close's
            transaction (:meth:`save`).
        validation: (x, y) held-out data to score each new version, or None.
    """

    def __init__(
        self,
        ctx: RoundContext,
        model: torch.nn.Module,
        optimizer: ServerStep,
        validation: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        self._ctx = ctx
        self._model = model
        self.optimizer = optimizer
        self._validation = validation

    def apply(self, round_: int, weighted_sum: np.ndarray, weight_sum: float) -> NewVersion:
        """Apply the mean ``weighted_sum / weight_sum`` of round ``round_``.

        The step is :func:`fedsec.derive.apply_mean`, the one the auditor and the key
        custodian re-derive versions with, so the version written here is the one they
        derive, bit for bit.

        Raises:
            RoundAborted: the total weight is zero.
        """
        if not weight_sum > 0:  # before the parent is read
            raise RoundAborted(f"round {round_}: the survivors' total weight is zero")
        models = self._ctx.ws.models
        parent = self._parent_model(round_)
        # read a tensor at a time (the file's bytes are never held whole) into the model's
        # own tensors, which are scratch between applications: the parent costs no copy
        # (4 bytes a parameter, 191 MiB at 50M) beside the decoded sum; a step that fails
        # leaves them part stepped, and the next application reads the parent again
        own = own_arrays(self._model)
        arrays = models.read_arrays(parent.version, max_bytes=MAX_MODEL_BYTES, into=own)
        opt = self.optimizer
        loaded = None if own is not None else arrays
        opt.state = apply_mean(self._model, loaded, weighted_sum, weight_sum, opt.rule, opt.state)
        del arrays, loaded  # a parent's copy (4 bytes a parameter) is not held while encoding
        metrics: dict[str, float] = {}
        if self._validation is not None:
            metrics = evaluate_sums(self._model, *self._validation, task=self._ctx.task).values()
        # hashed and written from the model's own tensors, a tensor at a time: neither a
        # copy of the state nor the file's bytes is held
        state = self._model.state_dict()
        digest = model_sha256(state)
        manifest = self._written_before(digest, parent.version, round_) or models.put(
            state, parent=parent.version, round=round_, kind="aggregate", metrics=metrics
        )
        self._ctx.faults.crash(round_, "model_write")
        return NewVersion(manifest, parent, metrics)

    def apply_sealed(self, round_: int, release: bytes, parent_version: int) -> NewVersion:
        """Store round ``round_``'s hidden model: the custodian's sealed release, derived
        from ``parent_version`` (the aggregator neither reads nor validates it).

        Raises:
            NotFound, IntegrityError: the parent is not a good version.
        """
        models = self._ctx.ws.models
        parent = models.get(parent_version)
        digest = hashlib.sha256(release).hexdigest()
        manifest = self._written_before(digest, parent.version, round_) or models.put_sealed(
            release, parent=parent.version, round=round_
        )
        self._ctx.faults.crash(round_, "model_write")
        return NewVersion(manifest, parent, {})

    def save(self) -> None:
        """Persist the optimiser's state (inside the round close's transaction)."""
        self.optimizer.save()

    def _parent_model(self, round_: int) -> ModelManifest:
        """The version this round's aggregate applies to: the newest one, unless that is
        this round's own aggregate, written by an incarnation that died before recording
        the round as closed (applying the mean to it again would count the round twice)."""
        models = self._ctx.ws.models
        latest = models.latest()
        written = latest.kind in ("aggregate", "sealed")
        if written and latest.round == round_ and latest.parent is not None:
            return models.get(latest.parent)
        return latest

    def _written_before(self, digest: str, parent: int, round_: int) -> ModelManifest | None:
        """The version a previous incarnation already wrote for this round, if it crashed
        after writing the model but before recording the round as closed."""
        models = self._ctx.ws.models
        versions = models.versions_on_disk()
        if not versions:
            return None
        try:
            newest = models.get(versions[-1])
        except FedsecError:
            return None
        if newest.kind not in ("aggregate", "sealed"):
            return None
        if newest.parent != parent or newest.round != round_ or newest.sha256 != digest:
            return None
        log.info("event=model_reused version=%d round=%d", newest.version, round_)
        return newest


def own_arrays(model: torch.nn.Module) -> dict[str, np.ndarray] | None:
    """``model``'s state as writable arrays over its own tensors' memory, or None where
    a tensor is not a contiguous float32 CPU one (its state is then loaded by copy)."""
    if sys.byteorder != "little":  # model files are little-endian float32
        return None
    own: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
            return None
        if not tensor.is_contiguous():
            return None
        own[name] = tensor.detach().numpy()
    return own
