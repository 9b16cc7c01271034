"""A homomorphic federation whose model the aggregator never sees
(``he.model_visible_to_aggregator = false``): real agents, aggregator and custodian over
loopback; every version the aggregator stores is a sealed release that only the
roster's recipients open, and the audit re-derives each one bit for bit with a
recipient's key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("tenseal")

from fedsec.audit.verify import verify_log
from fedsec.errors import FedsecError
from fedsec.keys import load_identity
from fedsec.protocol.he_release import open_release
from fedsec.simulation import SimulationSpec, run_simulation


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("hidden")
    spec = SimulationSpec(
        task="breast_cancer",
        agents=4,
        rounds=3,
        secure_sum="he",
        hide_model=True,
        dp_epsilon=8.0,
        baseline=False,
        aggregator_process=False,
    )
    result = asyncio.run(run_simulation(spec, workdir=root))
    return root, result


def test_every_round_closes_and_the_model_learns(federation: tuple[Path, dict]) -> None:
    _, result = federation
    assert result["aborted_rounds"] == 0
    assert result["final_accuracy"] > 0.8  # opened with the custodian's key


def _versions(root: Path) -> list[dict]:
    manifests = sorted((root / "aggregator" / "manifests").glob("*.json"))
    return [json.loads(p.read_text()) for p in manifests]


def test_the_aggregator_stores_only_sealed_releases(federation: tuple[Path, dict]) -> None:
    root, _ = federation
    kinds = [m["kind"] for m in _versions(root)]
    assert kinds == ["initial", "sealed", "sealed", "sealed"]


def test_only_recipients_open_a_hidden_version(federation: tuple[Path, dict]) -> None:
    """The collusion harness for the aggregate: everything the aggregator holds (its own
    keys, the admin's, the observer's) opens nothing; a member's key does."""
    root, _ = federation
    newest = _versions(root)[-1]
    data = (root / "aggregator" / "models" / f"{newest['sha256']}.safetensors").read_bytes()
    custodian = load_identity(root / "custodian" / "identity.key")
    values = _dim(root) + 1  # the sum's length: dim + 1 (the weight)
    held = {
        "aggregator": root / "aggregator" / "aggregator.key",
        "admin": root / "aggregator" / "admin.key",
        "observer": root / "operator" / "identity.key",
    }
    for name, path in held.items():
        identity = load_identity(path)
        with pytest.raises(FedsecError):
            open_release(data, custodian.public_bytes, name, identity.x25519_secret(), values)
        with pytest.raises(FedsecError):  # claiming a member's box does not help either
            open_release(data, custodian.public_bytes, "agent-1", identity.x25519_secret(), values)
    member = load_identity(root / "agent-1" / "identity.key")
    opened = open_release(data, custodian.public_bytes, "agent-1", member.x25519_secret(), values)
    assert len(opened.plaintext) == values * 8
    assert opened.model not in data  # the aggregator's file does not hold it in the clear


def _dim(root: Path) -> int:
    from fedsec.tasks import get_task

    return sum(p.numel() for p in get_task("breast_cancer").build_model(0).parameters())


def test_audit_re_derives_hidden_versions_only_with_a_recipient_key(
    federation: tuple[Path, dict],
) -> None:
    root, _ = federation
    ws = root / "aggregator"
    log, archive = ws / "audit" / "log.jsonl", ws / "audit" / "archive"
    blind = verify_log(log, archive, ws)
    assert blind.ok, blind.problem
    assert (blind.hidden_unopened, blind.models_verified) == (3, 0)
    member = load_identity(root / "agent-2" / "identity.key")
    opened = verify_log(log, archive, ws, reader=(member.public_bytes, member.x25519_secret()))
    assert opened.ok, opened.problem
    assert (opened.hidden_unopened, opened.rounds_verified, opened.models_verified) == (0, 3, 3)
