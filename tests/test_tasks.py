"""Bundled tasks, schema checks, partitioners, parameter vectors and evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.errors import ConfigError, PayloadError, TaskMismatch
from fedsec.tasks import (
    TASKS,
    TaskSchema,
    check_schema,
    evaluate,
    get_task,
    parse_partition,
    partition_dirichlet,
    partition_iid,
)
from fedsec.tasks.params import (
    arrays_to_state,
    flatten_params,
    load_flat_params,
    param_count,
    state_to_arrays,
)

BUNDLED = {
    "breast_cancer": ((30,), 2, 455, 114),
    "digits": ((1, 8, 8), 10, 1437, 360),
    "mnist1d": ((1, 40), 10, 4000, 1000),
}


def _write_csv(path: Path, n: int = 60, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = ["age,income,label,height"]
    for i in range(n):
        label = ["10", "2", "3"][i % 3]
        lines.append(f"{rng.normal(40, 10):.3f},{rng.normal(5e4, 1e4):.1f},{label},{170 + i % 7}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- tasks -------------------------------------------------------------------------


def test_registry_names_all_tasks() -> None:
    assert set(TASKS) == {
        "breast_cancer",
        "digits",
        "mnist1d",
        "csv",
        "table",
        "diabetes",
        "digits_labels",
    }


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_task_loads_with_schema_shapes_and_dtypes(name: str) -> None:
    input_shape, n_classes, n_train, n_test = BUNDLED[name]
    task = get_task(name)
    data = task.load()
    assert task.schema.input_shape == input_shape
    assert task.schema.num_classes == n_classes
    assert data.x_train.shape == (n_train, *input_shape)
    assert data.x_test.shape == (n_test, *input_shape)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert set(np.unique(data.y_train)) == set(range(n_classes))
    again = task.load()
    np.testing.assert_array_equal(data.x_train, again.x_train)
    np.testing.assert_array_equal(data.y_test, again.y_test)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_model_is_deterministic_float32_and_opacus_compatible(name: str) -> None:
    from opacus.validators import ModuleValidator

    task = get_task(name)
    a, b, c = task.build_model(7), task.build_model(7), task.build_model(8)
    np.testing.assert_array_equal(flatten_params(a), flatten_params(b))
    assert not np.array_equal(flatten_params(a), flatten_params(c))
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert ModuleValidator.validate(a, strict=False) == []
    x = torch.from_numpy(task.load().x_test[:5])
    assert a(x).shape == (5, task.schema.num_classes)


def test_building_a_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    get_task("digits").build_model(0)
    np.testing.assert_array_equal(torch.rand(3).numpy(), expected.numpy())


def test_mnist1d_load_leaves_numpy_global_rng_untouched() -> None:
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    get_task("mnist1d").load()
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_breast_cancer_features_are_standardized_on_train_split() -> None:
    data = get_task("breast_cancer").load()
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(data.x_train.std(axis=0), 1.0, atol=1e-4)


def test_split_seed_changes_split_but_not_schema() -> None:
    task = get_task("breast_cancer")
    assert not np.array_equal(task.load(0).y_train, task.load(1).y_train)


def test_unknown_task_and_option_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown task 'cifar'"):
        get_task("cifar")
    with pytest.raises(ConfigError, match="no option"):
        get_task("digits", path="x.csv")
    with pytest.raises(ConfigError, match="requires option"):
        get_task("csv", path="x.csv")


# ---- csv -------------------------------------------------------------------------------


def test_csv_task_reads_standardizes_and_sorts_labels_numerically(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "local.csv")
    task = get_task("csv", path=str(path), label_column="label")
    assert task.schema.feature_names == ("age", "income", "height")
    assert task.schema.class_names == ("2", "3", "10")
    assert task.schema.input_shape == (3,)
    data = task.load()
    assert data.x_train.shape[0] + data.x_test.shape[0] == 60
    assert data.x_train.dtype == np.float32
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-5)
    model = task.build_model(0)
    assert model(torch.from_numpy(data.x_test)).shape == (len(data.x_test), 3)


def test_csv_feature_columns_and_federation_classes(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "local.csv")
    task = get_task(
        "csv",
        path=path,
        label_column="label",
        feature_columns=["income", "age"],
        classes=["2", "3", "10", "99"],
    )
    assert task.schema.feature_names == ("income", "age")
    assert task.schema.num_classes == 4
    with pytest.raises(TaskMismatch, match=r"labels \['10'\] outside"):
        get_task("csv", path=path, label_column="label", classes=["2", "3"])


def test_csv_errors_name_the_problem(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "local.csv")
    with pytest.raises(ConfigError, match="no label column 'target'"):
        get_task("csv", path=path, label_column="target")
    with pytest.raises(ConfigError, match=r"lacks feature columns \['weight'\]"):
        get_task("csv", path=path, label_column="label", feature_columns=["weight"])
    bad = tmp_path / "bad.csv"
    bad.write_text("a,label\n1.0,x\n,y\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="line 3 column 'a'"):
        get_task("csv", path=bad, label_column="label")
    with pytest.raises(ConfigError, match="cannot read CSV file"):
        get_task("csv", path=tmp_path / "missing.csv", label_column="label")


# ---- schema ------------------------------------------------------------------------


def test_schema_fingerprint_is_stable_and_sensitive() -> None:
    schema = get_task("breast_cancer").schema
    assert schema.fingerprint() == TaskSchema.from_dict(schema.to_dict()).fingerprint()
    assert len(schema.fingerprint()) == 64
    other = TaskSchema(schema.input_shape, schema.num_classes, schema.feature_names, None)
    assert other.fingerprint() != schema.fingerprint()


def test_check_schema_accepts_matching_fingerprint() -> None:
    task = get_task("digits")
    check_schema(task.schema.fingerprint(), task)


def test_check_schema_names_the_difference(tmp_path: Path) -> None:
    federation = get_task("csv", path=_write_csv(tmp_path / "a.csv"), label_column="label")
    other_csv = tmp_path / "b.csv"
    other_csv.write_text("age,income,label\n1,2,2\n3,4,3\n5,6,10\n", encoding="utf-8")
    local = get_task("csv", path=other_csv, label_column="label")
    with pytest.raises(TaskMismatch) as err:
        check_schema(federation.schema.fingerprint(), local, federation.schema)
    assert "input_shape expected (3,), local (2,)" in str(err.value)
    assert "missing locally ['height']" in str(err.value)
    # Without the federation's schema, the error still describes the local one.
    with pytest.raises(TaskMismatch, match=r"input_shape=\(2,\)"):
        check_schema(federation.schema.fingerprint(), local)


# ---- partitions ----------------------------------------------------------------------


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))
    assert all(len(p) > 0 for p in parts)


@settings(max_examples=40, deadline=None)
@given(n_parts=st.integers(1, 20), extra=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_iid_partition_covers_every_index_once(n_parts: int, extra: int, seed: int) -> None:
    n = n_parts + extra
    parts = partition_iid(n, n_parts, seed)
    _assert_exact_cover(parts, n)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    again = partition_iid(n, n_parts, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=40, deadline=None)
@given(
    n_parts=st.integers(1, 12),
    n=st.integers(12, 300),
    n_classes=st.integers(1, 6),
    alpha=st.sampled_from([0.01, 0.1, 0.5, 5.0]),
    seed=st.integers(0, 1000),
)
def test_dirichlet_partition_covers_every_index_once_and_no_part_is_small(
    n_parts: int, n: int, n_classes: int, alpha: float, seed: int
) -> None:
    labels = np.random.default_rng(seed).integers(0, n_classes, size=n)
    parts = partition_dirichlet(labels, n_parts, alpha, seed, min_size=1)
    _assert_exact_cover(parts, n)
    again = partition_dirichlet(labels, n_parts, alpha, seed, min_size=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_dirichlet_min_size_is_honoured_even_for_tiny_alpha() -> None:
    labels = np.repeat(np.arange(10), 50)
    parts = partition_dirichlet(labels, 20, 0.01, seed=3, min_size=10)
    _assert_exact_cover(parts, len(labels))
    assert min(map(len, parts)) >= 10


def _label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each part's label mix and the global one."""
    classes = np.unique(labels)
    global_mix = np.array([np.mean(labels == c) for c in classes])
    tvs = [
        0.5 * np.abs(np.array([np.mean(labels[p] == c) for c in classes]) - global_mix).sum()
        for p in parts
    ]
    return float(np.mean(tvs))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    labels = get_task("digits").load().y_train
    skews = [
        np.mean([_label_skew(labels, partition_dirichlet(labels, 10, a, s)) for s in range(3)])
        for a in (100.0, 1.0, 0.1)
    ]
    iid = _label_skew(labels, partition_iid(len(labels), 10, 0))
    assert skews[0] < skews[1] < skews[2]
    # A large alpha splits every class almost evenly, which is even more balanced than a
    # random IID cut; a small one is far more skewed than either.
    assert skews[2] > 0.5 > 4 * iid


