"""Three hospitals whose exports differ (order, names, extra sensitive columns, missing
values, a category one lacks) train one model through their column rules; a fourth
whose data holds a category the federation does not know is refused before sending."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.workspace import Workspace
from fedsec.audit.verify import verify_log
from fedsec.data.example import RULES, SCHEMA, hospital_source, write_hospital_exports
from fedsec.data.sources import open_source
from fedsec.data.table import build_table
from fedsec.errors import TaskMismatch
from fedsec.faults import Faults
from fedsec.federation import (
    create_federation,
    enrol_agents,
    federation_toml,
    table_agent_config,
)
from fedsec.modelfile import decode_model
from fedsec.simulation import SimulationSpec, _serving
from fedsec.tasks import get_task
from fedsec.tasks.params import arrays_to_state
from tests.support.aggregator import log_entries

ROUNDS = 3
#: Training's batch order and rounding drawn from a fixed seed (unsafe, test only): with
#: fresh randomness the trained accuracy has a low tail that reaches the 0.7 bar now and
#: then; seeded, the test judges one reproducible number.
SEEDED = Faults(seed="hospitals")
#: Serve the aggregator in this test's event loop.
IN_PROCESS = SimulationSpec(aggregator_process=False)


def _accuracy(ws: Workspace, exports: dict[str, Path]) -> float:
    """The latest model on all three hospitals' records, standardised per hospital."""
    task = get_task("table", features=SCHEMA.feature_names(), classes=SCHEMA.classes)
    model = task.build_model(0)
    manifest = ws.models.latest()
    blob = ws.models.read(manifest.version)
    arrays_to_state(model, decode_model(blob, max_bytes=len(blob)))
    correct = total = 0
    for hospital, path in exports.items():
        table = build_table([open_source(hospital_source(path))], SCHEMA, RULES[hospital], None)
        x = (table.x - table.x.mean(0)) / np.where(table.x.std(0) == 0, 1, table.x.std(0))
        with torch.no_grad():
            predicted = model(torch.from_numpy(x.astype(np.float32))).argmax(1).numpy()
        correct += int((predicted == table.y).sum())
        total += len(table.y)
    return correct / total


@pytest.mark.timeout(300)
def test_three_hospital_exports_train_together(tmp_path: Path) -> None:
    exports = write_hospital_exports(tmp_path / "exports", rows=300)
    text = federation_toml(
        "hospitals",
        "table",
        round_={"min_agents": 3, "max_agents": 3, "rounds": ROUNDS, "advertise_s": 5.0},
        training={"local_epochs": 3, "batch_size": 16, "lr": 0.1},
        dp={"enabled": False},
        validation={"enabled": False},
        schema=SCHEMA,
    )
    ws = create_federation(tmp_path, "hospitals", "table", text)
    members = enrol_agents(ws, tmp_path, 3, prefix="hospital")
    names = ["hospital-a", "hospital-b", "hospital-c"]
    baseline = _accuracy(ws, exports)

    async def run() -> None:
        async with _serving(ws, IN_PROCESS) as url:
            runtimes = [
                AgentRuntime(
                    table_agent_config(
                        m,
                        url=url,
                        aggregator_public=ws.signer.public_bytes,
                        sources=[hospital_source(exports[h])],
                        rules=RULES[h],
                        schema=SCHEMA,
                        epsilon=1e9,
                        require_dp=False,
                    ),
                    m.identity,
                    faults=SEEDED,
                )
                for m, h in zip(members, names, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(rt.run() for rt in runtimes)), 240)

    asyncio.run(run())
    closed = [r for r in ws.state.rounds.history() if r.stage == "closed"]
    assert len(closed) == ROUNDS
    summaries = {
        e["body"]["member"]: e["body"] for e in log_entries(ws) if e["kind"] == "data_summary"
    }
    assert sorted(summaries) == ["hospital-1", "hospital-2", "hospital-3"]
    assert summaries["hospital-3"]["observed"]["columns"][3]["categories"] == ["current", "never"]
    assert summaries["hospital-2"]["missing_rate"]["bmi"] > 0.1
    assert all("@" not in str(s) and "-" not in str(s["observed"]) for s in summaries.values())
    audit = ws.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", ws.root)
    assert verified.ok, verified.problem  # the models of task table re-derive too
    assert verified.data_summaries == 3 and verified.models_verified == ROUNDS
    trained = _accuracy(ws, exports)
    assert trained > max(baseline, 0.7), (baseline, trained)
    ws.close()


