"""Homomorphic summation as deployed: an aggregator process, a key custodian process and
five agent processes on loopback.  One agent dies after training in round 2, before its
ciphertexts go out; every round still closes, the custodian released exactly one
decryption per round, and ``fedsec audit verify`` re-adds the archived ciphertexts and
re-derives every model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from fedsec import faults
from fedsec.aggregator.workspace import Workspace
from fedsec.bench.common import federation_status
from fedsec.crypto.he import HeParams
from fedsec.custodian.store import create_custodian
from fedsec.federation import (
    LocalAgent,
    agent_config,
    create_federation,
    enrol_agents,
    federation_toml,
    load_observer,
    write_agent_config,
)
from fedsec.protocol import wire
from fedsec.protocol.roster import sign_roster_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

AGENTS = 5
ROUNDS = 3
TASK = "breast_cancer"
DEADLINE_S = 300.0


def _federation(root: Path, hidden: bool) -> tuple[Workspace, list[LocalAgent], Path]:
    text = federation_toml(
        "he-e2e",
        TASK,
        round_={
            "secure_sum": "he",
            "min_agents": 3,
            "max_agents": AGENTS,
            "rounds": ROUNDS,
            "open_s": 20.0,
            "advertise_s": 3.0,
            "masked_s": 8.0,
            "decrypt_s": 30.0,
        },
        training={"local_epochs": 1, "batch_size": 16, "lr": 0.1},
        dp={"enabled": True, "noise_multiplier": 1.0},
        server={"port": 0},
        he={"custodian": "keyholder", "model_visible_to_aggregator": not hidden},
        validation={"enabled": not hidden},
    )
    ws = create_federation(root, "he-e2e", TASK, text)
    local = enrol_agents(ws, root, AGENTS)
    manifest = create_custodian(root / "keyholder", "he-e2e", HeParams())
    ws.roster.add(
        sign_roster_entry(
            federation_id="he-e2e",
            agent_id="keyholder",
            public_key=bytes.fromhex(manifest.public_key),
            role="custodian",
            admin=ws.admin(),
        )
    )
    return ws, local, root / "keyholder"


@pytest.mark.parametrize("hidden", [False, True], ids=["model-visible", "model-hidden"])
def test_he_rounds_close_with_a_member_lost_and_verify(tmp_path: Path, hidden: bool) -> None:
    """With ``hidden``, every version the aggregator stores is a sealed release; the
    audit re-derives them only with a recipient's key."""
    ws, local, keyholder = _federation(tmp_path, hidden)
    aggregator_public = ws.signer.public_bytes
    ws.close()
    observer = load_observer(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSEC_")}
    cmd = [sys.executable, "-m", "fedsec"]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(name: str, args: list[str], extra: dict[str, str] | None = None) -> None:
        out = (logs / f"{name}.log").open("ab")
        procs[name] = subprocess.Popen(
            cmd + args, stdout=out, stderr=subprocess.STDOUT, env={**env, **(extra or {})}
        )

    try:
        launch("aggregator", ["aggregator", "serve", "--workspace", str(tmp_path / "aggregator")])
        info = tmp_path / "aggregator" / "serve.json"
        deadline = time.monotonic() + 60
        while not info.exists():
            assert procs["aggregator"].poll() is None, (logs / "aggregator.log").read_text()
            assert time.monotonic() < deadline, "the aggregator did not start"
            time.sleep(0.1)
        url = json.loads(info.read_text())["url"]
        launch(
            "keyholder",
            [
                "custodian",
                "serve",
                "--dir",
                str(keyholder),
                "--id",
                "keyholder",
                "--aggregator-url",
                url,
                "--aggregator-public-key",
                aggregator_public.hex(),
            ],
        )
        for i, agent in enumerate(local):
            cfg = agent_config(
                agent,
                url=url,
                aggregator_public=aggregator_public,
                task=TASK,
                part_index=i,
                parts=AGENTS,
                partition="iid",
                seed=0,
                epsilon=1e6,
            )
            write_agent_config(agent, cfg)
            # the last agent dies after training in round 2, before its upload
            fault = {faults.AGENT_ENV: "2:encrypted"} if i == AGENTS - 1 else None
            args = ["agent", "run", "--config", str(agent.config_path)]
            launch(f"agent-{i + 1}", args, fault)
        status = None
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            status = federation_status(url, observer)
            if status is not None and status.finished:
                break
            for name in ("aggregator", "keyholder"):
                assert procs[name].poll() is None, (logs / f"{name}.log").read_text()[-4000:]
            time.sleep(0.5)
        assert status is not None and status.finished, (logs / "keyholder.log").read_text()[-4000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert procs[f"agent-{AGENTS}"].returncode == -signal.SIGKILL

    ws = Workspace.open(tmp_path / "aggregator")
    try:
        closed = {
            r.round: msgspec.json.decode(r.summary, type=wire.RoundSummary)
            for r in ws.state.rounds.history()
            if r.stage == "closed" and r.summary is not None
        }
        assert sorted(closed) == list(range(1, ROUNDS + 1))
        # the lost member's ciphertexts never came: round 2 closed on the other four
        assert closed[2].dropped == [f"agent-{AGENTS}"] and closed[2].survivors == AGENTS - 1
        kinds = [json.loads(line)["kind"] for line in (ws.root / "audit" / "log.jsonl").open()]
        assert kinds.count("he_context") == 1
        assert kinds.count("he_decryption") == ROUNDS
        versions = [ws.models.get(v).kind for v in ws.models.versions_on_disk()]
        assert versions == ["initial"] + ["sealed" if hidden else "aggregate"] * ROUNDS
    finally:
        ws.close()
    decisions = [json.loads(line) for line in (keyholder / "decryptions.jsonl").open()]
    assert [d["outcome"] for d in decisions] == ["released"] * ROUNDS, decisions

    key = ["--key", str(local[0].root / "identity.key")] if hidden else []
    verify = subprocess.run(
        [*cmd, "audit", "verify", "--workspace", str(tmp_path), *key],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"model versions re-derived {ROUNDS}" in verify.stdout, verify.stdout