def test_parse_partition() -> None:
    assert parse_partition("iid").kind == "iid"
    spec = parse_partition("dirichlet:0.5")
    assert (spec.kind, spec.alpha, str(spec)) == ("dirichlet", 0.5, "dirichlet:0.5")
    labels = np.arange(40) % 4
    _assert_exact_cover(spec.apply(labels, 4, seed=0), 40)
    for bad in ("dirichlet", "dirichlet:0", "dirichlet:-1", "dirichlet:x", "shards:2"):
        with pytest.raises(ConfigError, match="not understood"):
            parse_partition(bad)


def test_partition_refuses_too_few_samples() -> None:
    with pytest.raises(ConfigError, match="cannot split 3 samples into 4 parts"):
        partition_iid(3, 4, 0)
    with pytest.raises(ConfigError, match="at least 5"):
        partition_dirichlet(np.zeros(10, dtype=np.int64), 4, 0.5, 0, min_size=5)


# ---- parameter vectors -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_flatten_load_round_trip_is_exact(name: str) -> None:
    task = get_task(name)
    source, target = task.build_model(1), task.build_model(2)
    vec = flatten_params(source)
    assert vec.dtype == np.float32 and vec.shape == (param_count(source),)
    load_flat_params(target, vec)
    np.testing.assert_array_equal(flatten_params(target), vec)
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    vec[0] += 1.0  # flatten_params returns a copy, not a view of the weights
    assert flatten_params(source)[0] != vec[0]


