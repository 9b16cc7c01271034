"""The global model a member trains on is exactly the one its signed round spec names,
fetched in one request where the spec's sha256 says all the manifest would."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
import torch

from fedsec.agent.trainer import LocalTrainer
from fedsec.errors import IntegrityError
from fedsec.modelfile import encode_model, sha256_hex
from fedsec.tasks.params import state_to_arrays


class _Client:
    """Serves one model file; the manifest is never asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls: list[str] = []

    async def manifest(self, version: int) -> Any:
        raise AssertionError("the spec's sha256 makes the manifest unnecessary")

    async def model_bytes(self, version: int, max_bytes: int) -> bytes:
        self.calls.append(f"model v{version}")
        return self.data


def _spec(sha256: str) -> Any:
    return types.SimpleNamespace(
        round=4,
        federation_id="f",
        model_version=3,
        model_sha256=sha256,
        he_model_hidden=False,
        dim=0,
    )


def _trainer() -> LocalTrainer:
    local: Any = None  # never read: no training here
    return LocalTrainer("a0", b"\x00" * 32, local, torch.device("cpu"), None)


def test_the_model_the_spec_names_is_loaded_without_its_manifest() -> None:
    torch.manual_seed(0)
    served = torch.nn.Linear(3, 2)
    data = encode_model(state_to_arrays(served))
    client = _Client(data)
    model = torch.nn.Linear(3, 2)
    asyncio.run(_trainer()._load_global_model(client, _spec(sha256_hex(data)), model))  # type: ignore[arg-type]
    assert client.calls == ["model v3"]
    assert torch.equal(model.weight, served.weight) and torch.equal(model.bias, served.bias)


def test_a_model_other_than_the_spec_names_is_refused_and_not_loaded() -> None:
    data = encode_model(state_to_arrays(torch.nn.Linear(3, 2)))
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(IntegrityError, match=r"not the .* round 4's signed spec names"):
        asyncio.run(_trainer()._load_global_model(_Client(data), _spec("ab" * 32), model))  # type: ignore[arg-type]
    assert torch.equal(model.weight, before)
