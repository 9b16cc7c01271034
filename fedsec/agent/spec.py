"""What a signed round spec asks of this agent, checked before it costs anything.

Pure functions: the spec's signature, its task against ours, this member's weight,
the local optimiser settings, and the key that tells a retried round's update apart.
"""

from __future__ import annotations

from typing import Literal, cast

from fedsec.errors import ConfigError, PayloadError, SignatureError, TaskMismatch
from fedsec.protocol.weights import contribution_weight
from fedsec.protocol.wire import RoundSpec
from fedsec.task.digest import check_pin, loaded_task_pin
from fedsec.tasks import Task, TrainingParams, check_schema


def verify_round_spec(spec: RoundSpec, aggregator_public: bytes) -> None:
    """Check that the aggregator whose key we pinned signed ``spec``.

    Raises:
        SignatureError: "round spec signature does not verify: ..." naming the key.
    """
    try:
        spec.verify(aggregator_public)
    except (SignatureError, PayloadError) as exc:
        raise SignatureError(
            f"round spec signature does not verify: {exc.detail}; the spec of round "
            f"{spec.round} was not signed by the aggregator key in agent.toml "
            f"({aggregator_public.hex()[:16]}...)"
        ) from None


def check_spec_task(spec: RoundSpec, task: Task, dim: int) -> None:
    """Refuse a round whose task, task version, data schema, model size or pinned task
    package (entry point, distribution, version, digest of its files) differs from ours.

    Raises:
        TaskMismatch: naming the difference (TaskDigestMismatch for the package).
    """
    if spec.task != task.name:
        raise TaskMismatch(
            f"round {spec.round} trains task {spec.task!r} but this agent is set up for "
            f"{task.name!r} (data.task in agent.toml)"
        )
    if spec.task_version != task.version:
        raise TaskMismatch(
            f"round {spec.round} requires task {spec.task!r} version {spec.task_version!r} "
            f"but this agent runs version {task.version!r}; upgrade fedsec on the older side"
        )
    check_schema(spec.schema_fingerprint, task)
    if spec.task_pin is not None:
        check_pin(spec.task_pin, loaded_task_pin(task.name), f"round {spec.round}")
    if spec.dim != dim:
        raise TaskMismatch(
            f"round {spec.round} has {spec.dim} model parameters but the local "
            f"{task.name!r} model has {dim}"
        )


#: This member's quality weight: volume × the quality of its data summary (1 without
#: one), capped by the roster; the one definition the auditor checks too.
member_weight = contribution_weight


def staleness_discount(spec: RoundSpec, member: str) -> float:
    """FedBuff: a stale update counts less, s(τ) = (1 + τ)^-½.

    It scales the update, not the weight: the aggregator divides by Σ w, which would
    cancel a discount shared by the whole buffer.  Applied by the member since the
    aggregator sees only sums.
    """
    if spec.mode != "buffered":
        return 1.0
    return float((1.0 + spec.staleness.get(member, 0)) ** -0.5)


def training_params(spec: RoundSpec, task: Task) -> TrainingParams:
    """Local optimiser settings of the round.  Momentum is not in the spec: the task's.

    Raises:
        ConfigError: an unknown optimiser or invalid values.
    """
    optimizer = spec.training.optimizer
    if optimizer not in ("sgd", "adam"):
        raise ConfigError(f"round {spec.round} asks for unknown optimizer {optimizer!r}")
    return TrainingParams(
        lr=spec.training.lr,
        batch_size=spec.training.batch_size,
        local_epochs=spec.training.local_epochs,
        optimizer=cast(Literal["sgd", "adam"], optimizer),
        momentum=task.defaults.momentum if optimizer == "sgd" else 0.0,
    )


def update_key(spec: RoundSpec) -> tuple[object, ...]:
    """What an update was trained for: a retried attempt with the same key reuses it."""
    return (
        spec.federation_id,
        spec.round,
        spec.model_version,
        spec.model_sha256,
        spec.training,
        spec.dp,
    )
