"""Operations a consortium relies on: rollback, a damaged model file at start-up, members
enrolled while the aggregator serves.  Coordinator-level, real SQLite and model files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedsec.aggregator.coordinator import Coordinator
from fedsec.audit.verify import verify_log
from fedsec.cli import main
from fedsec.protocol.roster import sign_roster_entry
from tests.support.aggregator import (
    FakeClock,
    Federation,
    advertise_all,
    fetch_shares,
    fix_cohort,
    identity_for,
    log_entries,
    make_federation,
    mask_all,
    model_params,
    share_all,
    unmask_all,
)

MEMBERS = ("a0", "a1", "a2")


def _round(coord: Coordinator, fed: Federation, members: tuple[str, ...]) -> None:
    """Run the current round to its close with ``members``."""
    cohort = fix_cohort(coord, fed.identities, members)
    assert coord.live.stage == "advertise"
    r = coord.live.round
    advertise_all(coord, cohort, members)
    share_all(coord, cohort, members)
    fetch_shares(coord, cohort, members)
    mask_all(coord, cohort, members)
    unmask_all(coord, cohort, members)
    assert coord.live.round == r + 1


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(tmp_path / "ws", MEMBERS)


def test_rollback_publishes_the_old_weights_as_a_new_signed_version(
    fed: Federation, tmp_path: Path
) -> None:
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    _round(coord, fed, MEMBERS)
    _round(coord, fed, MEMBERS)
    assert fed.ws.models.latest().version == 3

    result = CliRunner().invoke(
        main, ["aggregator", "rollback", "--workspace", str(fed.root), "--to", "2"]
    )
    assert result.exit_code == 0, result.output
    latest = fed.ws.models.latest()
    assert (latest.version, latest.kind, latest.parent) == (4, "rollback", 2)
    np.testing.assert_array_equal(model_params(fed.ws, 4), model_params(fed.ws, 2))
    assert [m.version for m in fed.ws.models.history()] == [1, 2, 3, 4]  # history kept

    # the next round trains from the rolled-back version, and the log records it
    _round(coord, fed, MEMBERS)
    spec_entries = [e for e in log_entries(fed.ws) if e["kind"] == "round_spec"]
    assert spec_entries[-1]["body"]["model_version"] == 4
    kinds = [e["kind"] for e in log_entries(fed.ws)]
    assert "rollback" in kinds
    assert fed.ws.models.latest().parent == 4
    result_v = verify_log(
        fed.root / "audit" / "log.jsonl", fed.root / "audit" / "archive", fed.root
    )
    assert result_v.ok, result_v.problem

    # rolling back to a version that does not exist changes nothing
    before = [m.version for m in fed.ws.models.history()]
    bad = CliRunner().invoke(
        main, ["aggregator", "rollback", "--workspace", str(fed.root), "--to", "99"]
    )
    assert bad.exit_code == 1 and "99" in bad.output and "Traceback" not in bad.output
    assert [m.version for m in fed.ws.models.history()] == before


def test_a_corrupted_newest_model_is_reported_and_the_last_good_one_used(
    fed: Federation,
) -> None:
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    _round(coord, fed, MEMBERS)
    good = fed.ws.models.get(1)
    newest = fed.ws.models.latest()
    path = fed.root / "models" / f"{newest.sha256}.safetensors"
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")

    restarted = Coordinator(fed.ws, clock=clock)
    assert any(f"version {newest.version}" in a for a in restarted.alerts)
    assert restarted.round_state().model_version == good.version
    alerts = [e for e in log_entries(fed.ws) if e["kind"] == "alert"]
    assert alerts and "does not match" in alerts[-1]["body"]["detail"]


def test_a_member_enrolled_while_serving_joins_the_next_cohort(fed: Federation) -> None:
    clock = FakeClock()
    coord = Coordinator(fed.ws, clock=clock)
    _round(coord, fed, MEMBERS)
    late = identity_for("late")
    fed.identities["late"] = late
    fed.ws.roster.add(
        sign_roster_entry(
            federation_id=fed.ws.federation_id,
            agent_id="late",
            public_key=late.public_bytes,
            role="agent",
            admin=fed.ws.admin(),
        )
    )
    coord.tick()  # the serving aggregator notices the roster change
    _round(coord, fed, (*MEMBERS, "late"))
    spec = [e for e in log_entries(fed.ws) if e["kind"] == "round_spec"][-1]["body"]
    assert "late" in spec["cohort"]
    assert any(
        e["kind"] == "roster" and e["body"]["agent_id"] == "late" for e in log_entries(fed.ws)
    )
