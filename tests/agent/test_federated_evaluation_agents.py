"""Federated evaluation end to end: real agents score each new global model on their own
held-out share and report signed sums over loopback; an aggregator that holds no data
(validation.enabled = false) shows their pooled value, which equals the model's score
on the union of the members' held-out records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.http import make_app
from fedsec.aggregator.rounds.evaluation import EVALUATION_STAGE
from fedsec.aggregator.transport import start_server
from fedsec.aggregator.workspace import Workspace
from fedsec.federation import agent_config, create_federation, enrol_agents, federation_toml
from fedsec.modelfile import decode_model
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.tasks import get_task
from fedsec.tasks.evaluation import evaluate_sums
from fedsec.tasks.params import arrays_to_state

AGENTS = 3
ROUNDS = 2
TASK = "diabetes"


@pytest_asyncio.fixture
async def federation(tmp_path: Path) -> AsyncIterator[tuple[Workspace, str]]:
    text = federation_toml(
        "fed",
        TASK,
        round_={
            "min_agents": AGENTS,
            "max_agents": AGENTS,
            "rounds": ROUNDS,
            "advertise_s": 5.0,
            "max_weight_samples": 100,
        },
        training={"local_epochs": 2, "batch_size": 32, "lr": 0.05},
        dp={"enabled": True, "noise_multiplier": 1.0},
        server={"port": 0},
        validation={"enabled": False, "federated": True},
    )
    ws = create_federation(tmp_path, "fed", TASK, text)
    agents = enrol_agents(ws, tmp_path, AGENTS)
    server = await start_server(make_app(ws), "127.0.0.1", 0, None, ws.config.server)
    runtimes = [
        AgentRuntime(
            agent_config(
                a,
                url=server.url,
                aggregator_public=ws.signer.public_bytes,
                task=TASK,
                part_index=i,
                parts=AGENTS,
                partition="iid",
                seed=1,
                epsilon=50.0,
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
            yield ws, await answer.text()
    finally:
        await server.close()
        ws.close()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_members_report_and_the_pooled_score_is_the_models_score_on_their_union(
    federation: tuple[Workspace, str],
) -> None:
    ws, metrics_text = federation
    task = get_task(TASK)
    data = task.load(0)
    rows = [r for r in ws.state.rounds.history() if r.stage == "closed"]
    assert len(rows) == ROUNDS
    for row in rows:
        # the aggregator holds no data: it scored nothing itself
        assert row.summary is not None and row.model_version is not None
        assert msgspec.json.decode(row.summary, type=wire.RoundSummary).metrics == {}
        reports = [
            msgspec.json.decode(body, type=wire.EvaluationReport)
            for _, body in ws.state.messages.of_stage(row.round, row.attempt, EVALUATION_STAGE)
        ]
        assert sorted(r.member for r in reports) == [f"agent-{i}" for i in range(1, AGENTS + 1)]
        # each member scored a disjoint share of the test split: together, all of it
        assert sum(r.records for r in reports) == len(data.y_test)
        assert all(r.model_version == row.model_version for r in reports)

        model = task.build_model(0)
        arrays_to_state(
            model, decode_model(ws.models.read(row.model_version), max_bytes=MAX_MODEL_BYTES)
        )
        central = evaluate_sums(model, data.x_test, data.y_test, task).values()
        totals: dict[str, list[float]] = {}
        for r in reports:
            for m in r.metrics:
                totals.setdefault(m.name, [0.0, 0.0])
                totals[m.name][0] += m.total
                totals[m.name][1] += m.weight
        pooled = {name: t / w for name, (t, w) in totals.items()}
        assert pooled.keys() == central.keys()
        for name, value in central.items():
            assert pooled[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name

    # /metrics follows the members' pooled scores of the newest model
    assert f"fedsec_model_evaluation_members {float(AGENTS)}" in metrics_text
    assert 'fedsec_model_primary_metric{higher_is_better="true",metric="r2"}' in metrics_text
    r2 = pooled["r2"]
    line = next(
        x for x in metrics_text.splitlines() if x.startswith("fedsec_model_primary_metric{")
    )
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(r2, rel=1e-9)


def test_held_out_shares_are_disjoint_and_a_report_counts_at_most_the_cap() -> None:
    from fedsec.agent.evaluation import _first, held_out_split
    from fedsec.config import DataSection

    task = get_task(TASK)
    shares = [
        held_out_split(task, DataSection(task=TASK, parts=3, part_index=i, partition="iid"))
        for i in range(3)
    ]
    indices = [set(s.indices) for s in shares]  # type: ignore[attr-defined]
    assert sum(len(i) for i in indices) == len(set().union(*indices)) == len(task.load().y_test)
    assert len(_first(shares[0], 5)) == 5  # type: ignore[arg-type]
    assert _first(shares[0], 10_000) is shares[0]
