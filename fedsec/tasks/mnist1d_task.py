"""MNIST-1D (Greydanus & Kobak): 1-D signals of 40 points, 10 classes, generated locally.

The data is produced by the ``mnist1d`` package's generator with the paper's default
arguments (5000 samples, 4000 train / 1000 test, generator seed 42), so every member
holds the same canonical dataset without any download.
"""

from __future__ import annotations

import functools
import random

import numpy as np

from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams, tensor_data
from fedsec.tasks.models import Mnist1dCNN

SIGNAL_LENGTH = 40


@functools.lru_cache(maxsize=1)
def _generate() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # Imported lazily: the generator pulls in scipy and takes ~1.5 s to run.
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds numpy's and random's global generators; restore them so that
    # loading a task never changes the caller's random streams.
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        # Never mnist1d.data.get_dataset(): it downloads from the network.
        raw = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x_train = np.asarray(raw["x"], dtype=np.float32).reshape(-1, 1, SIGNAL_LENGTH)
    x_test = np.asarray(raw["x_test"], dtype=np.float32).reshape(-1, 1, SIGNAL_LENGTH)
    y_train = np.asarray(raw["y"], dtype=np.int64)
    y_test = np.asarray(raw["y_test"], dtype=np.int64)
    for arr in (x_train, x_test, y_train, y_test):
        arr.setflags(write=False)  # shared by the cache: nobody may modify it
    return x_train, y_train, x_test, y_test


def mnist1d_task() -> Task:
    """MNIST-1D with the paper's CNN (about 94% test accuracy reported centrally)."""

    def data(source: DataSource) -> TaskData:
        # The paper's split is fixed by the generator; ``source.seed`` does not change it
        # so that every member and every run evaluates on the same 1000 test signals.
        x_train, y_train, x_test, y_test = _generate()
        return tensor_data(x_train.copy(), y_train.copy(), x_test.copy(), y_test.copy())

    return Task(
        name="mnist1d",
        version="1",
        schema=TaskSchema(
            input_shape=(1, SIGNAL_LENGTH),
            num_classes=10,
            feature_names=None,
            class_names=tuple(str(d) for d in range(10)),
        ),
        # The paper trains with Adam, lr 1e-2, batch 100.
        defaults=TrainingParams(lr=0.01, batch_size=100, local_epochs=1, optimizer="adam"),
        model=lambda: Mnist1dCNN(10, length=SIGNAL_LENGTH),
        data=data,
    )
