"""Local training for one round: fetch and verify the spec's model, train under DP-SGD
in the training executor, return the update (local - global)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset as TorchDataset

from fedsec.agent.charging import PrivacyCharge
from fedsec.agent.local_data import LocalData
from fedsec.agent.spec import training_params
from fedsec.aggregator_client import AggregatorClient
from fedsec.errors import ConfigError, IntegrityError
from fedsec.faults import NO_FAULTS, Faults
from fedsec.learning.distributed import clipped_gradient_sum, poisson_sample
from fedsec.learning.training import (
    DPParams,
    LocalTrainResult,
    TrainingParams,
    fresh_seed,
    records,
    train_dataset,
)
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import clear_stale_jobs, train_with_workers, worker_count
from fedsec.modelfile import decode_model, sha256_hex, verify_manifest
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.he_release import sealed_release_allowance
from fedsec.protocol.limits import MAX_COHORT
from fedsec.protocol.wire import RoundSpec
from fedsec.tasks import Task
from fedsec.tasks.params import arrays_to_state, flatten_params

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")

#: Allowance over the raw float32 size of the local model when downloading a model
#: file: the safetensors header is ~100 bytes per tensor, so 1 MiB covers ~10k tensors.
MODEL_HEADER_SLACK_BYTES: Final = 1024 * 1024


class SealedModelOpener(Protocol):
    """Opens a hidden model version (:class:`fedsec.agent.he.HiddenModels`)."""

    async def open(self, client: AggregatorClient, spec: RoundSpec, data: bytes) -> bytes: ...


class LocalTrainer:
    """Trains this member's model on its local data.

    Args:
        member: this agent's id (it seeds the unsafe deterministic test switch).
        aggregator_public: the pinned key model manifests must be signed with.
        local: the task and the local training data.
        device: where training runs.
        executor: where the training call runs (None: asyncio's default executor).
        progress: show a progress bar while training.
        slowdown: simulations only: this member trains slowdown x slower.
        faults: the unsafe deterministic test seed, if any (:mod:`fedsec.faults`).
        hidden: opens hidden model versions (an he federation's sealed releases).
        workers: how training is split over processes (``[training]`` of agent.toml).
        state_dir: the member's state directory, where a split job's files live.
        task_options: what the task was built with, for workers building it again.

    Raises:
        ConfigError: ``workers`` of a node other than the agent's (``node_rank`` > 0),
            refused here, before any round is charged.
    """

    def __init__(
        self,
        member: str,
        aggregator_public: bytes,
        local: LocalData,
        device: torch.device,
        executor: concurrent.futures.Executor | None,
        *,
        progress: bool = False,
        slowdown: float = 1.0,
        faults: Faults = NO_FAULTS,
        hidden: SealedModelOpener | None = None,
        workers: TrainingWorkers | None = None,
        state_dir: Path = Path("state"),
        task_options: dict[str, Any] | None = None,
    ) -> None:
        self.member = member
        self.aggregator_public = aggregator_public
        self.local = local
        self.device = device
        self.executor = executor
        self.progress = progress
        self.slowdown = slowdown
        self._faults = faults
        self._hidden = hidden
        self._workers = workers or TrainingWorkers()
        if self._workers.node_rank != 0:
            raise ConfigError(
                "training.node_rank must be 0 where the agent runs (its node holds rank 0); "
                "run the other nodes with fedsec agent train-node"
            )
        self._state_dir = state_dir
        self._task_options = dict(task_options or {})
        # a job a killed agent left behind holds records and a secret seed; no job of
        # this agent runs before its trainer exists
        stale = clear_stale_jobs(state_dir) if self._workers.uses_torchrun else []
        for name in stale:
            log.warning("stale_training_job_removed job=%s", name)
        self._model: tuple[int, str, dict[str, npt.NDArray[np.float32]]] | None = None

    async def train(
        self, client: AggregatorClient, spec: RoundSpec, charge: PrivacyCharge
    ) -> npt.NDArray[np.float32]:
        """Fetch the spec's model and train on it; return local - global.

        Raises:
            ConfigError: an unknown optimiser.
            IntegrityError / SignatureError: the model does not verify.
        """
        local = self.local
        model = local.task.build_model(0)
        params = training_params(spec, local.task)
        await self._load_global_model(client, spec, model)
        if is_distributed(spec) and spec.dp.unit == "record":
            return await self._gradient_share(spec, model)
        before = flatten_params(model)
        # distributed DP at member level: the clipped update is the unit, the noise is
        # the members' shares in the ring, so local training adds none
        dp = (
            DPParams(spec.dp.noise_multiplier, spec.dp.max_grad_norm, spec.dp.delta)
            if spec.dp.enabled and not is_distributed(spec)
            else None
        )
        result = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(
                self._train_model,
                model,
                params,
                dp,
                _training_seed(self._faults, self.member, spec.round),
                spec.round,
            ),
        )
        if result.steps != charge.steps or abs(result.sample_rate - charge.sample_rate) > 1e-12:
            log.warning(
                "privacy_plan_differs round=%d planned_steps=%d steps=%d planned_rate=%g rate=%g",
                spec.round,
                charge.steps,
                result.steps,
                charge.sample_rate,
                result.sample_rate,
            )
        delta: npt.NDArray[np.float32] = (flatten_params(model) - before).astype(np.float32)
        log.info(
            "round_trained round=%d steps=%d loss=%.4f seconds=%.1f",
            spec.round,
            result.steps,
            result.train_loss,
            result.duration_s,
        )
        if self.slowdown > 1.0:
            # simulations of slow members only: stretch training to slowdown x its time
            await asyncio.sleep((self.slowdown - 1.0) * result.duration_s)
        return delta

    def _train_model(
        self,
        model: torch.nn.Module,
        params: TrainingParams,
        dp: DPParams | None,
        seed: int,
        round_: int,
    ) -> LocalTrainResult:
        """Train in this process, or as a torchrun job where ``[training] workers`` asks.

        Raises:
            ConfigError: a task workers cannot rebuild.
            TrainingWorkersFailed: the job failed past its restarts.
        """
        local = self.local
        count = worker_count(self._workers.workers, self.device)
        if count <= 1 and self._workers.nodes == 1:
            return train_dataset(
                model, local.train, params, dp, self.device, seed, self.progress, local.task
            )
        if local.task.name == "table":
            raise ConfigError(
                "training.workers > 1 needs a task its workers can build by name; task "
                "'table' is built from the federation's schema and the owner's sources"
            )
        done = train_with_workers(
            model,
            local.train,
            params,
            self.device,
            seed,
            local.task,
            self._task_options,
            self._state_dir,
            self._workers,
            dp=dp,
            round_=round_,
        )
        age = done.resumed_checkpoint_age_s
        log.info(
            "round_workers round=%d workers=%d restarts=%d stragglers=%d resumed_from_step=%d"
            " resumed_checkpoint_age_s=%s straggler_waits_s=%s",
            round_,
            done.workers,
            done.restarts,
            len(done.straggler_waits_s),
            done.resumed_from_step,
            "none" if age is None else f"{age:.1f}",
            ",".join(f"{w:.1f}" for w in done.straggler_waits_s) or "none",
        )
        return done.trained

    async def _gradient_share(
        self, spec: RoundSpec, model: torch.nn.Module
    ) -> npt.NDArray[np.float32]:
        """Record-level distributed DP: minus the sum of this member's clipped
        per-record gradients over a secret Poisson sample at the spec's rate (one
        DP-SGD step's share; the server optimiser takes the step on the noised sum)."""
        local = self.local
        secret = self._faults.seeded_bytes(self.member, spec.round, "sampling")
        include = poisson_sample(local.samples, spec.dp.sample_rate, secret)
        started = time.perf_counter()
        total, count = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(
                _sampled_gradient_sum,
                model,
                local.train,
                include,
                spec.dp.max_grad_norm,
                self.device,
                local.task,
            ),
        )
        duration = time.perf_counter() - started
        log.info(
            "round_trained round=%d steps=1 records=%d seconds=%.1f", spec.round, count, duration
        )
        if self.slowdown > 1.0:
            await asyncio.sleep((self.slowdown - 1.0) * duration)
        return (-total).astype(np.float32)

    async def _load_global_model(
        self, client: AggregatorClient, spec: RoundSpec, model: torch.nn.Module
    ) -> None:
        """Download the spec's model version, check its sha256 against the spec's, load it
        into ``model``.

        The spec is signed by the pinned aggregator key and names the version's sha256
        for this federation, which is all the version's signed manifest would add; so
        the manifest is fetched (and verified) only where its ``kind`` matters, a
        model hidden under homomorphic summation, saving a signed request a round.

        Raises:
            IntegrityError / SignatureError: the manifest or file does not verify, or it
                is not the model the spec names.
        """
        state = model.state_dict()
        if self._model is None or self._model[:2] != (spec.model_version, spec.model_sha256):
            manifest = await client.manifest(spec.model_version) if spec.he_model_hidden else None
            if manifest is not None and manifest.sha256 != spec.model_sha256:
                raise IntegrityError(
                    f"round {spec.round} names model v{spec.model_version} with sha256 "
                    f"{spec.model_sha256[:16]}..., but its manifest says {manifest.sha256[:16]}..."
                )
            limit = sum(t.numel() for t in state.values()) * 4 + MODEL_HEADER_SLACK_BYTES
            sealed = manifest is not None and await client.made_as(manifest) == "sealed"
            if sealed:  # the sum and the model, sealed to the roster: see he_release
                limit += sealed_release_allowance(spec.dim + 1, MAX_COHORT)
            data = await client.model_bytes(spec.model_version, limit)
            if manifest is not None:
                verify_manifest(
                    manifest, self.aggregator_public, data, federation_id=spec.federation_id
                )
            elif sha256_hex(data) != spec.model_sha256:
                raise IntegrityError(
                    f"model v{spec.model_version} has sha256 {sha256_hex(data)[:16]}..., not "
                    f"the {spec.model_sha256[:16]}... that round {spec.round}'s signed spec names"
                )
            if sealed:
                if self._hidden is None:
                    raise IntegrityError(f"model v{spec.model_version} is sealed; cannot open it")
                data = await self._hidden.open(client, spec, data)
            arrays = decode_model(
                data,
                max_bytes=limit,
                expected_names=list(state),
                expected_shapes={k: tuple(v.shape) for k, v in state.items()},
            )
            self._model = (spec.model_version, spec.model_sha256, arrays)
            log.info("model_downloaded version=%d bytes=%d", spec.model_version, len(data))
        arrays_to_state(model, {k: v.copy() for k, v in self._model[2].items()})


def _sampled_gradient_sum(
    model: torch.nn.Module,
    train: TorchDataset[Any],
    include: npt.NDArray[np.bool_],
    max_grad_norm: float,
    device: torch.device,
    task: Task,
) -> tuple[np.ndarray, int]:
    """:func:`clipped_gradient_sum` over the included records, reading only those (the
    step's own batch, never the whole dataset).

    Raises:
        ConfigError / InvalidTask: see :func:`clipped_gradient_sum`.
    """
    x, y = records(train, np.flatnonzero(include))
    chosen = np.ones(len(y), dtype=bool)
    return clipped_gradient_sum(model, x, y, chosen, max_grad_norm, device, task)


def _training_seed(faults: Faults, member: str, round_: int) -> int:
    """A fresh secret seed for DP noise and sampling (deterministic only under the unsafe
    test switch, see fedsec.faults)."""
    fixed = faults.seeded_bytes(member, round_, "training")
    return int.from_bytes(fixed[:8], "big") >> 1 if fixed else fresh_seed()
