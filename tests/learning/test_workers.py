"""A round's training split over torchrun workers (2 gloo processes on loopback) takes
the step one process takes: the same update within float tolerance, and a worker killed
mid-round is restarted and resumes from its checkpoint to the same update."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save
from torch.utils.data import TensorDataset

from fedsec.agent.local_data import LocalData
from fedsec.agent.trainer import LocalTrainer
from fedsec.config import parse_agent_config
from fedsec.errors import ConfigError
from fedsec.learning.training import DPParams, train_dataset
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import (
    TrainingWorkersFailed,
    _read_result,
    backend_for,
    check_dp_split,
    train_with_workers,
    worker_count,
)
from fedsec.tasks import get_task
from fedsec.tasks.params import flatten_params

TASK = get_task("breast_cancer")
DATA = TASK.load()
# 203 records, batch 16: the epoch's last batch has 11 records, split 6 + 5
X, Y = DATA.x_train[:203], DATA.y_train[:203]
PARAMS = replace(TASK.defaults, batch_size=16, local_epochs=2, momentum=0.9)
SEED = 2**200 + 12345


def _dataset() -> TensorDataset:
    return TensorDataset(torch.from_numpy(X).float(), torch.from_numpy(Y).long())


def _one_process() -> tuple[np.ndarray, int]:
    model = TASK.build_model(0)
    result = train_dataset(model, _dataset(), PARAMS, None, "cpu", SEED, task=TASK)
    return flatten_params(model), result.steps


def _close(a: np.ndarray, b: np.ndarray) -> None:
    scale = float(np.max(np.abs(a)))
    assert float(np.max(np.abs(a - b))) <= 1e-5 * scale


@pytest.mark.slow  # a torchrun job: 15-30 s of process start-up on 2 busy cores
def test_two_workers_one_killed_train_the_update_one_process_trains(tmp_path: Path) -> None:
    # One torchrun job covers both promises (each start of a worker costs seconds of
    # imports): 2 workers take one process's steps, and the one SIGKILLed mid-round is
    # restarted with its peer, both resuming from rank 0's last checkpoint.
    expected, steps = _one_process()
    model = TASK.build_model(0)
    done = train_with_workers(
        model,
        _dataset(),
        PARAMS,
        torch.device("cpu"),
        SEED,
        TASK,
        {},
        tmp_path,
        TrainingWorkers(workers=2, max_restarts=1, checkpoint_steps=4),
        crash_at_step=steps // 2 + 1,
    )
    assert done.restarts == 1
    assert (done.workers, done.trained.steps) == (2, steps)  # redone steps count once
    assert done.resumed_from_step == (steps // 2 + 1) // 4 * 4  # the last checkpoint
    _close(flatten_params(model), expected)
    assert list((tmp_path / "training").iterdir()) == []  # the job and its records are gone


def test_dp_split_over_workers_is_refused_and_one_process_allowed() -> None:
    with pytest.raises(ConfigError, match="CSPRNG in one process"):
        check_dp_split(2, dp_enabled=True)
    check_dp_split(1, dp_enabled=True)
    check_dp_split(2, dp_enabled=False)


def test_cpu_uses_gloo_and_the_configured_count() -> None:
    cpu = torch.device("cpu")
    assert backend_for(cpu) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert (worker_count(0, cpu), worker_count(3, cpu)) == (1, 3)
    with pytest.raises(ConfigError, match=r"training\.workers must be"):
        worker_count(65, cpu)


def test_the_agent_refuses_dp_sgd_over_workers_before_any_job(tmp_path: Path) -> None:
    (tmp_path / "training" / "job-left").mkdir(parents=True)
    trainer = LocalTrainer(
        "a0",
        b"\x00" * 32,
        LocalData(task=TASK, train=_dataset()),
        torch.device("cpu"),
        None,
        workers=TrainingWorkers(workers=2),
        state_dir=tmp_path,
    )
    assert not (tmp_path / "training" / "job-left").exists()  # a killed agent's job
    model = TASK.build_model(0)
    before = flatten_params(model)
    dp = DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    with pytest.raises(ConfigError, match="CSPRNG in one process"):
        trainer._train_model(model, PARAMS, dp, SEED, 1)
    assert np.array_equal(flatten_params(model), before)
    assert list((tmp_path / "training").iterdir()) == []  # no job, no records written


def test_agent_toml_workers_out_of_range_is_refused_with_its_key() -> None:
    base = (
        '[agent]\nid = "a0"\naggregator_url = "http://127.0.0.1:1"\n'
        f'aggregator_public_key = "{"ab" * 32}"\n'
    )
    assert parse_agent_config(base + "[training]\nworkers = 4\n").training.settings == (
        TrainingWorkers(workers=4)
    )
    with pytest.raises(ConfigError, match=r"training\.workers"):
        parse_agent_config(base + "[training]\nworkers = 65\n")


def test_weights_that_are_not_the_models_are_refused(tmp_path: Path) -> None:
    # what the agent reads back from a job must be the model's own names and shapes
    model = TASK.build_model(0)
    before = flatten_params(model)
    state = {k: torch.zeros((*v.shape[::-1], 2)) for k, v in model.state_dict().items()}
    (tmp_path / "trained.safetensors").write_bytes(save(state))
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(TrainingWorkersFailed, match="not this model's"):
        _read_result(tmp_path, model, 2)
    assert np.array_equal(flatten_params(model), before)
