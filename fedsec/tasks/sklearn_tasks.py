"""Tasks on datasets bundled with scikit-learn (no download needed)."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits

from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams
from fedsec.tasks.models import DigitsCNN, TabularMLP
from fedsec.tasks.preprocessing import split_and_standardize

# 20% test matches the usual hold-out for these small sets (569 and 1797 samples).
TEST_FRACTION = 0.2


def breast_cancer_task() -> Task:
    """Wisconsin breast cancer: 30 standardized features, malignant (0) vs benign (1)."""
    feature_names = tuple(str(n) for n in load_breast_cancer().feature_names)

    def data(source: DataSource) -> TaskData:
        bunch = load_breast_cancer()
        x = np.asarray(bunch.data, dtype=np.float64)
        y = np.asarray(bunch.target, dtype=np.int64)
        return split_and_standardize(x, y, TEST_FRACTION, source.seed, standardize=True)

    return Task(
        name="breast_cancer",
        version="1",
        schema=TaskSchema(
            input_shape=(30,),
            num_classes=2,
            feature_names=feature_names,
            class_names=("malignant", "benign"),
        ),
        # SGD with momentum converges in a few epochs on 455 standardized rows and
        # tolerates the noise of DP-SGD better than Adam at this size.
        defaults=TrainingParams(
            lr=0.05, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: TabularMLP(30, 2, hidden=32),
        data=data,
    )


def digits_task() -> Task:
    """UCI handwritten digits: 1x8x8 images with pixel values scaled to [0, 1]."""

    def data(source: DataSource) -> TaskData:
        bunch = load_digits()
        # Pixels are counts 0..16; dividing by 16 keeps the natural image scale.
        x = np.asarray(bunch.data, dtype=np.float64).reshape(-1, 1, 8, 8) / 16.0
        y = np.asarray(bunch.target, dtype=np.int64)
        return split_and_standardize(x, y, TEST_FRACTION, source.seed, standardize=False)

    return Task(
        name="digits",
        version="1",
        schema=TaskSchema(
            input_shape=(1, 8, 8),
            num_classes=10,
            feature_names=None,
            class_names=tuple(str(d) for d in range(10)),
        ),
        defaults=TrainingParams(
            lr=0.05, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: DigitsCNN(10),
        data=data,
    )
