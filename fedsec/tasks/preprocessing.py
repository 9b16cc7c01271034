"""Shared data preparation: train/test split and feature standardization."""

from __future__ import annotations

import numpy as np
from sklearn.model_selection import train_test_split

from fedsec.task.definition import TaskData, tensor_data


def split_and_standardize(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, standardize: bool
) -> TaskData:
    """Split ``x, y`` into train and test, optionally standardizing features.

    The split is stratified by label where every class has at least two samples (so
    both sides see every class), and plain random otherwise. Standardization uses the
    train split's mean and standard deviation only, so no test statistic leaks into
    training; constant features keep scale 1 instead of dividing by zero.
    """
    stratify = y if np.bincount(y).min(initial=2) >= 2 else None
    try:
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=test_fraction, random_state=seed, stratify=stratify
        )
    except ValueError:
        # Stratification fails when the test share is smaller than the class count.
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=test_fraction, random_state=seed, stratify=None
        )
    if standardize:
        mean = x_tr.mean(axis=0)
        std = x_tr.std(axis=0)
        std[std == 0] = 1.0
        x_tr = (x_tr - mean) / std
        x_te = (x_te - mean) / std
    return tensor_data(
        np.ascontiguousarray(x_tr, dtype=np.float32),
        np.ascontiguousarray(y_tr, dtype=np.int64),
        np.ascontiguousarray(x_te, dtype=np.float32),
        np.ascontiguousarray(y_te, dtype=np.int64),
    )
