"""Distributed DP is refused, before anything is charged or trained, when the spec
sizes its noise for fewer survivors than the member's floor (``privacy.min_survivors``):
each member adds 1/``dp.min_survivors`` of the noise, which a member colluding with the
aggregator can remove."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedsec.agent import actions as act
from fedsec.agent.charging import Carryover
from fedsec.agent.member import Member
from fedsec.agent.round import AgentRound
from fedsec.config import AgentConfig, AgentSection, DataSection, PrivacySection, load_agent_config
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ConfigError
from fedsec.protocol.ddp import DEFAULT_MIN_SURVIVORS
from fedsec.protocol.wire import DPSpec, RoundSpec, RoundState
from fedsec.tasks import get_task
from fedsec.tasks.params import param_count
from tests.support.agent import signed_spec

AGGREGATOR = SigningIdentity(bytes(range(32, 64)))
ALICE = SigningIdentity(b"\x01" * 32)
COHORT = ("alice", "bob", "carol", "dave", "erin")
TASK = get_task("breast_cancer")
DIM = param_count(TASK.build_model(0))
DATASET = "breast_cancer-part0"
DELTA = np.full(DIM, 0.001, dtype=np.float32)


def distributed(min_survivors: int) -> DPSpec:
    return DPSpec(
        enabled=True,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        mode="distributed",
        sample_rate=0.25,
        min_survivors=min_survivors,
    )


def member(min_survivors: int = DEFAULT_MIN_SURVIVORS) -> Member:
    return Member(
        id="alice",
        identity=ALICE,
        aggregator_public=AGGREGATOR.public_bytes,
        dataset_id=DATASET,
        task=TASK,
        samples=120,
        dim=DIM,
        privacy_delta=1e-5,
        require_dp=True,
        allow_distributed=True,
        min_survivors=min_survivors,
    )


def spec(attempt: int = 0, **changes: Any) -> RoundSpec:
    fields: dict[str, Any] = {
        "secure_sum": "secagg",
        "dp": distributed(4),
        "ring_bits": 24,
        "attempt": attempt,
    }
    fields.update(changes)
    return signed_spec(
        AGGREGATOR,
        TASK,
        federation_id="fed",
        model_sha256="ab" * 32,
        dim=DIM,
        cohort=COHORT,
        **fields,
    )


def state(s: RoundSpec) -> RoundState:
    return RoundState(
        federation_id="fed",
        round=s.round,
        attempt=s.attempt,
        stage="advertise",
        token=1,
        model_version=1,
        rounds_completed=0,
        rounds_target=3,
        finished=False,
        spec=s,
    )


# -- the floor on distributed DP's survivors ---------------------------------------------------


def test_distributed_noise_sized_below_the_floor_is_refused_before_training() -> None:
    carry = Carryover()
    s = spec(dp=distributed(2))
    with pytest.raises(ConfigError) as err:
        AgentRound(state(s), member(min_survivors=4), carry, long_poll_s=5.0)
    detail = str(err.value)
    assert "noise sized for 2 survivors, fewer than the 4" in detail
    assert "privacy.min_survivors = 4" in detail
    assert carry.last_cost is None and carry.unused_charge is None  # nothing charged


def test_distributed_noise_sized_at_the_floor_is_taken() -> None:
    s = spec(dp=distributed(4))
    round_ = AgentRound(state(s), member(min_survivors=4), Carryover(), long_poll_s=5.0)
    assert isinstance(round_.next(), act.FetchRoster)


def test_the_floor_is_read_from_agent_toml_and_checked(tmp_path: Path) -> None:
    base = AgentConfig(
        agent=AgentSection(
            id="alice",
            aggregator_url="http://127.0.0.1:1",
            aggregator_public_key=AGGREGATOR.public_bytes.hex(),
            state_dir=str(tmp_path),
        ),
        data=DataSection(task="breast_cancer"),
        privacy=PrivacySection(),
    )
    assert base.privacy.min_survivors == DEFAULT_MIN_SURVIVORS == 2
    text = (
        "[agent]\n"
        'id = "alice"\n'
        'aggregator_url = "http://127.0.0.1:1"\n'
        f'aggregator_public_key = "{AGGREGATOR.public_bytes.hex()}"\n'
        f'state_dir = "{tmp_path}"\n'
        "[data]\n"
        'task = "breast_cancer"\n'
        "[privacy]\n"
    )
    path = tmp_path / "agent.toml"
    path.write_text(text + "min_survivors = 10\n")
    assert load_agent_config(path).privacy.min_survivors == 10
    path.write_text(text + "min_survivors = 0\n")
    with pytest.raises(ConfigError, match=r"privacy\.min_survivors"):
        load_agent_config(path)
