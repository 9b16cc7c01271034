"""Federated evaluation, the member's side: score the model a round produced on our own
held-out split and send the signed report of its sums (no per-record output leaves).

The held-out split is the task's test split (``Task.datasets().test``), cut into the
same number of parts as the training data, so that simulated members sharing a bundled
test set each score a disjoint share of it; a real member's data function gives its own.
The model is fetched by version, its manifest's signature and file hash checked against
the pinned aggregator key before anything of it is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import Any

import torch
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import Subset

from fedsec.aggregator_client import AggregatorClient
from fedsec.config import DataSection
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError
from fedsec.modelfile import decode_model, verify_manifest
from fedsec.protocol import wire
from fedsec.tasks import Task, partition_iid
from fedsec.tasks.evaluation import evaluate_dataset
from fedsec.tasks.params import arrays_to_state

log = logging.getLogger("fedsec.agent.runtime")

#: Allowance over the raw float32 size of the model for its safetensors header, as
#: training's download (:data:`fedsec.agent.trainer.MODEL_HEADER_SLACK_BYTES`).
_MODEL_HEADER_SLACK_BYTES = 1024 * 1024


def held_out_split(task: Task, data: DataSection) -> TorchDataset[Any]:
    """This member's held-out records: the task's test split, its share of ``data.parts``.

    Raises:
        ConfigError: the task gives no held-out records.
    """
    test = task.datasets().test
    n = len(test)  # type: ignore[arg-type]  # map-style: has a length
    if data.parts > 1:
        share = partition_iid(n, data.parts, data.seed)[data.part_index]
        test = Subset(test, share.tolist())
    if len(test) < 1:  # type: ignore[arg-type]
        raise ConfigError(f"task '{task.name}' gives this member no held-out records")
    return test


class MemberEvaluator:
    """Scores new global models on this member's held-out split and reports them.

    Args:
        member: our roster id; identity: our signing key.
        aggregator_public: the pinned key model manifests must be signed with.
        task: the federation's task; held_out: our held-out records.
        device: where the model is evaluated; executor: where (None: asyncio's default).
    """

    def __init__(
        self,
        member: str,
        identity: SigningIdentity,
        aggregator_public: bytes,
        task: Task,
        held_out: TorchDataset[Any],
        device: torch.device,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._member = member
        self._identity = identity
        self._aggregator_public = aggregator_public
        self._task = task
        self._held_out = held_out
        self._device = device
        self._executor = executor

    async def report(
        self,
        client: AggregatorClient,
        federation_id: str,
        round_: int,
        attempt: int,
        version: int,
        max_records: int,
    ) -> wire.EvaluationReport:
        """Fetch and verify model ``version``, score it on at most ``max_records`` of our
        held-out records (the first ones: the aggregator refuses a report counting more
        than we declared, or than the round's ``max_weight_samples``), send the report.

        Raises:
            IntegrityError / SignatureError: the model does not verify.
            FedsecError: the aggregator refused the report (its error).
        """
        model = await self._verified_model(client, federation_id, version)
        sums = await asyncio.get_running_loop().run_in_executor(
            self._executor,
            functools.partial(
                evaluate_dataset,
                model,
                _first(self._held_out, max_records),
                self._task,
                self._device,
            ),
        )
        report = wire.EvaluationReport(
            federation_id=federation_id,
            round=round_,
            attempt=attempt,
            member=self._member,
            model_version=version,
            records=sums.records,
            metrics=[
                wire.MetricSum(name=name, total=total, weight=weight)
                for name, (total, weight) in sorted(sums.sums.items())
            ],
        ).sign(self._identity)
        await client.evaluation(round_, attempt, report)
        log.info(
            "evaluation_reported round=%d attempt=%d version=%d records=%d %s=%s",
            round_,
            attempt,
            version,
            sums.records,
            self._task.primary_metric,
            sums.values().get(self._task.primary_metric),
        )
        return report

    async def _verified_model(
        self, client: AggregatorClient, federation_id: str, version: int
    ) -> torch.nn.Module:
        """The task's model holding version ``version``, fetched and checked against its
        signed manifest.

        Raises:
            IntegrityError / SignatureError: the model does not verify.
        """
        model = self._task.build_model(0)
        state = model.state_dict()
        limit = sum(t.numel() for t in state.values()) * 4 + _MODEL_HEADER_SLACK_BYTES
        manifest = await client.manifest(version)
        data = await client.model_bytes(version, limit)
        verify_manifest(manifest, self._aggregator_public, data, federation_id=federation_id)
        arrays = decode_model(
            data,
            max_bytes=limit,
            expected_names=list(state),
            expected_shapes={k: tuple(v.shape) for k, v in state.items()},
        )
        arrays_to_state(model, arrays)
        return model


def _first(data: TorchDataset[Any], count: int) -> TorchDataset[Any]:
    """The first ``count`` records of ``data`` (all of them when it holds fewer)."""
    if len(data) <= count:  # type: ignore[arg-type]
        return data
    return Subset(data, range(max(count, 0)))
