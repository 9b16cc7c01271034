"""Training reads a map-style dataset through a DataLoader: records on disk train the
very model the same records in memory do, whatever the worker count."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from fedsec.agent.trainer import _sampled_gradient_sum
from fedsec.errors import ConfigError
from fedsec.learning.distributed import clipped_gradient_sum, poisson_sample
from fedsec.learning.training import (
    DPParams,
    loader_workers,
    plan_round,
    records,
    train_dataset,
    train_local,
)
from fedsec.tasks import get_task
from fedsec.tasks.params import flatten_params

DP = DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
TASK = get_task("breast_cancer")
DATA = TASK.load()


class OnDisk(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each record in its own .npy file, read when the loader asks for it."""

    def __init__(self, root: Any, x: np.ndarray, y: np.ndarray) -> None:
        self.paths = []
        self.read: list[int] = []  # in this process (workers read their own copies)
        for i in range(len(y)):
            path = root / f"{i}.npy"
            np.save(path, np.concatenate([x[i], [y[i]]]).astype(np.float64))
            self.paths.append(path)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(i)
        row = np.load(self.paths[i])
        return torch.from_numpy(row[:-1].astype(np.float32)), torch.tensor(int(row[-1]))


#: Held by a thread beside training for as long as training runs, as an event loop's
#: thread holds its locks at moments training cannot choose.
_BESIDE = threading.Lock()


class NeedsTheLock(OnDisk):
    """Reads a record under :data:`_BESIDE`, as a record reader that logs takes the
    logging module's lock."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not _BESIDE.acquire(timeout=10):
            raise RuntimeError("the loader worker inherited a lock held by another thread")
        try:
            return super().__getitem__(i)
        finally:
            _BESIDE.release()


def test_loader_workers_do_not_inherit_locks_other_threads_hold(tmp_path: Any) -> None:
    # A worker forked from the member's process would start with _BESIDE held and wait
    # on it forever (here: 10 s, then fail): the image example's federation hung so.
    data = NeedsTheLock(tmp_path, DATA.x_train[:64], DATA.y_train[:64])
    with _BESIDE:
        result = train_dataset(
            TASK.build_model(0), data, TASK.defaults, None, "cpu", seed=1, workers=2
        )
    assert result.samples == 64


@pytest.mark.parametrize("dp", [None, DP], ids=["plain", "dp"])
def test_records_on_disk_train_the_model_they_train_in_memory(tmp_path: Any, dp: Any) -> None:
    x, y = DATA.x_train[:200], DATA.y_train[:200]
    in_memory = TASK.build_model(0)
    expected = train_local(in_memory, x, y, TASK.defaults, dp, "cpu", seed=9)
    on_disk = TASK.build_model(0)
    data = OnDisk(tmp_path, x, y)
    assert loader_workers(data) >= 1
    result = train_dataset(on_disk, data, TASK.defaults, dp, "cpu", seed=9, workers=2)
    assert np.array_equal(flatten_params(on_disk), flatten_params(in_memory))
    assert (result.steps, result.samples, result.sample_rate) == (
        expected.steps,
        expected.samples,
        expected.sample_rate,
    )
    assert (result.sample_rate, result.steps) == plan_round(200, TASK.defaults)


def test_in_memory_records_are_read_without_workers() -> None:
    data = TensorDataset(torch.from_numpy(DATA.x_train), torch.from_numpy(DATA.y_train))
    assert loader_workers(data) == 0
    assert loader_workers(Subset(data, [0, 1])) == 0


def test_an_empty_dataset_is_refused_and_the_model_kept() -> None:
    model = TASK.build_model(0)
    before = flatten_params(model)
    empty = TensorDataset(torch.zeros(0, 30), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ConfigError, match="empty dataset"):
        train_dataset(model, empty, TASK.defaults, DP, "cpu", seed=0)
    assert np.array_equal(flatten_params(model), before)


def test_record_level_share_reads_only_the_sampled_records(tmp_path: Any) -> None:
    x, y = DATA.x_train[:100], DATA.y_train[:100]
    include = poisson_sample(100, 0.2, b"k" * 32)
    model = TASK.build_model(0)
    whole = clipped_gradient_sum(model, x, y, include, 1.0, "cpu", TASK)
    data = OnDisk(tmp_path, x, y)
    total, count = _sampled_gradient_sum(model, data, include, 1.0, torch.device("cpu"), TASK)
    assert count == whole[1] == int(include.sum())
    assert np.array_equal(total, whole[0])
    assert sorted(data.read) == np.flatnonzero(include).tolist()
    xs, ys = records(data, np.zeros(0, dtype=np.int64))
    assert len(xs) == len(ys) == 0
