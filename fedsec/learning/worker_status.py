"""What a member's last torchrun job of training workers did or is doing: its workers,
restarts, stragglers and checkpoints, for ``fedsec agent status`` and the agent's log.

One small JSON record, ``training/workers.json`` in the member's state directory, written
atomically (whole or absent) by the agent when a job starts and ends, and by the job's
rank 0 when an attempt starts and at each checkpoint; never by two at once (the agent
writes only before torchrun starts and after it exits). It holds counts and times only,
never records, weights or seeds. Torch-free, so ``fedsec agent status`` reads it without
importing torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Final, Literal

from fedsec.errors import ConfigError
from fedsec.fsio import atomic_write

__all__ = [
    "JOBS_DIR",
    "STATUS_FILE",
    "WorkersStatus",
    "read_status",
    "update_status",
    "write_status",
]

#: Where jobs live under the member's state directory (0700: they hold the records).
JOBS_DIR: Final = "training"
#: The record's name in :data:`JOBS_DIR` (beside the ``job-*`` directories, so it
#: outlives the job it describes).
STATUS_FILE: Final = "workers.json"

JobState = Literal["running", "done", "failed"]
_STATES: Final = ("running", "done", "failed")


@dataclass(frozen=True)
class WorkersStatus:
    """A job's progress. Times are Unix seconds (the agent and status may be different
    processes, so no monotonic clock); ``checkpoint_*`` is rank 0's last checkpoint,
    ``resumed_*`` the one the last restart resumed from and how old it was then (the
    training a restart redid); ``stragglers`` counts the restarts a worker caused by
    holding a step's all-reduce past ``training.straggler_timeout_s``."""

    round: int | None
    workers: int
    state: JobState
    started_at: float
    restarts: int = 0
    stragglers: int = 0
    checkpoint_step: int | None = None
    checkpoint_at: float | None = None
    resumed_from_step: int = 0
    resumed_checkpoint_age_s: float | None = None
    ended_at: float | None = None

    def checkpoint_age_s(self, now: float | None = None) -> float | None:
        """Seconds since the last checkpoint (at ``now``, default the present), or None."""
        if self.checkpoint_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.checkpoint_at)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The record, with the checkpoint's age at ``now`` (for ``--json``)."""
        return {**asdict(self), "checkpoint_age_s": self.checkpoint_age_s(now)}


def _path(state_dir: Path) -> Path:
    return Path(state_dir) / JOBS_DIR / STATUS_FILE


def write_status(state_dir: Path, status: WorkersStatus) -> None:
    """Replace the record atomically (0600, in a 0700 ``training/``)."""
    body = json.dumps(asdict(status), sort_keys=True).encode()
    atomic_write(_path(state_dir), body, mode=0o600, parents_mode=0o700)


def read_status(state_dir: Path) -> WorkersStatus | None:
    """The record, or None where no job has run.

    Raises:
        ConfigError: a record that is not this module's (names the file).
    """
    path = _path(state_dir)
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable training workers status: {exc}") from exc
    names = {f.name for f in fields(WorkersStatus)}
    if not isinstance(raw, dict) or not names >= set(raw) or raw.get("state") not in _STATES:
        raise ConfigError(f"{path}: not a training workers status record")
    try:
        return WorkersStatus(**raw)
    except TypeError as exc:
        raise ConfigError(f"{path}: not a training workers status record: {exc}") from exc


def update_status(state_dir: Path, **changes: Any) -> WorkersStatus | None:
    """Apply ``changes`` to the record and write it back; None (nothing written) where
    there is no record, e.g. a job started by a test without the agent.

    Raises:
        ConfigError: see :func:`read_status`.
    """
    current = read_status(state_dir)
    if current is None:
        return None
    updated = replace(current, **changes)
    write_status(state_dir, updated)
    return updated
