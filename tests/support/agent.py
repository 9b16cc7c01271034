"""Helpers of the agent tests: a signed round spec with every field set."""

from __future__ import annotations

from typing import Any

from fedsec.crypto.identity import SigningIdentity
from fedsec.protocol.wire import DPSpec, RoundSpec, TrainingSpec
from fedsec.tasks.base import Task


def signed_spec(
    signer: SigningIdentity,
    local_task: Task,
    /,
    *,
    federation_id: str,
    model_sha256: str,
    dim: int,
    cohort: tuple[str, ...],
    **changes: Any,
) -> RoundSpec:
    """A plain-mode spec of round 1 attempt 1 for ``cohort``, signed by ``signer``;
    ``changes`` override any field (``task`` included: the first two arguments are
    positional only)."""
    fields: dict[str, Any] = {
        "federation_id": federation_id,
        "round": 1,
        "attempt": 1,
        "secure_sum": "none",
        "model_version": 1,
        "model_sha256": model_sha256,
        "task": local_task.name,
        "task_version": local_task.version,
        "schema_fingerprint": local_task.schema.fingerprint(),
        "cohort": sorted(cohort),
        "neighbors": max(len(cohort) - 1, 0),
        "threshold": 2,
        "quant_bits": 8,
        "ring_bits": 16,
        "clip_norm": 1.0,
        "dim": dim,
        "seed": "11" * 32,
        "max_weight_samples": 1000,
        "weight_caps": {},
        "training": TrainingSpec(local_epochs=1, batch_size=32, lr=0.05, optimizer="sgd"),
        "dp": DPSpec(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
        "deadlines": {},
    }
    fields.update(changes)
    return RoundSpec(**fields).sign(signer)
