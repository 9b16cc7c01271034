"""Derive a model version from its parent and a round's sum: the one definition every
party that makes or re-derives a version uses (the aggregator applying a round's sum,
the auditor checking any version, the key custodian deriving a hidden one), so they
agree bit for bit.

:func:`apply_mean` is the step itself, on a model the caller holds (the aggregator
reuses its model and then scores it); :func:`derive_model` builds the task's model and
returns the new file.

The step is :func:`fedsec.learning.optimizers.server_step` applied a run of coordinates
at a time, in place in the model's parameters: the result is bit for bit the step on the
whole flat vector (:func:`fedsec.tasks.params.flatten_params`), as
tests/test_derive.py checks against that whole-vector step.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsec.errors import PayloadError, RoundAborted, TaskMismatch
from fedsec.learning.optimizers import AdamMoments, FedAdam, ServerRule, server_step
from fedsec.modelfile import decode_model, encode_model
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.tasks import get_task
from fedsec.tasks.params import arrays_to_state, param_count, trainable_parameters

#: Coordinates stepped at a time: the mean and the step's temporaries are a few float32
#: runs of this length (1 MiB each), never the model's size (an 11M model's float64 mean,
#: float32 mean and flat copies were 213 MiB). Every operation of the step is per
#: coordinate, so the run length does not change a bit of the result.
RUN = 1 << 18


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
    if task == "table":  # shaped by the federation's schema, which the log does not hold
        # imported here: its data code (scikit-learn, 60 MB) is no serving aggregator's
        from fedsec.tasks.table_task import table_task_for_model

        model = table_task_for_model(arrays).build_model(0)
    else:
        model = get_task(task).build_model(0)
    state = apply_mean(model, arrays, weighted_sum, weight_sum, rule, state)
    # encoded from the model's own tensors (a float32 CPU tensor is read in place)
    return encode_model(model.state_dict()), state


def apply_mean(
    model: torch.nn.Module,
    parent: dict[str, np.ndarray] | None,
    weighted_sum: np.ndarray,
    weight_sum: float,
    rule: ServerRule,
    state: AdamMoments | None = None,
) -> AdamMoments | None:
    """Load ``parent`` into ``model`` and take ``rule``'s step with the mean
    ``weighted_sum / weight_sum`` (computed in the sum's dtype, applied as float32);
    ``model`` then holds the new version.

    Args:
        model: the task's model (its parameter order is the sum's).
        parent: the parent version's arrays (:func:`fedsec.modelfile.decode_model`);
            None: ``model`` holds the parent already (read into its own tensors).
        weighted_sum: Σ w·Δ, one entry per parameter.
        weight_sum: Σ w.
        rule: the server optimiser.
        state: FedAdam's moments before this round (None: zeros, or FedAvg).

    Returns:
        The optimiser's new state.

    Raises:
        RoundAborted: the total weight is zero.
        TaskMismatch: ``parent`` or ``weighted_sum`` does not fit ``model``.
        ValueError: FedAdam's moments do not have one entry per parameter.
        PayloadError: the step makes a parameter NaN or infinite; ``model`` then holds
            ``parent`` (given as None: part of the step, so the caller reads the parent
            again before using ``model``).
    """
    if not weight_sum > 0:
        raise RoundAborted("the survivors' total weight is zero")
    total = np.asarray(weighted_sum)
    dim = param_count(model)
    if total.shape != (dim,):
        raise TaskMismatch(
            f"parameter vector has shape {total.shape}, the model has {dim} parameters"
        )
    adam = isinstance(rule, FedAdam)
    if adam and state is not None and (state.m.shape != (dim,) or state.v.shape != (dim,)):
        raise ValueError(f"FedAdam moments of shape {state.m.shape} for {(dim,)} parameters")
    if parent is not None:
        arrays_to_state(model, parent)
    moments = AdamMoments(np.empty(dim, np.float32), np.empty(dim, np.float32)) if adam else None
    offset = 0
    with torch.no_grad():
        for p in trainable_parameters(model):
            view = _float32_view(p)
            values = view if view is not None else _float32_copy(p)
            for start in range(0, len(values), RUN):
                lo, hi = offset + start, offset + min(start + RUN, len(values))
                mean = (total[lo:hi] / weight_sum).astype(np.float32)
                before = (
                    None
                    if state is None or not adam
                    else AdamMoments(state.m[lo:hi], state.v[lo:hi])
                )
                new, after = server_step(rule, values[start : start + hi - lo], mean, before)
                if not np.all(np.isfinite(new)):
                    if parent is not None:
                        arrays_to_state(model, parent)  # as if nothing had been stepped
                    raise PayloadError("parameter vector contains NaN or infinite values")
                values[start : start + hi - lo] = new
                if moments is not None and after is not None:
                    moments.m[lo:hi] = after.m
                    moments.v[lo:hi] = after.v
            if view is None:
                p.copy_(torch.from_numpy(values).view_as(p))
            offset += len(values)
    return moments if adam else state


def _float32_view(p: torch.Tensor) -> np.ndarray | None:
    """``p``'s own storage as a writable flat float32 array, where it is one."""
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        return None
    return p.detach().numpy().reshape(-1)


def _float32_copy(p: torch.Tensor) -> np.ndarray:
    """``p`` flattened to a new float32 CPU array (as :func:`flatten_params` converts it)."""
    return p.detach().reshape(-1).to("cpu", torch.float32).numpy().copy()
