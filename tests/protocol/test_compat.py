"""Feature compatibility: the federation's config and the signed spec refuse the same
combinations, from one table (fedsec.protocol.compat)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from fedsec.config import parse_federation_config
from fedsec.errors import ConfigError, ProtocolError
from fedsec.protocol import compat
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.wire import AggregationSpec, CodecSpec, DPSpec
from tests.protocol.test_update_codec import _spec

MODES = ("secagg", "none", "he")
COMBINATIONS = list(itertools.product(MODES, ("sync", "buffered"), *[(False, True)] * 4))


def _features(combo: tuple[Any, ...]) -> compat.Features:
    secure_sum, mode, ddp, compressed, feedback, robust = combo
    return compat.Features(
        secure_sum=secure_sum,
        round_mode=mode,
        distributed_dp=ddp,
        compressed=compressed,
        error_feedback=feedback,
        robust="aggregation.rule" if robust else "",
    )


def _toml(combo: tuple[Any, ...]) -> str:
    secure_sum, mode, ddp, compressed, feedback, robust = combo
    text = f'[federation]\nid = "fed"\n[round]\nsecure_sum = "{secure_sum}"\nmode = "{mode}"\n'
    if secure_sum == "he":
        text += '[he]\ncustodian = "cust"\n'
    if ddp:
        text += '[dp]\nenabled = true\nmode = "distributed"\nsample_rate = 0.1\n'
    text += "[codec]\n" + ("keep = 0.5\n" if compressed else "")
    text += "error_feedback = true\n" if feedback else ""
    text += '[aggregation]\nrule = "median"\n' if robust else ""
    return text


def _config_keys(text: str) -> set[str]:
    """The keys the config names among compat's keys (empty: it loads)."""
    keys = {r.key(f) for r in compat.RULES for f in map(_features, COMBINATIONS)} - {""}
    try:
        parse_federation_config(text)
    except ConfigError as exc:
        return {k for k in keys if f"{k}: " in str(exc)}
    return set()


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: str(c))
def test_the_config_refuses_exactly_what_the_table_refuses(combo: tuple[Any, ...]) -> None:
    if combo[0] == "he":
        pytest.importorskip("tenseal")
    expected = {c.key for c in compat.conflicts(_features(combo))}
    assert _config_keys(_toml(combo)) == expected


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: str(c))
def test_the_spec_refuses_what_the_table_refuses_with_the_same_sentence(
    combo: tuple[Any, ...],
) -> None:
    secure_sum, mode, ddp, compressed, feedback, robust = combo
    dp = (
        DPSpec(True, 1.0, 1.0, 1e-5, mode="distributed", sample_rate=0.1, min_survivors=3)
        if ddp
        else DPSpec(True, 1.0, 1.0, 1e-5)
    )
    spec = _spec(
        100,
        secure_sum=secure_sum,
        mode=mode,
        dp=dp,
        quant_bits=16,
        ring_bits=19,
        codec=CodecSpec(keep=0.5 if compressed else 1.0, error_feedback=feedback),
        aggregation=AggregationSpec(rule="median") if robust else None,
    )
    found = compat.conflicts(_features(combo))
    if not found:
        compat.check_spec(spec)
        return
    first = found[0]
    with pytest.raises(ProtocolError) as err:
        codec_for(spec)
    assert err.value.detail == f"round {spec.round}: {first.key}: {first.reason}"


def test_every_mode_has_traits_and_an_unknown_one_is_named() -> None:
    assert set(compat.SUMMATION) == set(MODES)
    with pytest.raises(ProtocolError, match="unknown summation mode 'p2p'"):
        compat.traits("p2p")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # passed the config and failed when the first spec was built, before one table
        (
            '[dp]\nenabled = true\nmode = "distributed"\nunit = "member"\n'
            "[codec]\nerror_feedback = true\n",
            "codec.error_feedback: cannot be on with distributed DP",
        ),
        # a cohort the SecAgg+ shares cannot index (x-coordinates are 16-bit)
        ("[round]\nmax_agents = 70000\n", "round.max_agents: expected an integer in 3..65535"),
    ],
)
def test_a_federation_whose_spec_would_be_refused_does_not_load(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_federation_config(f'[federation]\nid = "fed"\n{text}')
