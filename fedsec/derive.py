"""Derive a model version from its parent and a round's sum: the one definition every
party that re-derives a version uses (the auditor checking any version, the key
custodian deriving a hidden one), so they agree bit for bit."""

from __future__ import annotations

import numpy as np

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
    if not weight_sum > 0:
        raise RoundAborted("the survivors' total weight is zero")
    mean = (np.asarray(weighted_sum) / weight_sum).astype(np.float32)
    arrays = decode_model(parent, max_bytes=MAX_MODEL_BYTES)
    # task "table" is shaped by the federation's schema, which the log does not hold
    model = (table_task_for_model(arrays) if task == "table" else get_task(task)).build_model(0)
    arrays_to_state(model, arrays)
    new, state = server_step(rule, flatten_params(model), mean, state)
    load_flat_params(model, new)
    return encode_model(state_to_arrays(model)), state
