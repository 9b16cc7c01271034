"""FLTrust's root dataset and reference update (fedsec.learning.reference)."""

from __future__ import annotations

import numpy as np
import pytest

from fedsec.errors import ConfigError
from fedsec.learning.reference import reference_seed, reference_update, root_dataset
from fedsec.tasks import get_task
from fedsec.tasks.params import flatten_params


def test_the_root_dataset_is_a_fixed_draw_from_the_training_split_only() -> None:
    data = get_task("breast_cancer").load(seed=0)
    x, y = root_dataset(data, 100)
    assert x.shape == (100, data.x_train.shape[1]) and y.shape == (100,)
    again = root_dataset(data, 100)
    np.testing.assert_array_equal(x, again[0])
    train = {row.tobytes() for row in data.x_train}
    test = {row.tobytes() for row in data.x_test}
    assert {row.tobytes() for row in x} <= train and not {row.tobytes() for row in x} & test
    with pytest.raises(ConfigError, match=r"aggregation\.root_records: expected an integer in"):
        root_dataset(data, len(data.y_train) + 1)


def test_the_reference_is_the_trained_change_clipped_and_repeatable() -> None:
    task = get_task("breast_cancer")
    x, y = root_dataset(task.load(seed=0), 60)
    model = task.build_model(0)
    before = flatten_params(model)
    seed = reference_seed("ab" * 32)
    wide = reference_update(model, x, y, task.defaults, clip_norm=100.0, seed=seed)
    np.testing.assert_array_equal(flatten_params(model), before)  # the model is untouched
    assert wide.dtype == np.float64 and np.linalg.norm(wide) > 0
    np.testing.assert_array_equal(
        reference_update(model, x, y, task.defaults, clip_norm=100.0, seed=seed), wide
    )
    tight = reference_update(model, x, y, task.defaults, clip_norm=1e-3, seed=seed)
    assert np.linalg.norm(tight) == pytest.approx(1e-3)
    np.testing.assert_allclose(tight / 1e-3, wide / np.linalg.norm(wide), rtol=1e-9)
    assert reference_seed("ab" * 32) != reference_seed("cd" * 32)
