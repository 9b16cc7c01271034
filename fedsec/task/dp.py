"""Whether a task's model can be trained with DP-SGD, by Opacus's own validator.

Opacus's ``ModuleValidator.validate`` lists its objections without saying which layer
raised them; here its per-layer validators run on each trainable layer by name, so a
refusal names every offending layer (``features.1``) and the fix for it.

The validator passes one pattern that Opacus's own hooks then refuse at the first step:
a module that changes its input in place (``nn.ReLU(inplace=True)`` after a norm layer,
as torchvision's ResNets build it) modifies the view Opacus's backward hook returned.
Every in-place module is refused here, before training, with the fix.
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


#: The fix for a module that modifies its input in place.
_INPLACE_FIX = "set inplace=False (Task(dp_fix=True) does so)"


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
    for name, module in _in_place_modules(model):
        kind = type(module).__name__
        reason = "modifies its input in place, which Opacus's per-sample hooks forbid"
        problems.append(DpProblem(name or "<model>", kind, reason, _INPLACE_FIX))
    return problems


def turn_off_in_place(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every in-place module set to ``inplace=False`` (the same values,
    computed out of place); part of ``Task(dp_fix=True)``."""
    for _name, module in _in_place_modules(model):
        setattr(module, "inplace", False)  # noqa: B010  # nn.Module types attributes as tensors
    return model


def _in_place_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose ``inplace`` flag is set (activations, dropout), by name."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "inplace", False) is True]


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
