"""Buffered asynchronous rounds (FedBuff) over real HTTP: members train on whatever
version they hold, the first K to join form the SecAgg+ cohort, stale updates are
weighted by (1 + τ)^-½ and refused past the staleness bound."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import make_app
from fedsec.aggregator.transport import start_server
from fedsec.audit.verify import verify_log
from fedsec.errors import PayloadError, StaleUpdate
from fedsec.federation import agent_config, create_federation, enrol_agents, federation_toml
from fedsec.protocol import wire
from fedsec.task.digest import loaded_task_pin


@pytest.mark.asyncio
async def test_buffered_rounds_take_the_first_k_and_weight_stale_updates(tmp_path: Path) -> None:
    text = federation_toml(
        "buf",
        "breast_cancer",
        round_={
            "mode": "buffered",
            "buffer_size": 3,
            "max_staleness": 2,
            "min_agents": 3,
            "max_agents": 5,
            "rounds": 5,
            "advertise_s": 10.0,
        },
        training={"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        dp={"enabled": True, "noise_multiplier": 2.0},
        server={"port": 0},
    )
    ws = create_federation(tmp_path, "buf", "breast_cancer", text)
    agents = enrol_agents(ws, tmp_path, 5)
    server = await start_server(make_app(ws), "127.0.0.1", 0, None, ws.config.server)
    try:
        runtimes = [
            AgentRuntime(
                agent_config(
                    a,
                    url=server.url,
                    aggregator_public=ws.signer.public_bytes,
                    task="breast_cancer",
                    part_index=i,
                    parts=5,
                    partition="iid",
                    seed=3,
                    epsilon=200.0,
                ),
                a.identity,
                slowdown=10.0 if i == 4 else 1.0,
            )
            for i, a in enumerate(agents)
        ]
        await asyncio.wait_for(asyncio.gather(*(rt.run() for rt in runtimes)), timeout=180)
    finally:
        await server.close()

    specs = [
        msgspec.json.decode(r.spec, type=wire.RoundSpec)
        for r in ws.state.rounds.history()
        if r.stage == "closed" and r.spec is not None
    ]
    assert len(specs) == 5
    assert all(s.mode == "buffered" and len(s.cohort) == 3 for s in specs)
    # fast members fill the buffers; their staleness is within the bound
    assert all(0 <= tau <= 2 for s in specs for tau in s.staleness.values())
    # the slow member never holds up a buffer: most buffers close without it
    assert sum("agent-5" in s.cohort for s in specs) <= 2
    result = verify_log(ws.root / "audit" / "log.jsonl", ws.root / "audit" / "archive", ws.root)
    assert result.ok, result.problem
    ws.close()


def test_stale_or_missing_base_versions_are_refused(tmp_path: Path) -> None:
    text = federation_toml(
        "buf",
        "breast_cancer",
        round_={"mode": "buffered", "buffer_size": 3, "max_staleness": 1, "min_agents": 3},
        server={"port": 0},
    )
    ws = create_federation(tmp_path, "buf", "breast_cancer", text)
    enrol_agents(ws, tmp_path, 3)
    coord = Coordinator(ws)
    state = coord.round_state()
    assert state.mode == "buffered" and state.plan is not None and state.plan.cohort == []
    state.plan.verify(ws.signer.public_bytes)
    schema = coord.task.schema.fingerprint()

    def join(base: int | None) -> wire.JoinResponse:
        return coord.join(
            "agent-1",
            1,
            0,
            wire.JoinRequest(
                schema,
                coord.task.version,
                10,
                base_version=base,
                graph_commitment="00" * 32,
                task_pin=loaded_task_pin(coord.task.name),
            ),
        )

    with pytest.raises(PayloadError, match="buffered rounds need the model version"):
        join(None)
    with pytest.raises(PayloadError):
        join(99)  # a version from the future
    # make version 3 current: two rollbacks add versions
    ws.models.rollback(1)
    ws.models.rollback(1)
    with pytest.raises(StaleUpdate, match="2 versions behind"):
        join(1)
    assert ws.state.joins.samples(1, 0) == {}
    assert join(2).accepted
    ws.close()
