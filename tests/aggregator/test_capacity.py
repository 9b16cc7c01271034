"""Connection and descriptor limits sized from the roster.

A roster of a few hundred members outgrew the fixed ``server.max_connections = 512``
(members were reset mid-round), and a process whose ``RLIMIT_NOFILE`` is below what its
connections need fails ``accept`` in the middle of a round.  Now the limit is sized from
the roster, the serving process raises its own soft descriptor limit to fit, and when
the hard limit is too low ``fedsec aggregator serve`` refuses to start, naming the
numbers and the fix.  The serving process runs with a lowered limit (``preexec_fn``).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fedsec.aggregator.capacity import (
    CONNECTION_HEADROOM,
    CONNECTIONS_PER_IDENTITY,
    DESCRIPTOR_HEADROOM,
    connection_limit,
    descriptors_needed,
)
from fedsec.aggregator.workspace import Workspace
from fedsec.federation import create_federation, enrol_agents, federation_toml

MEMBERS = 300
# the roster: the members and the operator's observer
IDENTITIES = MEMBERS + 1
NEEDED = descriptors_needed(IDENTITIES * CONNECTIONS_PER_IDENTITY + CONNECTION_HEADROOM)
START_S = 60.0
SERVE = [sys.executable, "-m", "fedsec", "aggregator", "serve", "--host", "127.0.0.1", "--port=0"]


def test_the_limit_is_sized_from_the_roster_unless_configured() -> None:
    assert connection_limit(0, 1000) == 1000 * CONNECTIONS_PER_IDENTITY + CONNECTION_HEADROOM
    assert connection_limit(0, 0) == CONNECTION_HEADROOM
    assert connection_limit(512, 1000) == 512  # an operator's explicit value stands


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("capacity")
    ws = create_federation(root, "cap", "breast_cancer", federation_toml("cap", "breast_cancer"))
    enrol_agents(ws, root, MEMBERS)
    assert len(ws.roster.entries()) == IDENTITIES
    ws.close()
    return root / "aggregator"


def _limited(soft: int, hard: int) -> Callable[[], None]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


def _serve(workspace: Path, soft: int, hard: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*SERVE, "--workspace", str(workspace)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_limited(soft, hard),
    )


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' in /proc/PID/limits")


def test_a_hard_limit_below_the_roster_refuses_to_start(federation: Path) -> None:
    """Before: the server started with 512 connections in a 512-descriptor process and
    reset members once the roster's connections arrived.  Now it does not start."""
    hard = NEEDED - 1
    proc = _serve(federation, 256, hard)
    try:
        _, err = proc.communicate(timeout=START_S)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert f"needs {NEEDED} file descriptors" in err
    assert f"at most {hard}" in err
    assert f"ulimit -n {NEEDED}" in err and f"LimitNOFILE={NEEDED}" in err
    assert "Traceback" not in err
    assert not (federation / "serve.json").exists()  # it never served
    ws = Workspace.open(federation)
    try:
        assert len(ws.roster.entries()) == IDENTITIES  # state untouched
    finally:
        ws.close()


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc/PID/limits")
def test_a_low_soft_limit_is_raised_to_fit_the_roster(federation: Path) -> None:
    hard = NEEDED + 1000
    proc = _serve(federation, 256, hard)
    info = federation / "serve.json"
    try:
        deadline = time.monotonic() + START_S
        while not info.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the aggregator did not start serving"
            time.sleep(0.05)
        assert json.loads(info.read_text())["pid"] == proc.pid
        assert _soft_limit_of(proc.pid) == NEEDED
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=START_S)
    assert f"event=descriptor_limit_raised from=256 to={NEEDED} hard={hard}" in err
    limit = NEEDED - DESCRIPTOR_HEADROOM
    assert f"event=connection_limit max_connections={limit} roster={IDENTITIES}" in err


def test_the_soft_limit_is_never_lowered() -> None:
    code = (
        "import resource\n"
        "from fedsec.aggregator.capacity import ensure_descriptors\n"
        "print(ensure_descriptors(100, 'a test'), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=_limited(2048, 4096),
    ).stdout.split()
    assert out == ["2048", "2048"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_few_hundred_members_close_a_round_within_a_raised_limit(tmp_path: Path) -> None:
    """``fedsec simulate`` of 300 members (its aggregator a child process) started with a
    soft limit of 1,024: both raise it to what the roster needs and the round closes;
    with the hard limit at 1,024 it stops at once, before enrolling anyone."""
    args = [sys.executable, "-m", "fedsec", "simulate", "--agents", str(MEMBERS)]
    args += ["--rounds", "1", "--task", "mnist1d", "--json"]
    refused = subprocess.run(
        args, capture_output=True, text=True, preexec_fn=_limited(1024, 1024), timeout=120
    )
    assert refused.returncode == 1
    assert "file descriptors but this process may open at most 1024" in refused.stderr
    ran = subprocess.run(
        args,
        capture_output=True,
        text=True,
        preexec_fn=_limited(1024, NEEDED + 1000),
        timeout=840,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert (result["rounds"], result["aborted_rounds"]) == (1, 0)
    assert result["connections_refused"] == 0
