"""Regression and multi-label tasks end to end: their losses and metrics keep the task
API's contracts (batch means, sums that pool exactly), and the bundled ``diabetes`` and
``digits_labels`` tasks run real federations on loopback (DP-SGD, FedAdam and a robust
rule), whose logs verify, whose dashboard and ``/metrics`` name the task's primary
metric, and whose members' updates pass the audit's control-sample checks."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.aggregator_client import AggregatorClient
from fedsec.audit.challenge import draw_challenges
from fedsec.audit.check import check_reveals
from fedsec.audit.control import load_control_sample
from fedsec.audit.verify import verify_log
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import InvalidTask, TaskMismatch
from fedsec.federation import agent_config, create_federation, enrol_agents, federation_toml
from fedsec.learning.training import DPParams, train_local
from fedsec.protocol import wire
from fedsec.protocol.roster import sign_roster_entry
from fedsec.task import MULTILABEL_METRICS, Task, TaskSchema, regression_metrics
from fedsec.tasks import get_task
from fedsec.tasks.beyond_classification import digit_labels
from fedsec.tasks.evaluation import evaluate_sums

DP = DPParams(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)


# --- the contracts -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["diabetes", "digits_labels"])
def test_bundled_tasks_keep_the_target_contract(name: str) -> None:
    task = get_task(name)
    data = task.load(0)
    k = task.schema.num_classes
    assert data.y_train.dtype == np.float32 and data.y_train.shape == (len(data.x_train), k)
    assert task.schema.target in ("value", "labels") and task.own_loss
    # the primary metric, named and with its direction, is what dashboards follow
    assert (task.primary_metric, task.higher_is_better) == {
        "diabetes": ("r2", True),
        "digits_labels": ("micro_f1", True),
    }[name]


def test_classification_schemas_keep_their_fingerprints() -> None:
    # the target is written only when it is not "class": pinned federations still agree
    schema = TaskSchema(input_shape=(30,), num_classes=2, class_names=("a", "b"))
    assert "target" not in schema.to_dict()
    value = dataclasses.replace(schema, num_classes=1, class_names=None, target="value")
    assert value.to_dict()["target"] == "value"
    assert TaskSchema.from_dict(value.to_dict()) == value
    assert value.fingerprint() != dataclasses.replace(value, target="labels").fingerprint()
    with pytest.raises(TaskMismatch, match="target 'ordinal' is not one of"):
        TaskSchema(input_shape=(3,), num_classes=1, target="ordinal")  # type: ignore[arg-type]


def test_a_value_task_must_declare_its_loss() -> None:
    base = get_task("diabetes")
    with pytest.raises(InvalidTask, match="value targets but the default cross-entropy"):
        dataclasses.replace(base, loss=get_task("digits").loss)


def test_metric_sums_pool_exactly_across_batches() -> None:
    out = torch.tensor([[0.5], [-1.0], [2.0], [0.0]])
    y = torch.tensor([[1.0], [-1.0], [1.0], [0.5]])
    reg = regression_metrics(target_variance=2.0)
    task = dataclasses.replace(get_task("diabetes"), metrics=reg, primary_metric="r2")
    whole = task.metric_sums(out, y)
    halves = [task.metric_sums(out[i : i + 2], y[i : i + 2]) for i in (0, 2)]
    for name in reg:
        assert whole[name][0] == pytest.approx(halves[0][name][0] + halves[1][name][0])
    se = ((out - y) ** 2).squeeze(1)
    assert whole["mae"] == (pytest.approx(float((out - y).abs().sum())), 4.0)
    assert whole["r2"][0] / whole["r2"][1] == pytest.approx(1 - float(se.mean()) / 2.0)

    logits = torch.tensor([[2.0, -1.0, 1.0], [-2.0, 1.0, -1.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    ml = dataclasses.replace(get_task("digits_labels"), metrics=MULTILABEL_METRICS)
    sums = ml.metric_sums(logits, labels)
    # predicted {0, 2} and {1}; true {0} and {1, 2}: TP 2, FP 1, FN 1 -> F1 = 4 / 6
    total, weight = sums["micro_f1"]
    assert total / weight == pytest.approx(4 / 6) and weight <= 2  # a share of the records
    assert sums["subset_accuracy"] == (0.0, 2.0)
    assert sums["label_accuracy"][0] == pytest.approx(4 / 3)


@pytest.mark.parametrize("name", ["diabetes", "digits_labels"])
def test_dp_sgd_trains_the_tasks_loss_and_evaluation_reports_every_metric(name: str) -> None:
    task = get_task(name)
    data = task.load(0)
    model = task.build_model(0)
    before = evaluate_sums(model, data.x_test, data.y_test, task).values()
    params = dataclasses.replace(task.defaults, local_epochs=4)
    result = train_local(model, data.x_train, data.y_train, params, DP, "cpu", seed=3, task=task)
    after = evaluate_sums(model, data.x_test, data.y_test, task).values()
    assert result.epsilon_round is not None and np.isfinite(result.train_loss)
    assert set(after) == {*task.metrics, "loss"}
    assert after["loss"] < before["loss"]  # DP-SGD minimised the task's own loss
    assert after[task.primary_metric] > before[task.primary_metric]


@pytest.mark.parametrize("name", ["diabetes", "digits_labels"])
def test_a_loss_that_is_not_a_scalar_is_refused_before_the_model_changes(name: str) -> None:
    task = get_task(name)
    per_record = dataclasses.replace(
        task, loss=lambda o, y: torch.nn.functional.mse_loss(o, y, reduction="none")
    )
    data = task.load(0)
    model = task.build_model(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InvalidTask, match=r"expected a scalar \(0-d\) tensor"):
        train_local(model, data.x_train, data.y_train, task.defaults, DP, "cpu", 1, task=per_record)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_digit_labels() -> None:
    labels = digit_labels(np.arange(10))
    assert labels[:, 0].tolist() == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]  # even
    assert labels[:, 1].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]  # greater than 4
    assert labels[:, 2].tolist() == [0, 0, 1, 1, 0, 1, 0, 1, 0, 0]  # prime


def test_control_samples_of_value_and_label_tasks(tmp_path: Path) -> None:
    task = get_task("digits_labels")
    path = tmp_path / "control.npz"
    np.savez(path, x=np.zeros((4, 1, 8, 8)), y=np.ones((4, 3)))
    x, y = load_control_sample(path, task)
    assert x.dtype == y.dtype == np.float32 and y.shape == (4, 3)
    np.savez(path, x=np.zeros((4, 1, 8, 8)), y=np.full((4, 3), 0.5))
    with pytest.raises(TaskMismatch, match="labels other than 0 and 1"):
        load_control_sample(path, task)
    np.savez(path, x=np.zeros((4, 10)), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(TaskMismatch, match=r"expected floating point targets"):
        load_control_sample(path, get_task("diabetes"))


# --- real federations ----------------------------------------------------------------------

FEDERATIONS: dict[str, dict[str, Any]] = {
    # SecAgg+ with FedAdam: the audit's control-sample checks run on its reveals
    "diabetes-secagg-fedadam": {
        "task": "diabetes",
        "round": {"secure_sum": "secagg"},
        "server": {"optimizer": "fedadam", "server_lr": 0.03},
        "rule": "fedavg",
    },
    # record-level distributed DP: members' clipped per-record gradients of the task's loss
    "diabetes-distributed-dp": {
        "task": "diabetes",
        "round": {"secure_sum": "secagg", "quant_bits": 16},
        "server": {"optimizer": "fedadam", "server_lr": 0.03},
        "rule": "fedavg",
        "dp": {"mode": "distributed", "unit": "record", "sample_rate": 0.25},
    },
    # FLTrust: the aggregator's reference update minimises the task's loss too
    "diabetes-fltrust": {
        "task": "diabetes",
        "round": {"secure_sum": "none"},
        "server": {"optimizer": "fedavg"},
        "rule": "fltrust",
    },
    # multi-label under SecAgg+ with FedAvg: the control-sample checks on its reveals too
    "digits_labels-secagg-fedavg": {
        "task": "digits_labels",
        "round": {"secure_sum": "secagg"},
        "server": {"optimizer": "fedavg"},
        "rule": "fedavg",
    },
    # a trusted aggregator with a robust rule, FedAvg
    "digits_labels-trimmed_mean": {
        "task": "digits_labels",
        "round": {"secure_sum": "none"},
        "server": {"optimizer": "fedavg"},
        "rule": "trimmed_mean",
    },
}


@dataclasses.dataclass
class Federation:
    ws: Workspace
    url: str
    task: Task
    runtimes: list[AgentRuntime]
    auditor: SigningIdentity
    metrics_text: str

    @property
    def log(self) -> Path:
        return self.ws.root / "audit" / "log.jsonl"


@pytest_asyncio.fixture(params=sorted(FEDERATIONS))
async def federation(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Federation]:
    setup = FEDERATIONS[request.param]
    name = setup["task"]
    text = federation_toml(
        "fed",
        name,
        # weights of 1 for the members' ~100 records: the quantization noise of a revealed
        # update grows as 1 / weight, and the checks judge what the update says
        round_={
            "min_agents": 3,
            "max_agents": 3,
            "rounds": 2,
            "advertise_s": 5.0,
            "max_weight_samples": 100,
        }
        | setup["round"],
        training={"local_epochs": 2, "batch_size": 32, "lr": 0.05},
        dp={"enabled": True, "noise_multiplier": 1.0} | setup.get("dp", {}),
        server={"port": 0} | setup["server"],
    )
    head, _, rest = text.partition("[aggregation]")
    text = head + "[aggregation]" + rest.replace('rule = "fedavg"', f'rule = "{setup["rule"]}"', 1)
    ws = create_federation(tmp_path, "fed", name, text)
    agents = enrol_agents(ws, tmp_path, 3)
    auditor = SigningIdentity.generate()
    ws.roster.add(
        sign_roster_entry(
            federation_id="fed",
            agent_id="auditor-1",
            public_key=auditor.public_bytes,
            role="auditor",
            admin=ws.admin(),
        )
    )
    server = await start_server(make_app(ws), "127.0.0.1", 0, None, ws.config.server)
    runtimes = [
        AgentRuntime(
            agent_config(
                a,
                url=server.url,
                aggregator_public=ws.signer.public_bytes,
                task=name,
                part_index=i,
                parts=3,
                partition="iid",
                seed=1,
                epsilon=50.0,
                allow_distributed="dp" in setup,
            ),
            a.identity,
        )
        for i, a in enumerate(agents)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(rt.run() for rt in runtimes)), timeout=240)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{server.url}/metrics") as answer,
        ):
            assert answer.status == 200
            metrics_text = await answer.text()
        yield Federation(ws, server.url, get_task(name), runtimes, auditor, metrics_text)
    finally:
        await server.close()
        ws.close()


def _closed_summaries(ws: Workspace) -> list[wire.RoundSummary]:
    rows = [r for r in ws.state.rounds.history() if r.stage == "closed" and r.summary]
    return [msgspec.json.decode(r.summary, type=wire.RoundSummary) for r in rows]  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_federation_trains_scores_and_audits_the_task(
    federation: Federation, tmp_path: Path
) -> None:
    fed, task = federation, federation.task
    summaries = _closed_summaries(fed.ws)
    assert len(summaries) == 2
    for s in summaries:
        # the aggregator's validation scored every metric of the task, named
        assert s.primary_metric == task.primary_metric
        assert s.higher_is_better == task.higher_is_better
        assert set(s.metrics) == {*task.metrics, "loss"} and s.accuracy is None
        assert s.score is not None and np.isfinite(s.score)
    # /metrics names the task's primary metric with its direction
    assert (
        f'fedsec_model_primary_metric{{higher_is_better="true",metric="{task.primary_metric}"}}'
        in fed.metrics_text
    )
    assert f'fedsec_model_metric{{metric="{task.primary_metric}"}}' in fed.metrics_text
    assert "fedsec_model_validation_accuracy" not in fed.metrics_text
    # the log verifies end to end, models included
    result = verify_log(fed.log, fed.ws.root / "audit" / "archive", fed.ws.root)
    assert result.ok, result.problem
    # the audit report names the task's primary metric in its table and chart
    from fedsec.audit.report import build_report

    page, _ = build_report(fed.log, fed.ws.root / "audit" / "archive", fed.ws.root)
    assert f"Validation {task.primary_metric} per round" in page
    assert f"<th class='n'>{task.primary_metric}</th>" in page
    # FLTrust's reference is trained on the aggregator's own root data, which the log
    # does not hold: its rounds cannot be re-derived (UNDERIVABLE_RULES), the rest can
    underivable = fed.ws.config.aggregation.rule == "fltrust"
    assert result.rounds_verified == (0 if underivable else 2)
    if fed.ws.config.round.secure_sum != "secagg" or fed.ws.config.dp.mode != "local":
        return  # the control-sample checks are calibrated for local DP-SGD updates
    # challenged members reveal; the control sample's checks judge them with the task's loss
    async with AggregatorClient(
        fed.url, fed.auditor, fed.ws.signer.public_bytes, timeout_s=10, retry_max=1
    ) as client:
        for req in draw_challenges(fed.log, rate=1.0):
            await client.challenge(req)
    for rt in fed.runtimes:
        async with rt.make_client() as client:
            await rt.answer_challenges(client, "fed")
    async with AggregatorClient(
        fed.url, fed.auditor, fed.ws.signer.public_bytes, timeout_s=10, retry_max=1
    ) as client:
        reveals = (await client.reveals()).reveals
    assert len(reveals) == 6
    data = task.load()
    control = tmp_path / "control.npz"
    np.savez(control, x=data.x_test, y=data.y_test)
    verdicts = check_reveals(fed.auditor, reveals, fed.log, fed.ws.root, control)
    assert len(verdicts) == 6
    # signal, direction and loss judge one DP-noised update against honest statistics,
    # so an honest update fails one of them at a small rate, and the noise comes from a
    # CSPRNG that no seed fixes: one such failure of six verdicts is that chance; two, or
    # any other test failing, is not.
    failed = [v for v in verdicts if not v["passed"]]
    statistical = {"signal", "direction", "loss"}
    assert len(failed) <= 1, [(v["member"], v["round"], v["failed"]) for v in failed]
    assert all(set(v["failed"]) <= statistical for v in failed), failed
    assert all("loss_change" in v["scores"] for v in verdicts)


def test_distributed_dp_reads_float_targets_as_floats() -> None:
    # record-level distributed DP reads the sampled records (training.records) and
    # takes their per-sample gradients: a regression target must stay a float (cast to
    # int64 it truncated the values, and MSE refused the dtype)
    from torch.utils.data import TensorDataset

    from fedsec.learning.distributed import clipped_gradient_sum
    from fedsec.learning.training import records

    task = get_task("diabetes")
    data = task.load(0)
    dataset = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    x, y = records(dataset, np.arange(8))
    assert y.dtype == np.float32 and np.array_equal(y, data.y_train[:8])
    model = task.build_model(0)
    include = np.ones(8, dtype=bool)
    summed, count = clipped_gradient_sum(model, x, y, include, 1e6, "cpu", task)
    assert count == 8
    expected = []
    for i in range(8):
        model.zero_grad()
        task.batch_loss(
            model, (torch.from_numpy(x[i : i + 1]), torch.from_numpy(y[i : i + 1]))
        ).backward()
        expected.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    np.testing.assert_allclose(summed, torch.stack(expected).sum(0).numpy(), rtol=1e-4, atol=1e-6)


def test_task_inspect_names_the_target_and_primary_metric() -> None:
    from click.testing import CliRunner

    from fedsec.task.cli import task

    shown = CliRunner().invoke(task, ["inspect", "diabetes"])
    assert shown.exit_code == 0, shown.output
    assert "(10,), 1 regression value" in shown.output
    assert "r2 (higher is better)" in shown.output
    shown = CliRunner().invoke(task, ["inspect", "digits_labels", "--json"])
    assert shown.exit_code == 0, shown.output
    report = msgspec.json.decode(shown.output)
    assert (report["target"], report["num_classes"], report["primary_metric"]) == (
        "labels",
        3,
        "micro_f1",
    )


def test_evaluate_reports_the_primary_metric_for_float_targets() -> None:
    # accuracy against truncated float targets would be meaningless (it read 61.0 for
    # diabetes): the baseline trainer and simulations get the task's primary metric
    from fedsec.learning.training import train_centralized
    from fedsec.tasks import evaluate

    task = get_task("diabetes")
    data = task.load(0)
    model = task.build_model(0)
    sums = evaluate_sums(model, data.x_test, data.y_test, task).values()
    assert evaluate(model, data.x_test, data.y_test, task=task) == (sums["r2"], sums["loss"])
    score, loss = train_centralized(task, data, epochs=3, device="cpu", seed=0)
    assert -1.0 < score <= 1.0 and score > sums["r2"] and loss < sums["loss"]


@pytest.mark.parametrize("name", ["loss", "AUC", "f1-score", "x" * 65])
def test_a_metric_name_reports_cannot_carry_is_refused(name: str) -> None:
    base = get_task("diabetes")
    with pytest.raises(InvalidTask, match="lower-case letters, digits or '_', and not 'loss'"):
        dataclasses.replace(base, metrics={**base.metrics, name: base.metrics["mae"]})
