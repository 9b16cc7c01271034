"""Choose the torch device local training runs on."""

from __future__ import annotations

import torch

from fedsec.errors import ConfigError

DEVICE_SPECS = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def resolve_device(spec: str) -> torch.device:
    """Turn a device setting into a :class:`torch.device`.

    ``auto`` is the first CUDA GPU when one is usable and the CPU otherwise; ``cuda`` and
    ``cuda:N`` demand a GPU and fail loudly rather than silently training on the CPU.

    Raises:
        ConfigError: unknown spec, or a CUDA device that is not available.
    """
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index: int | None = None
        if text != "cuda":
            suffix = text.removeprefix("cuda:")
            if not suffix.isdigit():
                raise ConfigError(f"device {spec!r} is not understood; use {DEVICE_SPECS}")
            index = int(suffix)
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {spec!r} was requested but CUDA is not available on this machine "
                "(no GPU, or torch built without CUDA); use 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise ConfigError(
                f"device {spec!r} was requested but this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", 0 if index is None else index)
    raise ConfigError(f"device {spec!r} is not understood; use {DEVICE_SPECS}")
