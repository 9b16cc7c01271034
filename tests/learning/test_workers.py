"""A round's training split over torchrun workers (2 gloo processes on loopback) takes
the step one process takes: the same update within float tolerance, with and without
DP-SGD (the same Poisson batches, clipping, noise added once, and ε), and a worker
killed mid-round, or one that stalls past the straggler timeout, is restarted and
resumes from its checkpoint to the same update, its privacy accounting included,
without a second charge to the ledger; the member's workers status records it."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save
from torch.utils.data import DataLoader, TensorDataset

from fedsec.agent import trainer as trainer_module
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.local_data import LocalData
from fedsec.agent.trainer import LocalTrainer
from fedsec.config import parse_agent_config
from fedsec.errors import ConfigError
from fedsec.learning import worker_job
from fedsec.learning import workers as workers_module
from fedsec.learning.dp_noise import CsprngPrivacyEngine
from fedsec.learning.training import DPParams, plan_round, train_dataset
from fedsec.learning.worker_job import STALL_TIMEOUTS, _RankSampler
from fedsec.learning.worker_privacy import (
    ShardOfBatch,
    accounting_state,
    poisson_batches,
    restore_accounting,
)
from fedsec.learning.worker_settings import TrainingWorkers
from fedsec.learning.worker_status import WorkersStatus, read_status, write_status
from fedsec.learning.workers import (
    TrainingWorkersFailed,
    _read_result,
    backend_for,
    clear_stale_jobs,
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
#: Far above a step of this model (milliseconds) even on 2 busy cores: the straggler
#: timeout is armed only once the ranks have met, so start-up skew does not count.
STRAGGLER_TIMEOUT_S = 5.0


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
        TrainingWorkers(workers=2, max_restarts=1, checkpoint_steps=4, checkpoint_interval_s=0),
        round_=7,
        crash_at_step=steps // 2 + 1,
    )
    assert (done.restarts, done.straggler_waits_s) == (1, ())  # a death, not a straggler
    assert (done.workers, done.trained.steps) == (2, steps)  # redone steps count once
    resumed = (steps // 2 + 1) // 4 * 4  # the last checkpoint
    assert done.resumed_from_step == resumed
    assert done.resumed_checkpoint_age_s is not None and done.resumed_checkpoint_age_s >= 0
    _close(flatten_params(model), expected)
    status = read_status(tmp_path)
    assert status is not None
    assert (status.round, status.state, status.workers, status.restarts) == (7, "done", 2, 1)
    assert (status.resumed_from_step, status.checkpoint_step) == (resumed, steps // 4 * 4)
    # the job and its records are gone; the status (counts and times only) stays
    assert [p.name for p in (tmp_path / "training").iterdir()] == ["workers.json"]


def test_cpu_uses_gloo_and_the_configured_count() -> None:
    cpu = torch.device("cpu")
    assert backend_for(cpu) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert (worker_count(0, cpu), worker_count(3, cpu)) == (1, 3)
    with pytest.raises(ConfigError, match=r"training\.workers must be"):
        worker_count(65, cpu)


@pytest.mark.slow  # a torchrun job: 15-30 s of process start-up on 2 busy cores
def test_dp_sgd_over_two_workers_one_stalled_is_one_processs_mechanism_charged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 adds one process's CSPRNG noise once to the all-reduced clipped sums of the
    # same Poisson batch, so the 2-worker update is one process's within float rounding
    # with the noise on (noise added on both ranks, or by neither, or a batch sampled
    # differently would be off by the noise's size), and ε is one process's exactly. The
    # last worker stalls mid-round, holding the ring: rank 0's all-reduce times out after
    # the straggler timeout (not the stall's 10 timeouts), torchrun restarts both, and
    # the accounting resumes from the checkpoint (redone steps counted once, no noise
    # stream reused); the agent's one charge stands alone in the ledger, which sits in
    # the job's own state directory.
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
        workers=TrainingWorkers(
            workers=2,
            max_restarts=1,
            checkpoint_steps=4,
            checkpoint_interval_s=0,
            straggler_timeout_s=STRAGGLER_TIMEOUT_S,
        ),
        state_dir=tmp_path,
    )
    assert not (tmp_path / "training" / "job-left").exists()  # a killed agent's job
    stall = functools.partial(train_with_workers, stall_at_step=steps // 2 + 1)
    monkeypatch.setattr(trainer_module, "train_with_workers", stall)
    model = TASK.build_model(0)
    with caplog.at_level(logging.INFO, logger="fedsec.agent.runtime"):
        done = trainer._train_model(model, PARAMS, dp, SEED, 1)
    resumed = (steps // 2 + 1) // 4 * 4
    assert f"restarts=1 stragglers=1 resumed_from_step={resumed}" in caplog.text
    # rank 0 gave up on the stalled worker after the timeout, not the stall's
    # STALL_TIMEOUTS timeouts
    waited = float(caplog.text.split("straggler_waits_s=")[1].split()[0])
    assert STRAGGLER_TIMEOUT_S <= waited < 2 * STRAGGLER_TIMEOUT_S
    assert STALL_TIMEOUTS >= 10
    assert (done.steps, done.sample_rate) == (steps, rate)
    assert done.epsilon_round == expected.epsilon_round
    _close(flatten_params(model), flatten_params(alone))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == charged
    assert len(PrivacyLedger(tmp_path).history("local")) == 1
    status = read_status(tmp_path)
    assert status is not None and (status.round, status.restarts) == (1, 1)
    assert [p.name for p in (tmp_path / "training").iterdir()] == ["workers.json"]


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


def test_rank_0_checkpoints_every_interval_as_well_as_every_n_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # checkpoints after 10 s or 5 steps, whichever comes first, and records each in the
    # member's workers status; the clock is the only thing faked
    clock = [100.0]
    monkeypatch.setattr(worker_job, "_now", lambda: clock[0])
    job = tmp_path / "training" / "job-x"
    job.mkdir(parents=True)
    write_status(tmp_path, WorkersStatus(3, 2, "running", 0.0))
    settings = {"checkpoint_steps": 5, "checkpoint_interval_s": 10.0, "straggler_timeout_s": 60.0}
    sharing = worker_job._Sharing(job, 0, 2, torch.device("cpu"), settings)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharing._attach(model, optimizer)
    taken = []
    for advance in (4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        clock[0] += advance
        optimizer.step()
        status = read_status(tmp_path)
        assert status is not None
        taken.append(status.checkpoint_step)
    # step 3 at 12 s (interval), step 5 (steps), then none until step 10 or 10 s after 5
    assert taken == [None, None, 3, 3, 5, 5, 5, 5]
    saved = load_file(str(job / "checkpoint.safetensors"))
    assert int(saved["steps"].item()) == 5


def test_only_a_rank_that_waited_the_whole_timeout_reports_a_straggler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a collective that fails at once (a dead peer) is a crash; one that fails after the
    # straggler timeout since this rank's last step is a straggler; and the job's log
    # yields, per attempt, the longest wait of its ranks
    clock = [50.0]
    monkeypatch.setattr(worker_job, "_now", lambda: clock[0])
    settings = {"checkpoint_steps": 0, "checkpoint_interval_s": 0.0, "straggler_timeout_s": 3.0}
    sharing = worker_job._Sharing(tmp_path, 1, 3, torch.device("cpu"), settings)
    worker_job._report_straggler(sharing)  # not armed: start-up skew is no straggler
    sharing.stepped_at = 50.0
    clock[0] = 51.0
    worker_job._report_straggler(sharing)
    assert capsys.readouterr().err == ""
    clock[0] = 53.5
    worker_job._report_straggler(sharing)
    line = capsys.readouterr().err
    assert line == "worker_straggler attempt=0 rank=1 step=1 waited_s=3.5 timeout_s=3\n"
    log = tmp_path / "torchrun.log"
    other = line.replace("rank=1", "rank=0").replace("3.5", "3.2")
    later = line.replace("attempt=0", "attempt=1")
    log.write_text(f"noise\n{line}{other}[rank0]: RuntimeError: Timed out\n{later}")
    assert workers_module._straggler_waits(log) == (3.5, 3.5)
    assert workers_module._straggler_waits(tmp_path / "absent.log") == ()


def test_agent_toml_straggler_and_interval_settings_are_checked_with_their_keys() -> None:
    base = (
        '[agent]\nid = "a0"\naggregator_url = "http://127.0.0.1:1"\n'
        f'aggregator_public_key = "{"ab" * 32}"\n[training]\n'
    )
    settings = parse_agent_config(
        base + "straggler_timeout_s = 5.5\ncheckpoint_interval_s = 0\n"
    ).training.settings
    assert (settings.straggler_timeout_s, settings.checkpoint_interval_s) == (5.5, 0.0)
    with pytest.raises(ConfigError, match=r"training\.straggler_timeout_s: expected a number > 0"):
        parse_agent_config(base + "straggler_timeout_s = 0\n")
    with pytest.raises(ConfigError, match=r"training\.checkpoint_interval_s: expected a number"):
        parse_agent_config(base + "checkpoint_interval_s = -1\n")


def test_a_trainer_on_a_following_node_is_refused(tmp_path: Path) -> None:
    # rank 0, whose weights the agent reads, lives on node 0: a trainer elsewhere is
    # refused when built, and leaves the state directory as it was
    following = TrainingWorkers(nodes=2, node_rank=1, rendezvous_endpoint="n0:29400")
    with pytest.raises(ConfigError, match="node_rank must be 0 where the agent runs"):
        LocalTrainer(
            "a0",
            b"\x00" * 32,
            LocalData(task=TASK, train=_dataset()),
            torch.device("cpu"),
            None,
            workers=following,
            state_dir=tmp_path,
        )
    assert list(tmp_path.iterdir()) == []


def test_a_killed_agents_job_is_removed_and_its_status_no_longer_says_running(
    tmp_path: Path,
) -> None:
    write_status(tmp_path, WorkersStatus(5, 2, "running", 10.0, checkpoint_step=8))
    (tmp_path / "training" / "job-left").mkdir()
    assert clear_stale_jobs(tmp_path) == ["job-left"]
    status = read_status(tmp_path)
    assert status is not None and status.ended_at is not None
    assert (status.state, status.round, status.checkpoint_step) == ("failed", 5, 8)
    write_status(tmp_path, WorkersStatus(6, 2, "done", 20.0, ended_at=30.0))
    assert clear_stale_jobs(tmp_path) == []
    assert read_status(tmp_path) == WorkersStatus(6, 2, "done", 20.0, ended_at=30.0)
