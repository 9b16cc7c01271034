"""A round's training split over torchrun workers (2 gloo processes on loopback) takes
the step one process takes: the same update within float tolerance, with and without
DP-SGD (the same Poisson batches, clipping, noise added once, and ε), and a worker
killed mid-round is restarted and resumes from its checkpoint to the same update, its
privacy accounting included, without a second charge to the ledger."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save
from torch.utils.data import DataLoader, TensorDataset

from fedsec.agent import trainer as trainer_module
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.local_data import LocalData
from fedsec.agent.trainer import LocalTrainer
from fedsec.config import parse_agent_config
from fedsec.errors import ConfigError
from fedsec.learning.dp_noise import CsprngPrivacyEngine
from fedsec.learning.training import DPParams, plan_round, train_dataset
from fedsec.learning.worker_privacy import (
    ShardOfBatch,
    accounting_state,
    poisson_batches,
    restore_accounting,
)
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.workers import (
    TrainingWorkersFailed,
    _RankSampler,
    _read_result,
    backend_for,
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


def test_cpu_uses_gloo_and_the_configured_count() -> None:
    cpu = torch.device("cpu")
    assert backend_for(cpu) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert (worker_count(0, cpu), worker_count(3, cpu)) == (1, 3)
    with pytest.raises(ConfigError, match=r"training\.workers must be"):
        worker_count(65, cpu)


@pytest.mark.slow  # a torchrun job: 15-30 s of process start-up on 2 busy cores
def test_dp_sgd_over_two_workers_one_killed_is_one_processs_mechanism_charged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 adds one process's CSPRNG noise once to the all-reduced clipped sums of the
    # same Poisson batch, so the 2-worker update is one process's within float rounding
    # with the noise on (noise added on both ranks, or by neither, or a batch sampled
    # differently would be off by the noise's size), and ε is one process's exactly. The
    # last worker is SIGKILLed mid-round: the accounting resumes from the checkpoint
    # (redone steps counted once, no noise stream reused) and the agent's one charge
    # stands alone in the ledger, which sits in the job's own state directory.
    dp = DPParams(noise_multiplier=1.0, max_grad_norm=0.5, delta=1e-5)
    alone = TASK.build_model(0)
    expected = train_dataset(alone, _dataset(), PARAMS, dp, "cpu", SEED, task=TASK)
    rate, steps = plan_round(len(Y), PARAMS)
    assert (expected.sample_rate, expected.steps) == (rate, steps)
    ledger = PrivacyLedger(tmp_path)
    ledger.set_budget("local", 1000.0, dp.delta)
    ledger.charge("local", 1, dp.noise_multiplier, rate, steps)  # the agent's, before training
    charged = (tmp_path / "privacy_ledger.json").read_bytes()
    (tmp_path / "training" / "job-left").mkdir(parents=True)
    trainer = LocalTrainer(
        "a0",
        b"\x00" * 32,
        LocalData(task=TASK, train=_dataset()),
        torch.device("cpu"),
        None,
        workers=TrainingWorkers(workers=2, max_restarts=1, checkpoint_steps=4),
        state_dir=tmp_path,
    )
    assert not (tmp_path / "training" / "job-left").exists()  # a killed agent's job
    crash = functools.partial(train_with_workers, crash_at_step=steps // 2 + 1)
    monkeypatch.setattr(trainer_module, "train_with_workers", crash)
    model = TASK.build_model(0)
    with caplog.at_level(logging.INFO, logger="fedsec.agent.runtime"):
        done = trainer._train_model(model, PARAMS, dp, SEED, 1)
    assert f"restarts=1 resumed_from_step={(steps // 2 + 1) // 4 * 4}" in caplog.text
    assert (done.steps, done.sample_rate) == (steps, rate)
    assert done.epsilon_round == expected.epsilon_round
    _close(flatten_params(model), flatten_params(alone))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == charged
    assert len(PrivacyLedger(tmp_path).history("local")) == 1
    assert list((tmp_path / "training").iterdir()) == []


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_poisson_shards_are_one_processs_batches_resumed_or_not(world: int) -> None:
    # each rank runs one process's sampler from one process's seed and keeps its shard:
    # the shards are disjoint and their union is one process's batch, step for step,
    # and a rank resumed after k steps takes batches k.. of that same run
    def sampler(seed: int) -> DataLoader[tuple[torch.Tensor, ...]]:
        generator = torch.Generator().manual_seed(seed)
        plain = DataLoader(_dataset(), batch_size=16, shuffle=True, generator=generator)
        return poisson_batches(plain)

    alone = [list(batch) for batch in sampler(3).batch_sampler]
    assert len(alone) == 13 and sum(map(len, alone)) > 0
    for skip in (0, 5):
        ranks = [
            list(_RankSampler(sampler(3).batch_sampler, ShardOfBatch(len(Y), rank, world), skip))
            for rank in range(world)
        ]
        for step, whole in enumerate(alone[skip:]):
            parts = [shard[step] for shard in ranks]
            assert sorted(i for part in parts for i in part) == whole
            assert sum(map(len, parts)) == len(set().union(*parts))


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
def test_a_checkpoint_whose_accounting_is_not_its_steps_is_refused() -> None:
    # a checkpoint at step 8 that accounts for 7 steps would under-charge the round's ε
    # and reuse a noise stream: refused, and the accounting is left as it was
    engine = CsprngPrivacyEngine(b"k" * 32)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = engine._prepare_optimizer(
        optimizer=torch.optim.SGD([weight], lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    engine.accountant.history = [(1.0, 0.25, 7)]
    optimizer._noise_draws = 7
    saved = accounting_state(engine, optimizer)
    fresh = CsprngPrivacyEngine(b"k" * 32)
    with pytest.raises(ConfigError, match="accounts for 7 steps"):
        restore_accounting(fresh, optimizer, saved, 8)
    assert fresh.accountant.history == [] and optimizer._noise_draws == 7
    restore_accounting(fresh, optimizer, saved, 7)
    assert fresh.accountant.history == [(1.0, 0.25, 7)]


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