def test_a_hospital_with_an_unknown_category_is_refused_before_sending(tmp_path: Path) -> None:
    exports = write_hospital_exports(tmp_path / "exports", rows=50)
    path = exports["hospital-a"]
    lines = path.read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if ",F," in line)  # line 0 is the header
    lines[row] = lines[row].replace(",F,", ",X,")
    path.write_text("\n".join(lines) + "\n")
    ws = create_federation(
        tmp_path,
        "hospitals",
        "table",
        federation_toml("hospitals", "table", schema=SCHEMA, validation={"enabled": False}),
    )
    (member,) = enrol_agents(ws, tmp_path, 1, prefix="hospital")
    config = table_agent_config(
        member,
        url="http://127.0.0.1:9",  # nothing listens: the refusal must come first
        aggregator_public=ws.signer.public_bytes,
        sources=[hospital_source(path)],
        rules=RULES["hospital-a"],
        schema=SCHEMA,
        epsilon=1.0,
    )
    with pytest.raises(TaskMismatch) as err:
        AgentRuntime(config, member.identity).prepare()
    assert err.value.detail == (
        "this member's data does not match the federation schema: column 'sex': expected "
        "categories within ['F', 'M'], found also ['X'] (first offending values: sex: "
        f"csv:hospital-a.csv row {row} holds a value outside the federation's list)"
    )
    ws.close()


@pytest.mark.timeout(300)
def test_noised_summary_counts_are_charged_reported_and_audited(tmp_path: Path) -> None:
    exports = write_hospital_exports(tmp_path / "exports", rows=200)
    text = federation_toml(
        "hospitals",
        "table",
        round_={"min_agents": 3, "max_agents": 3, "rounds": 1, "advertise_s": 5.0},
        dp={"enabled": True, "noise_multiplier": 1.0},
        validation={"enabled": False},
        schema=SCHEMA,
    )
    ws = create_federation(tmp_path, "hospitals", "table", text)
    members = enrol_agents(ws, tmp_path, 3, prefix="hospital")

    async def run() -> None:
        async with _serving(ws, IN_PROCESS) as url:
            runtimes = []
            for m, h in zip(members, ["hospital-a", "hospital-b", "hospital-c"], strict=True):
                cfg = table_agent_config(
                    m,
                    url=url,
                    aggregator_public=ws.signer.public_bytes,
                    sources=[hospital_source(exports[h])],
                    rules=RULES[h],
                    schema=SCHEMA,
                    epsilon=8.0,
                )
                data = msgspec.structs.replace(cfg.data, summary_epsilon=0.5)
                runtimes.append(AgentRuntime(msgspec.structs.replace(cfg, data=data), m.identity))
            await asyncio.wait_for(asyncio.gather(*(rt.run() for rt in runtimes)), 240)

    asyncio.run(run())
    entries = log_entries(ws)
    noised = [e["body"] for e in entries if e["kind"] == "data_summary"]
    reports = [e["body"] for e in entries if e["kind"] == "privacy_report"]
    assert len(noised) == 3 and all(s["count_epsilon"] == 0.5 for s in noised)
    assert len(reports) == 3 and all(r["extra_epsilon"] == 0.5 for r in reports)
    assert all(r["epsilon"] > 0.5 for r in reports)  # DP-SGD's share on top
    audit = ws.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", ws.root)
    assert verified.ok, verified.problem  # the DP-SGD share checked apart from the 0.5
    ledger = PrivacyLedger(members[0].root)
    assert ledger.pure_spent(ledger.datasets()[0]) == 0.5
    ws.close()
