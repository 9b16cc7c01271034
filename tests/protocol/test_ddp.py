"""Distributed DP in the round spec: the discretisation every party derives, the
refusals of specs that cannot carry it, and unchanged local-DP spec bytes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import ProtocolError, QuantizationError
from fedsec.protocol.ddp import assumption, ddp_spec, rotation_seed
from fedsec.protocol.wire import DPSpec, RoundSpec
from fedsec.tasks import get_task
from fedsec.tasks.params import param_count
from tests.support.agent import signed_spec

SIGNER = SigningIdentity(bytes(range(32, 64)))
TASK = get_task("mnist1d")
DIM = param_count(TASK.build_model(0))
COHORT = tuple(f"m{i:02d}" for i in range(50))
DISTRIBUTED = DPSpec(
    enabled=True,
    noise_multiplier=2.3,
    max_grad_norm=1.0,
    delta=1e-5,
    mode="distributed",
    sample_rate=0.25,
    min_survivors=40,
)


def _spec(**changes: Any) -> RoundSpec:
    fields: dict[str, Any] = {
        "secure_sum": "secagg",
        "quant_bits": 16,
        "ring_bits": 23,
        "clip_norm": 40.0,
        "dp": DISTRIBUTED,
    }
    fields.update(changes)
    return signed_spec(
        SIGNER, TASK, federation_id="fed", model_sha256="ab" * 32, dim=DIM, cohort=COHORT, **fields
    )


def test_a_distributed_spec_yields_the_discretisation_and_its_assumption() -> None:
    spec = _spec()
    ddp = ddp_spec(spec)
    assert (ddp.dim, ddp.ring_bits, ddp.clip, ddp.sensitivity) == (DIM, 23, 40.0, 1.0)
    assert (ddp.noise_multiplier, ddp.min_survivors, ddp.max_members) == (2.3, 40, 50)
    assert ddp.inflation < 1.02
    assert "at least 40 of the 50 members add their noise share" in assumption(spec)
    assert assumption(_spec(dp=DPSpec(True, 1.0, 1.0, 1e-5))).startswith("local DP")
    # the rotation is shared by the attempt and fresh for the next one
    assert rotation_seed(spec) == rotation_seed(_spec())
    assert rotation_seed(spec) != rotation_seed(_spec(seed="22" * 32))


def test_an_impossible_bit_budget_is_refused_at_spec_time_with_the_reason() -> None:
    with pytest.raises(QuantizationError) as err:
        ddp_spec(_spec(quant_bits=4, ring_bits=11))
    assert str(err.value).startswith("round 1 asks for distributed DP, but its bit budget")
    assert "raise the quantization bits" in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"secure_sum": "none"}, "needs round.secure_sum = 'secagg'"),
        ({"dp": msgspec.structs.replace(DISTRIBUTED, sample_rate=0.0)}, "sampling rate"),
        ({"dp": msgspec.structs.replace(DISTRIBUTED, min_survivors=51)}, "must be 1..50"),
        ({"dp": DPSpec(True, 1.0, 1.0, 1e-5)}, "does not ask for distributed DP"),
    ],
)
def test_contradictory_distributed_specs_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        ddp_spec(_spec(**changes))


def test_local_dp_specs_keep_their_bytes_and_distributed_ones_round_trip() -> None:
    local = DPSpec(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    assert msgspec.json.encode(local) == (
        b'{"enabled":true,"noise_multiplier":1.0,"max_grad_norm":1.0,"delta":0.00001}'
    )
    spec = _spec()
    again = msgspec.json.decode(msgspec.json.encode(spec), type=RoundSpec)
    assert again == spec
    again.verify(SIGNER.public_bytes)
