"""Whether a task's model can be trained with DP-SGD, by Opacus's own validator.

Opacus's ``ModuleValidator.validate`` lists its objections without saying which layer
raised them; here its per-layer validators run on each trainable layer by name, so a
refusal names every offending layer (``features.1``) and the fix for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsec.errors import DpIncompatibleModel

#: The fix for each layer type Opacus refuses: its replacement, and the task option
#: that applies Opacus's own fixer where there is one.
_FIXES: dict[str, str] = {
    "BatchNorm1d": "replace it with GroupNorm (Task(dp_fix=True) applies Opacus's fixer)",
    "BatchNorm2d": "replace it with GroupNorm (Task(dp_fix=True) applies Opacus's fixer)",
    "BatchNorm3d": "replace it with GroupNorm (Task(dp_fix=True) applies Opacus's fixer)",
    "SyncBatchNorm": "replace it with GroupNorm (Task(dp_fix=True) applies Opacus's fixer)",
    "InstanceNorm1d": "set track_running_stats=False (Task(dp_fix=True) does so)",
    "InstanceNorm2d": "set track_running_stats=False (Task(dp_fix=True) does so)",
    "InstanceNorm3d": "set track_running_stats=False (Task(dp_fix=True) does so)",
    "LSTM": "use opacus.layers.DPLSTM (Task(dp_fix=True) swaps it)",
    "GRU": "use opacus.layers.DPGRU (Task(dp_fix=True) swaps it)",
    "RNN": "use opacus.layers.DPRNN (Task(dp_fix=True) swaps it)",
    "MultiheadAttention": "use opacus.layers.DPMultiheadAttention (Task(dp_fix=True) swaps it)",
}


@dataclass(frozen=True)
class DpProblem:
    """One layer Opacus cannot train privately, and how to fix it."""

    layer: str
    kind: str
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"layer '{self.layer}' ({self.kind}): {self.fix}"


def dp_problems(model: torch.nn.Module) -> list[DpProblem]:
    """Every trainable layer of ``model`` that Opacus refuses, by name; empty if none."""
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

    problems: list[DpProblem] = []
    for name, layer in trainable_modules(model):
        validator = ModuleValidator.VALIDATORS.get(type(layer))
        errors = validator(layer) if validator is not None else []
        if not errors and any(True for _ in layer.buffers(recurse=False)):
            # Opacus's grad sampler refuses a trainable layer with buffers: buffers
            # are not private and would not travel in updates.
            errors = [ValueError("a trainable layer with buffers")]
        for error in errors:
            kind = type(layer).__name__
            reason = str(error).split(". ")[0]
            fix = _FIXES.get(kind, f"Opacus refuses it: {reason}")
            problems.append(DpProblem(layer=name or "<model>", kind=kind, reason=reason, fix=fix))
    return problems


def check_dp_compatible(task_name: str, model: torch.nn.Module) -> None:
    """Refuse a model that Opacus cannot train with DP-SGD.

    Raises:
        DpIncompatibleModel: the message names each offending layer and its fix.
    """
    problems = dp_problems(model)
    if problems:
        raise DpIncompatibleModel(
            f"task '{task_name}' model cannot be trained with DP-SGD: "
            + "; ".join(str(p) for p in problems)
        )
