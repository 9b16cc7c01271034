"""Opacus's verdict on a task's model, recorded so a long-running process need not
import Opacus to know it.

Importing any part of Opacus imports all of it (scipy.stats and sympy included): 50 to
100 MB that a serving aggregator, which never trains, would hold for as long as it runs
just to check the model once. So the check runs where it is cheap, and its passing is
recorded, bound to everything that decides it:

- ``fedsec aggregator init`` checks the model in its own short-lived process
  (:func:`fedsec.tasks.get_task`) and records the verdict in the workspace
  (:func:`record_passed`);
- ``fedsec aggregator serve`` compares the recorded verdict with the one it would
  record now (:func:`dp_verdict`: the task's pin, so its entry point, distribution,
  version and the digest of its files; its options; the versions of Opacus and fedsec,
  whose validator and rules give the verdict). Equal: the model passed, nothing is
  imported. Different or missing (the task package was upgraded, its options edited, a
  workspace from before the record): the check runs again in a child process
  (:func:`check_in_child`), which refuses the start with the same sentence ``init``
  would, or records the new verdict. A process that has imported Opacus already (a
  test, a tool) checks in its own: that costs it nothing more.

The record is a file of the aggregator's own workspace, beside its signing key: whoever
can forge it can sign as the aggregator, so it is not signed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec

from fedsec.errors import DpIncompatibleModel, InvalidTask
from fedsec.fsio import atomic_write
from fedsec.task.definition import Task
from fedsec.task.digest import loaded_task_pin

#: A child process imports torch, Opacus and the task's code, and builds one model:
#: 5 to 11 s measured on the 2-core development machine at load 4-5. Five minutes
#: allow a slower machine without letting a hung task hold a start for ever.
CHILD_TIMEOUT_S = 300.0

#: Exit status of a child whose check refused the model (its stdout is the sentence).
_REFUSED = 3


class DpVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a passed check was about: equal verdicts mean the same check would pass."""

    entry_point: str
    distribution: str
    version: str
    digest: str  # the installed distribution's files (fedsec.task.digest)
    options: str  # the task options as canonical JSON
    opacus: str  # the version of the validator that passed it
    fedsec: str  # the version of the rules around it (fedsec.task.dp)


def dp_verdict(task: Task) -> DpVerdict | None:
    """The verdict a check of ``task`` now would record, computed without importing
    Opacus; None when the task's options cannot be written as JSON (then only a check
    in this process can tell).

    Raises:
        UnknownTask, InvalidTask: the task's distribution cannot be pinned.
    """
    options = _options_json(task)
    if options is None:
        return None
    pin = loaded_task_pin(task.name)
    return DpVerdict(
        entry_point=pin.entry_point,
        distribution=pin.distribution,
        version=pin.version,
        digest=pin.digest,
        options=options,
        opacus=_installed("opacus"),
        fedsec=_installed("fedsec"),
    )


def record_passed(task: Task, record: Path) -> None:
    """Record that ``task``'s model passed the check (the caller just ran it).

    Raises:
        UnknownTask, InvalidTask: the task's distribution cannot be pinned.
    """
    verdict = dp_verdict(task)
    if verdict is not None:
        atomic_write(record, msgspec.json.encode(verdict))


def ensure_checked(task: Task, record: Path) -> None:
    """Refuse ``task`` if Opacus cannot train its model, importing Opacus in this
    process only where no child can check it.

    Args:
        task: the task as loaded here (its pin and options are the ones compared).
        record: where the verdict of the last passed check is kept.

    Raises:
        DpIncompatibleModel: the model does not pass; nothing is recorded.
        InvalidTask: the check could not run (the child failed otherwise).
        UnknownTask: the task's distribution cannot be pinned.
    """
    verdict = dp_verdict(task)
    if verdict is not None and _recorded(record) == verdict:
        return
    if verdict is None or "opacus" in sys.modules:
        # in this process: options no child can be handed, or Opacus already loaded
        # (a process that imported it pays nothing more to check here)
        from fedsec.task.dp import check_dp_compatible

        check_dp_compatible(task.name, task.build_model(0))
    else:
        check_in_child(task.name, verdict.options)
    if verdict is not None:
        atomic_write(record, msgspec.json.encode(verdict))


def check_in_child(name: str, options_json: str) -> None:
    """Run the check of task ``name`` with these options in a child process, which
    imports Opacus and exits.

    Raises:
        DpIncompatibleModel: the model does not pass (the child's sentence).
        InvalidTask: the child failed for another reason, or ran past
            :data:`CHILD_TIMEOUT_S`.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-c", "from fedsec.task.dp_verdict import _child; _child()"]
    try:
        done = subprocess.run(
            [*command, name, options_json],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InvalidTask(
            f"task '{name}': the DP compatibility check did not finish in {CHILD_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode == _REFUSED:
        raise DpIncompatibleModel(done.stdout.strip())
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise InvalidTask(
            f"task '{name}': the DP compatibility check failed (exit {done.returncode}): "
            + " / ".join(tail)
        )


def _child() -> None:
    """The child's side of :func:`check_in_child`: argv is the task's name and options."""
    from fedsec.errors import FedsecError
    from fedsec.task.discovery import load_task
    from fedsec.task.dp import check_dp_compatible

    name, options = sys.argv[1], json.loads(sys.argv[2])
    try:
        task = load_task(name, **options)
        check_dp_compatible(task.name, task.build_model(0))
    except DpIncompatibleModel as exc:
        print(exc.detail)
        sys.exit(_REFUSED)
    except FedsecError as exc:
        print(exc.detail)
        sys.exit(1)


def _recorded(record: Path) -> DpVerdict | None:
    try:
        return msgspec.json.decode(record.read_bytes(), type=DpVerdict)
    except (OSError, msgspec.DecodeError):
        return None  # none, unreadable or from another version: check again


def _options_json(task: Task) -> str | None:
    try:
        return json.dumps(dict(task.options), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _installed(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"
