"""A regression task and a multi-label task on data bundled with scikit-learn.

``diabetes`` predicts disease progression a year after baseline from ten clinical
features (442 patients); ``digits_labels`` tags each 8x8 digit image with three
independent labels (even, greater than 4, prime). Both are declared through the same
public task API as a task package's, and nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_diabetes, load_digits
from sklearn.model_selection import train_test_split

from fedsec.task import (
    MULTILABEL_METRICS,
    DataSource,
    Task,
    TaskData,
    TaskSchema,
    TrainingParams,
    binary_cross_entropy,
    mean_squared_error,
    regression_metrics,
    tensor_data,
)
from fedsec.tasks.models import DigitsCNN, TabularMLP
from fedsec.tasks.preprocessing import split_and_standardize

# 20% test, the hold-out of the other bundled sklearn tasks.
TEST_FRACTION = 0.2
#: The digit properties ``digits_labels`` tags, in label-column order.
DIGIT_LABELS: tuple[str, ...] = ("even", "greater_than_4", "prime")
_PRIMES = (2, 3, 5, 7)


def diabetes_task() -> Task:
    """Diabetes progression: 10 standardized features, one standardized target.

    The target is standardized with the training split's mean and standard deviation,
    so MAE and MSE are in units of that deviation and R² is against the training
    targets' variance (1), the declared variance :func:`regression_metrics` needs to
    keep R² a sum that members can pool. The primary metric is R²: it has no unit, so
    the degradation alert's absolute drop (``[alerts] accuracy_drop``) means the same
    fraction of explained variance whatever the target's scale; MAE would need a
    threshold in the target's own units.
    """
    feature_names = tuple(str(n) for n in load_diabetes().feature_names)

    def data(source: DataSource) -> TaskData:
        bunch = load_diabetes()
        x = np.asarray(bunch.data, dtype=np.float64)
        y = np.asarray(bunch.target, dtype=np.float64).reshape(-1, 1)
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=TEST_FRACTION, random_state=source.seed
        )
        x_mean, x_std = x_tr.mean(axis=0), x_tr.std(axis=0)
        y_mean, y_std = y_tr.mean(axis=0), y_tr.std(axis=0)
        return tensor_data(
            np.ascontiguousarray((x_tr - x_mean) / x_std, dtype=np.float32),
            np.ascontiguousarray((y_tr - y_mean) / y_std, dtype=np.float32),
            np.ascontiguousarray((x_te - x_mean) / x_std, dtype=np.float32),
            np.ascontiguousarray((y_te - y_mean) / y_std, dtype=np.float32),
        )

    return Task(
        name="diabetes",
        version="1",
        schema=TaskSchema(
            input_shape=(10,),
            num_classes=1,
            feature_names=feature_names,
            class_names=("progression",),
            target="value",
        ),
        # As breast_cancer: SGD with momentum, which tolerates DP-SGD's noise on a few
        # hundred standardized rows better than Adam; at lr 0.05 the squared loss
        # oscillates between epochs (test R2 0.20, -0.05, 0.38 after 1, 3, 10 epochs
        # centrally), at 0.01 it settles (0.36, 0.34, 0.44).
        defaults=TrainingParams(
            lr=0.01, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: TabularMLP(10, 1, hidden=32),
        data=data,
        loss=mean_squared_error,
        metrics=regression_metrics(target_variance=1.0),
        primary_metric="r2",
    )


def digit_labels(digits: np.ndarray) -> np.ndarray:
    """The ``(n, 3)`` float32 0/1 labels of digits 0..9: even, greater than 4, prime."""
    d = np.asarray(digits)
    return np.stack([d % 2 == 0, d > 4, np.isin(d, _PRIMES)], axis=1).astype(np.float32)


def digits_labels_task() -> Task:
    """UCI digits as a multi-label task: three independent labels per 1x8x8 image.

    Primary metric micro-F1 (pooled over the three labels): subset accuracy is harsher
    and label accuracy rewards always answering the majority of each label.
    """

    def data(source: DataSource) -> TaskData:
        bunch = load_digits()
        x = np.asarray(bunch.data, dtype=np.float64).reshape(-1, 1, 8, 8) / 16.0
        digits = np.asarray(bunch.target, dtype=np.int64)
        # split on the digit (stratified as the digits task is), then label each side
        split = split_and_standardize(x, digits, TEST_FRACTION, source.seed, standardize=False)
        x_tr, d_tr = split.train.tensors  # type: ignore[attr-defined]
        x_te, d_te = split.test.tensors  # type: ignore[attr-defined]
        return tensor_data(
            x_tr.numpy(), digit_labels(d_tr.numpy()), x_te.numpy(), digit_labels(d_te.numpy())
        )

    return Task(
        name="digits_labels",
        version="1",
        schema=TaskSchema(
            input_shape=(1, 8, 8),
            num_classes=len(DIGIT_LABELS),
            class_names=DIGIT_LABELS,
            target="labels",
        ),
        defaults=TrainingParams(
            lr=0.05, batch_size=32, local_epochs=1, optimizer="sgd", momentum=0.9
        ),
        model=lambda: DigitsCNN(len(DIGIT_LABELS)),
        data=data,
        loss=binary_cross_entropy,
        metrics=MULTILABEL_METRICS,
        primary_metric="micro_f1",
    )
