"""Real agents run a sharded SecAgg+ round against the real aggregator app on a loopback
port: each derives its group's parameters from the signed spec, learns only its group's
keys, and the unmasked sum is exactly the sum of the updates the members kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fedsec.agent.runtime import AgentRuntime
from fedsec.agent.vault import Vault
from fedsec.audit.verify import verify_log
from fedsec.config import AgentConfig, AgentSection, DataSection, NetworkSection, PrivacySection
from tests.agent.test_agent_runtime import LIVE_ROUND, round_spec
from tests.support.agent import live_aggregator
from tests.support.aggregator import Federation, expected_params, make_federation, model_params

pytestmark = pytest.mark.slow  # six real agents train and run every stage over HTTP

MEMBERS = tuple(f"m{i}" for i in range(6))


def _config(root: Path, url: str, member: str, key: bytes) -> AgentConfig:
    return AgentConfig(
        agent=AgentSection(
            id=member,
            aggregator_url=url,
            aggregator_public_key=key.hex(),
            state_dir=str(root / member),
            device="cpu",
        ),
        data=DataSection(
            task="breast_cancer", parts=len(MEMBERS), part_index=MEMBERS.index(member), seed=0
        ),
        privacy=PrivacySection(epsilon=8.0, delta=1e-5),
        network=NetworkSection(
            retry_max=1, backoff_initial_s=0.01, backoff_max_s=0.02, timeout_s=20.0
        ),
    )


def test_agents_sum_a_sharded_round_over_http(tmp_path: Path) -> None:
    fed: Federation = make_federation(
        tmp_path / "aggregator",
        MEMBERS,
        round={
            **LIVE_ROUND,
            "rounds": 1,
            "min_agents": len(MEMBERS),
            "max_agents": len(MEMBERS),
            "max_weight_samples": 1000,
            "shards": 2,
            "min_shard_members": 3,
        },
        validation=False,
    )
    old = model_params(fed.ws, 1)

    async def main() -> dict[str, list[str]]:
        async with live_aggregator(fed) as live:
            key = fed.ws.signer.public_bytes
            runtimes = [
                AgentRuntime(
                    _config(tmp_path, live.url, m, key), fed.identities[m], poll_timeout_s=2.0
                )
                for m in MEMBERS
            ]
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(rt.run(max_rounds=1) for rt in runtimes)), 120
            )
        return {m: [o.status for o in outs] for m, outs in zip(MEMBERS, outcomes, strict=True)}

    assert asyncio.run(main()) == {m: ["closed"] for m in MEMBERS}
    spec = round_spec(fed, 1, 0)
    assert len(spec.groups) == 2 and sorted(m for g in spec.groups for m in g.members) == list(
        MEMBERS
    )
    kept = [Vault(tmp_path / m).load_update(1, 0).update for m in MEMBERS]
    np.testing.assert_array_equal(model_params(fed.ws, 2), expected_params(old, kept, spec))
    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
