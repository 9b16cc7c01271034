"""Homomorphic summation in buffered (FedBuff) rounds: real agents, aggregator and
custodian over loopback, members training on whatever version they hold, stale
updates discounted by the member before it encrypts; the audit re-adds every sum and
re-derives every model version bit for bit.  DP is off here, so it also checks that a
federation without DP audits clean (its members report no noise and no charge)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("tenseal")

from fedsec.aggregator.workspace import Workspace
from fedsec.audit.verify import verify_log
from fedsec.protocol import wire
from fedsec.simulation import SimulationSpec, run_simulation

ROUNDS = 4


def test_buffered_he_rounds_close_discount_stale_updates_and_audit(tmp_path: Path) -> None:
    spec = SimulationSpec(
        task="breast_cancer",
        agents=6,
        rounds=ROUNDS,
        secure_sum="he",
        mode="buffered",
        buffer_size=3,
        max_staleness=2,
        slow_fraction=0.2,  # two members train 3x slower: their updates arrive stale
        slowdown=3.0,
        baseline=False,
        aggregator_process=False,
    )
    result = asyncio.run(run_simulation(spec, workdir=tmp_path))
    assert result["rounds"] == ROUNDS and result["aborted_rounds"] == 0

    ws = Workspace.open(tmp_path / "aggregator")
    try:
        specs = [
            msgspec.json.decode(r.spec, type=wire.RoundSpec)
            for r in ws.state.rounds.history()
            if r.stage == "closed" and r.spec is not None
        ]
    finally:
        ws.close()
    assert len(specs) == ROUNDS
    assert all(s.secure_sum == "he" and s.mode == "buffered" for s in specs)
    assert all(len(s.cohort) == 3 for s in specs)
    taus = [tau for s in specs for tau in s.staleness.values()]
    assert all(0 <= tau <= 2 for tau in taus) and any(tau > 0 for tau in taus)

    root = tmp_path / "aggregator"
    verified = verify_log(root / "audit" / "log.jsonl", root / "audit" / "archive", root)
    assert verified.ok, verified.problem
    assert verified.rounds_verified == ROUNDS
    assert verified.models_verified == ROUNDS  # each version re-derived from the decrypted sum
