"""A model's parameters as one flat float32 vector, and its state as named arrays.

Vector order: the model's trainable parameters (``requires_grad``) in
``named_parameters()`` order, which is also their order in ``state_dict()``, each
flattened in C order. Buffers and frozen parameters are excluded: they are not trained
locally, so they are never part of an update (the bundled models have neither).

Named arrays (:func:`state_to_arrays`) cover the whole ``state_dict`` and are what model
files hold (safetensors), so a file restores a model exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsec.errors import PayloadError, TaskMismatch


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters :func:`flatten_params` covers, in its order."""
    return [p for _, p in _trainable(model)]


def param_count(model: torch.nn.Module) -> int:
    """Length of :func:`flatten_params` for this model."""
    return sum(p.numel() for _, p in _trainable(model))


def flatten_params(model: torch.nn.Module) -> np.ndarray:
    """The trainable parameters as one new float32 CPU array (see module docstring)."""
    with torch.no_grad():
        pieces = [p.detach().reshape(-1).to("cpu", torch.float32) for _, p in _trainable(model)]
        if not pieces:
            return np.zeros(0, dtype=np.float32)
        return torch.cat(pieces).numpy().astype(np.float32, copy=True)


def load_flat_params(model: torch.nn.Module, vec: np.ndarray) -> None:
    """Overwrite the trainable parameters of ``model`` in place from ``vec``.

    Raises:
        TaskMismatch: ``vec`` is not 1-D of length :func:`param_count`.
        PayloadError: ``vec`` holds NaN or infinity.
    """
    flat = np.asarray(vec)
    expected = param_count(model)
    if flat.ndim != 1 or flat.shape[0] != expected:
        raise TaskMismatch(
            f"parameter vector has shape {flat.shape}, the model has {expected} parameters"
        )
    if not np.all(np.isfinite(flat)):
        raise PayloadError("parameter vector contains NaN or infinite values")
    source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for _, p in _trainable(model):
            n = p.numel()
            p.copy_(source[offset : offset + n].view_as(p))
            offset += n


def state_to_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every ``state_dict`` entry as a contiguous CPU numpy array, keyed by its name."""
    return {
        name: np.ascontiguousarray(t.detach().to("cpu").numpy()).copy()
        for name, t in model.state_dict().items()
    }


def arrays_to_state(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load named arrays (e.g. read from a safetensors file) into ``model`` in place.

    Keys, shapes and dtypes must match the model exactly; nothing is loaded otherwise.

    Raises:
        TaskMismatch: a key is missing or extra, or a shape or dtype differs.
    """
    state = model.state_dict()
    missing = sorted(set(state) - set(arrays))
    extra = sorted(set(arrays) - set(state))
    if missing or extra:
        raise TaskMismatch(f"model state does not match: missing {missing}, unexpected {extra}")
    tensors: dict[str, torch.Tensor] = {}
    for name, target in state.items():
        arr = np.asarray(arrays[name])
        tensor = torch.from_numpy(np.ascontiguousarray(arr))
        if tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
            raise TaskMismatch(
                f"model tensor '{name}' is {tensor.dtype} {tuple(tensor.shape)}, "
                f"expected {target.dtype} {tuple(target.shape)}"
            )
        tensors[name] = tensor
    model.load_state_dict(tensors, strict=True)
