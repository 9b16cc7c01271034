"""The whole product over loopback: `fedsec demo` as a user runs it.

Five agent processes and an aggregator process train breast_cancer with DP-SGD
and SecAgg+; agent-5 kills itself (SIGKILL) right after sharing its keys in round
4.  The round must still close, and its new model must be exactly the parent
plus the mean of the survivors' quantized updates (read back from each agent's
own vault), i.e. the dropped member's masks were removed and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fedsec.agent.vault import Vault
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.quantize import dequantize_sum
from fedsec.modelfile import decode_model
from fedsec.protocol import wire
from fedsec.tasks import get_task
from fedsec.tasks.params import arrays_to_state, flatten_params

pytestmark = pytest.mark.slow


def _params(ws: Workspace, version: int) -> np.ndarray:
    model = get_task(ws.config.federation.task).build_model(0)
    arrays_to_state(model, decode_model(ws.models.read(version), max_bytes=1 << 30))
    return flatten_params(model)


def test_demo_round_survives_an_agent_killed_after_share_keys(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "fedsec", "demo", "--workspace", str(root), "--rounds", "5"],
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,  # not a terminal: the demo must not linger
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 rounds closed" in proc.stdout
    # where to look, printed as soon as the aggregator is up
    lines = proc.stdout.splitlines()
    dashboard = next(line for line in lines if line.startswith("dashboard: http://127.0.0.1:"))
    metrics = next(line for line in lines if line.startswith("metrics: http://127.0.0.1:"))
    assert dashboard.endswith("/dashboard") and metrics.endswith("/metrics")
    assert lines.index(dashboard) < lines.index(next(x for x in lines if x.startswith("round ")))
    # the aggregator's operational log keeps its INFO events (Opacus' import-time
    # basicConfig once silenced them)
    served = (root / "logs" / "aggregator.log").read_text()
    assert "event=stage round=4" in served and "event=round_open round=5" in served

    ws = Workspace.open(root / "aggregator")
    try:
        rows = {r.round: r for r in ws.state.rounds.history() if r.stage == "closed"}
        assert sorted(rows) == [1, 2, 3, 4, 5]
        row = rows[4]
        assert row.summary is not None and row.spec is not None
        summary = msgspec.json.decode(row.summary, type=wire.RoundSummary)
        spec = msgspec.json.decode(row.spec, type=wire.RoundSpec)
        assert summary.dropped == ["agent-5"]
        survivors = [m for m in spec.cohort if m not in summary.dropped]
        assert len(survivors) == 4

        ring = np.zeros(spec.dim + 1, dtype=np.int64)
        for member in survivors:
            ring += Vault(root / member).load_update(4, row.attempt).update.astype(np.int64)
        quant = spec.quant_spec()
        weighted, weights = dequantize_sum(
            (ring & quant.ring_mask).astype(quant.dtype), len(survivors), quant
        )
        expected = _params(ws, spec.model_version) + (weighted / weights).astype(np.float32)
        assert row.model_version is not None
        np.testing.assert_allclose(_params(ws, row.model_version), expected, rtol=0, atol=1e-6)

        # every survivor holds a signed receipt for the contribution it made
        for member in survivors:
            receipts = [r for r in Vault(root / member).receipts() if r.round == 4]
            assert len(receipts) == 1
            receipts[0].verify(ws.signer.public_bytes)
    finally:
        ws.close()