def test_flatten_order_is_named_parameters_order() -> None:
    model = get_task("breast_cancer").build_model(0)
    expected = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    np.testing.assert_array_equal(flatten_params(model), expected)


def test_load_flat_params_refuses_wrong_length_and_nan() -> None:
    model = get_task("breast_cancer").build_model(0)
    before = flatten_params(model)
    with pytest.raises(TaskMismatch, match=f"the model has {len(before)} parameters"):
        load_flat_params(model, np.zeros(len(before) + 1, dtype=np.float32))
    bad = before.copy()
    bad[3] = np.nan
    with pytest.raises(PayloadError, match="NaN"):
        load_flat_params(model, bad)
    np.testing.assert_array_equal(flatten_params(model), before)


def test_state_arrays_round_trip_through_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    task = get_task("mnist1d")
    source, target = task.build_model(1), task.build_model(2)
    save_file(state_to_arrays(source), str(tmp_path / "model.safetensors"))
    arrays_to_state(target, load_file(str(tmp_path / "model.safetensors")))
    np.testing.assert_array_equal(flatten_params(target), flatten_params(source))


def test_arrays_to_state_refuses_mismatch_and_changes_nothing() -> None:
    model = get_task("breast_cancer").build_model(0)
    before = flatten_params(model)
    arrays = state_to_arrays(model)
    arrays["layers.0.weight"] = np.zeros((4, 4), dtype=np.float32)
    with pytest.raises(TaskMismatch, match=r"'layers\.0\.weight'"):
        arrays_to_state(model, arrays)
    del arrays["layers.0.weight"]
    with pytest.raises(TaskMismatch, match=r"missing \['layers\.0\.weight'\]"):
        arrays_to_state(model, arrays)
    np.testing.assert_array_equal(flatten_params(model), before)


# ---- evaluation --------------------------------------------------------------------


def test_evaluate_reports_accuracy_and_loss_and_restores_mode() -> None:
    task = get_task("digits")
    data = task.load()
    model = task.build_model(0)
    model.train()
    accuracy, loss = evaluate(model, data.x_test, data.y_test, "cpu")
    assert 0.0 <= accuracy <= 0.3  # untrained: near chance over 10 classes
    assert loss == pytest.approx(np.log(10), rel=0.1)
    assert model.training
