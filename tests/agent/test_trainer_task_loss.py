"""A member trains the round's model with its task's own loss: the update the agent
sends is the one the task's loss gives, not cross-entropy's."""

from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from fedsec.agent.local_data import LocalData
from fedsec.agent.trainer import LocalTrainer
from fedsec.faults import Faults
from fedsec.modelfile import encode_model, sha256_hex
from fedsec.tasks import get_task
from fedsec.tasks.params import state_to_arrays

BASE = get_task("breast_cancer")
DATA = BASE.load(0)
MODEL = encode_model(state_to_arrays(BASE.build_model(0)))


class _Client:
    async def model_bytes(self, version: int, max_bytes: int) -> bytes:
        return MODEL


def _spec(lr: float) -> Any:
    training = types.SimpleNamespace(lr=lr, batch_size=32, local_epochs=1, optimizer="sgd")
    dp = types.SimpleNamespace(enabled=False, mode="local")
    return types.SimpleNamespace(
        round=2,
        federation_id="f",
        model_version=1,
        model_sha256=sha256_hex(MODEL),
        he_model_hidden=False,
        training=training,
        dp=dp,
    )


def _update(task: Any, lr: float) -> np.ndarray:
    train = TensorDataset(
        torch.from_numpy(DATA.x_train[:120]), torch.from_numpy(DATA.y_train[:120])
    )
    local = LocalData(task=task, train=train)
    trainer = LocalTrainer(
        "a0", b"\x00" * 32, local, torch.device("cpu"), None, faults=Faults(seed="loss")
    )
    charge: Any = types.SimpleNamespace(steps=4, sample_rate=32 / 120)
    return asyncio.run(trainer.train(_Client(), _spec(lr), charge))  # type: ignore[arg-type]


def test_the_members_update_is_trained_with_the_tasks_loss() -> None:
    doubled = dataclasses.replace(BASE, loss=lambda o, y: 2.0 * F.cross_entropy(o, y))
    # twice the cross-entropy at lr is cross-entropy at 2 lr, exactly
    own = _update(doubled, 0.05)
    assert np.array_equal(own, _update(BASE, 0.1))
    assert not np.array_equal(own, _update(BASE, 0.05))
