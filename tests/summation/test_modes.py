"""The mode contract: every mode of :data:`fedsec.summation.MODES` declares what the
roles ask of it, consistently.  Parametrized over all of them, so a new mode is checked
as soon as it is registered."""

from __future__ import annotations

import msgspec
import pytest

from fedsec.config import FederationConfig, RoundSection
from fedsec.errors import ProtocolError
from fedsec.protocol import wire
from fedsec.protocol.stages import STAGES
from fedsec.summation import MODES, SessionInputs, SummationMode, mode_named, open_session
from tests.aggregator.test_summation import _spec

# distinct values, so a stage given another's window shows
ROUND = RoundSection(
    open_s=11.0, advertise_s=13.0, share_s=17.0, masked_s=19.0, unmask_s=23.0, decrypt_s=29.0
)
# each stage's window as the round engine's single table had it (sync, buffered)
WINDOWS = {
    "advertise": (13.0, 13.0),
    "share_keys": (17.0, 17.0),
    "commit": (30.0, 19.0),
    "masked_input": (30.0, 19.0),
    "consistency": (23.0, 23.0),
    "unmask": (23.0, 23.0),
    "decrypt": (29.0, 29.0),
}


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> SummationMode:
    return MODES[str(request.param)]


def test_a_mode_is_registered_under_its_name(mode: SummationMode) -> None:
    assert MODES[mode.name] is mode is mode_named(mode.name)
    with pytest.raises(ProtocolError, match="no summation mode 'p2p'"):
        mode_named("p2p")


def test_its_stages_are_distinct_stages_each_with_a_window(mode: SummationMode) -> None:
    assert mode.stages and len(set(mode.stages)) == len(mode.stages)
    assert set(mode.stages) <= set(STAGES) - {"open", "closed", "aborted"}
    assert set(mode.windows) == set(mode.stages)
    for stage in mode.stages:
        for buffered, expected in zip((False, True), WINDOWS[stage], strict=True):
            assert mode.stage_seconds(stage, ROUND, buffered) == expected
    assert mode.stage_seconds("open", ROUND, False) == float("inf")


def test_the_held_answers_follow_its_own_stages(mode: SummationMode) -> None:
    for upload, after in mode.held_answers.items():
        assert upload in mode.stages and after in mode.stages
        assert mode.stages.index(upload) < mode.stages.index(after)


def test_a_spec_carries_the_deadline_of_decrypt_only_where_it_decrypts(
    mode: SummationMode,
) -> None:
    deadlines = mode.spec_deadlines(ROUND)
    assert ("decrypt_s" in deadlines) == ("decrypt" in mode.stages) == mode.custodian_decrypts
    assert deadlines["train_s"] == ROUND.open_s and deadlines["unmask_s"] == ROUND.unmask_s


def test_a_graph_only_where_members_commit_to_it(mode: SummationMode) -> None:
    assert mode.graph(2, ROUND) == (0, 0)
    for n in (3, 7, 40):
        k, t = mode.graph(n, ROUND)
        if not mode.commits_graph:
            assert (k, t) == (0, 0)
        else:
            assert 2 <= k <= n - 1 and 2 <= t <= k


def test_a_secure_mode_needs_three_members_and_hides_every_update(mode: SummationMode) -> None:
    # a sum of two lets each member subtract its own update and read the other's
    assert mode.min_members == (1 if mode.sums_in_clear else 3)


def test_an_aggregation_rule_opens_only_where_updates_are_seen(mode: SummationMode) -> None:
    spec = msgspec.structs.replace(
        _spec(mode.name), aggregation=wire.AggregationSpec(rule="trimmed_mean")
    )
    if mode.sums_in_clear:
        assert open_session(spec, SessionInputs({}, 3)).stages == mode.stages
    else:
        with pytest.raises(ProtocolError, match="needs a trusted aggregator"):
            open_session(spec, SessionInputs({}, 3))


def test_its_config_problems_are_its_own(mode: SummationMode) -> None:
    cfg = msgspec.convert(
        {"federation": {"id": "f", "task": "breast_cancer"}, "round": {"secure_sum": mode.name}},
        FederationConfig,
    )
    problems = mode.config_problems(cfg)
    if mode.custodian_decrypts:
        assert problems == ["he.custodian: expected the roster id of the key custodian, got ''"]
    else:
        assert problems == []
