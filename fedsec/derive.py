"""Derive a model version from its parent and a round's sum: the one definition every
party that makes or re-derives a version uses (the aggregator applying a round's sum,
the auditor checking any version, the key custodian deriving a hidden one), so they
agree bit for bit.

:func:`apply_mean` is the step itself, on a model the caller holds (the aggregator
reuses its model and then scores it); :func:`derive_model` builds the task's model and
returns the new file.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsec.errors import RoundAborted
from fedsec.learning.optimizers import AdamMoments, ServerRule, server_step
from fedsec.modelfile import decode_model, encode_model
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.tasks import get_task
from fedsec.tasks.params import arrays_to_state, flatten_params, load_flat_params, state_to_arrays
from fedsec.tasks.table_task import table_task_for_model


def derive_model(
    task: str,
    parent: bytes,
    weighted_sum: np.ndarray,
    weight_sum: float,
    rule: ServerRule,
    state: AdamMoments | None = None,
) -> tuple[bytes, AdamMoments | None]:
    """The model file ``rule`` makes of ``parent`` and the mean ``weighted_sum / weight_sum``.

    Args:
        task: the bundled task's name (its model fixes the parameter order).
        parent: the parent version's model file.
        weighted_sum: Σ w·Δ, one entry per parameter.
        weight_sum: Σ w.
        rule: the server optimiser.
        state: FedAdam's moments before this round (None: zeros, or FedAvg).

    Returns:
        The new model file's bytes and the optimiser's new state.

    Raises:
        RoundAborted: the total weight is zero.
        IntegrityError, TaskMismatch: the parent is not a model of ``task``.
    """
    if not weight_sum > 0:  # before the parent is read
        raise RoundAborted("the survivors' total weight is zero")
    arrays = decode_model(parent, max_bytes=MAX_MODEL_BYTES)
    # task "table" is shaped by the federation's schema, which the log does not hold
    model = (table_task_for_model(arrays) if task == "table" else get_task(task)).build_model(0)
    state = apply_mean(model, arrays, weighted_sum, weight_sum, rule, state)
    return encode_model(state_to_arrays(model)), state


def apply_mean(
    model: torch.nn.Module,
    parent: dict[str, np.ndarray],
    weighted_sum: np.ndarray,
    weight_sum: float,
    rule: ServerRule,
    state: AdamMoments | None = None,
) -> AdamMoments | None:
    """Load ``parent`` into ``model`` and take ``rule``'s step with the mean
    ``weighted_sum / weight_sum`` (computed in float64, applied as float32); ``model``
    then holds the new version.

    Args:
        model: the task's model (its parameter order is the sum's).
        parent: the parent version's arrays (:func:`fedsec.modelfile.decode_model`).
        weighted_sum: Σ w·Δ, one entry per parameter.
        weight_sum: Σ w.
        rule: the server optimiser.
        state: FedAdam's moments before this round (None: zeros, or FedAvg).

    Returns:
        The optimiser's new state.

    Raises:
        RoundAborted: the total weight is zero.
        TaskMismatch: ``parent`` does not fit ``model``.
    """
    if not weight_sum > 0:
        raise RoundAborted("the survivors' total weight is zero")
    mean = (np.asarray(weighted_sum) / weight_sum).astype(np.float32)
    arrays_to_state(model, parent)
    new, state = server_step(rule, flatten_params(model), mean, state)
    load_flat_params(model, new)
    return state
