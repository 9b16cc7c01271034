"""The member's record of its last training workers job (``training/workers.json``):
written whole, read back as written, and a file that is not such a record is refused
with its name, the record left as it was."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fedsec.errors import ConfigError
from fedsec.learning.worker_status import (
    WorkersStatus,
    read_status,
    update_status,
    write_status,
)


def test_a_status_round_trips_and_updates_in_place(tmp_path: Path) -> None:
    assert read_status(tmp_path) is None
    assert update_status(tmp_path, restarts=1) is None  # no job: nothing invented
    assert not (tmp_path / "training").exists()
    write_status(tmp_path, WorkersStatus(4, 2, "running", 1000.0))
    path = tmp_path / "training" / "workers.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    update_status(tmp_path, checkpoint_step=50, checkpoint_at=1030.0)
    done = update_status(tmp_path, state="done", restarts=1, stragglers=1, ended_at=1060.0)
    assert done == read_status(tmp_path)
    assert done == WorkersStatus(4, 2, "done", 1000.0, 1, 1, 50, 1030.0, ended_at=1060.0)
    assert done.checkpoint_age_s(1042.5) == 12.5
    assert done.to_json(1042.5)["checkpoint_age_s"] == 12.5


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[]", b'{"state": "exploded"}', b'{"state": "done", "extra": 1}'],
)
def test_a_file_that_is_not_a_status_is_refused_and_left_alone(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "training" / "workers.json"
    path.parent.mkdir()
    path.write_bytes(body)
    with pytest.raises(ConfigError, match=r"workers\.json"):
        read_status(tmp_path)
    with pytest.raises(ConfigError, match=r"workers\.json"):
        update_status(tmp_path, restarts=1)
    assert path.read_bytes() == body


def test_a_status_missing_a_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "training" / "workers.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"state": "done", "workers": 2}))
    with pytest.raises(ConfigError, match="not a training workers status record"):
        read_status(tmp_path)
