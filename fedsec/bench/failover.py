"""Failover benchmark: a leader and a standby ``fedsec aggregator serve`` on one
PostgreSQL database, the leader SIGKILLed once per round at each stage.

The federation is the chaos harness's (:mod:`fedsec.bench.chaos`: breast_cancer, IID,
agents with ``FEDSEC_UNSAFE_DETERMINISTIC_SEED`` so two runs give bit-identical
models), here without DP, its state in a PostgreSQL database (``[storage] url``) and
served by two replicas sharing the workspace directory (the model files, as a shared
mount would).  Every agent is given both replicas' URLs.  The leader carries the next
crash point of :data:`~fedsec.bench.chaos.STAGE_POINTS` (a fault that SIGKILLs it)
and the standby the point after it; when the leader dies the standby takes the lease
over, and only then is the dead one started again on its port, as the new standby with
the next point.  Starting it at once would let it race the standby for the expired
lease: a fresh process that opens the database after the expiry and before the
standby's next poll wins, and then the standby's point is never reached (on a loaded
machine the standby's poll is late often enough: a CI run lost three of six points so).
Whoever leads next is thus always the replica that carries the next point.
``takeover_s`` of a kill: from seeing the leader's process dead to the standby
answering ``GET /v1/health`` as ``leader``.  ``stall_standby_s`` SIGSTOPs the standby
that long at each kill, as a loaded machine's scheduler can: its points must still be
reached.

The pause scenario SIGSTOPs the leader mid-round until the standby leads, then
SIGCONTs it: the fence must refuse every write it still tries (its
``fedsec_fenced_writes_refused`` counter) and it must stand by by itself.

Results are compared with an uninterrupted run of the same federation (leader and
standby, no fault).  The same in homomorphic-summation and buffered rounds, one kill
mid-round each: :mod:`fedsec.bench.failover_modes` (an HE federation's key custodian,
a process given both URLs, is started here).  Everything waits on conditions with
deadlines; every process is ended on the way out.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import msgspec

from fedsec import faults
from fedsec.bench.chaos import (
    _FAULT_RE,
    STAGE_POINTS,
    STATUS_POLL_S,
    ChaosPlan,
    _Federation,
    aggregator_schedule,
    audit_verify,
)
from fedsec.bench.common import federation_status, free_port, with_environment
from fedsec.bench.pgcluster import Cluster, temporary_cluster
from fedsec.errors import ConfigError
from fedsec.protocol import wire

#: The round whose first stage after the joins sees the leader paused (mid-round).
PAUSE_ROUND: Final = 2
_HEALTH_TIMEOUT_S: Final = 1.0
_FENCED_RE: Final = re.compile(r"^fedsec_fenced_writes_refused(?:_total)? (\S+)$", re.M)


@dataclass
class Kill:
    """One leader death and its take-over."""

    point: str  # the crash point the leader carried
    hit: str = ""  # the fault_injected line it logged ("" when it died elsewhere)
    takeover_s: float | None = None  # None: no replica led before the run ended


@dataclass
class FailoverRun:
    """What one replicated run did."""

    workspace: Path
    logs: Path
    kills: list[Kill] = field(default_factory=list)
    history: list[wire.RoundSummary] = field(default_factory=list)
    final_sha256: str = ""
    wall_s: float = 0.0
    pause: dict[str, Any] = field(default_factory=dict)

    def rounds_lost(self, rounds: int) -> int:
        closed = sum(1 for s in self.history if s.stage == "closed")
        aborted = sum(1 for s in self.history if s.stage == "aborted")
        return aborted + max(0, rounds - closed)


def health(url: str) -> dict[str, Any] | None:
    """``GET /v1/health`` of ``url`` (role, token), None while it does not answer."""
    try:
        with urllib.request.urlopen(
            f"{url}{wire.API_PREFIX}/health", timeout=_HEALTH_TIMEOUT_S
        ) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except (OSError, ValueError):
        return None


def fenced_writes(url: str) -> float | None:
    """The ``fedsec_fenced_writes_refused`` counter a replica exposes on /metrics."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=_HEALTH_TIMEOUT_S) as resp:
            found = _FENCED_RE.search(resp.read().decode())
    except (OSError, ValueError):
        return None
    return float(found[1]) if found else None


class _Replicas(_Federation):
    """The chaos harness's federation served by two replicas (slots 0 and 1), each on a
    port of its own, with every agent given both URLs."""

    def __init__(self, plan: ChaosPlan, root: Path) -> None:
        super().__init__(plan, root)
        self.urls = [self.url, f"http://127.0.0.1:{free_port()}"]
        self.replicas: list[subprocess.Popen[bytes] | None] = [None, None]
        self.log_names = ["", ""]  # each slot's current process's log
        self.started = 0
        self.custodian_id: str = plan.he.get("custodian", "")
        self.custodian: subprocess.Popen[bytes] | None = None
        self.aggregator_public = b""  # the custodian pins it (known once created)

    def create(self) -> None:
        from fedsec.config import load_agent_config
        from fedsec.federation import write_agent_config

        super().create()
        for a in self.local:
            cfg = load_agent_config(a.config_path)
            agent = msgspec.structs.replace(cfg.agent, aggregator_url=list(self.urls))
            privacy = msgspec.structs.replace(cfg.privacy, require_dp=self.plan.dp)
            write_agent_config(a, msgspec.structs.replace(cfg, agent=agent, privacy=privacy))
        if self.custodian_id:
            self._enrol_custodian()

    def _enrol_custodian(self) -> None:
        """An HE federation's key custodian: its directory beside the workspace, its
        entry on the roster (in the shared database, where both replicas read it)."""
        from fedsec.aggregator.workspace import Workspace
        from fedsec.crypto.he import HeParams
        from fedsec.custodian.store import create_custodian
        from fedsec.protocol.roster import sign_roster_entry

        fid = self.plan.federation_id
        manifest = create_custodian(self.root / self.custodian_id, fid, HeParams())
        ws = Workspace.open(self.workspace)
        try:
            self.aggregator_public = ws.signer.public_bytes
            entry = sign_roster_entry(
                federation_id=fid,
                agent_id=self.custodian_id,
                public_key=bytes.fromhex(manifest.public_key),
                role="custodian",
                admin=ws.admin(),
            )
            ws.roster.add(entry)
        finally:
            ws.close()

    def start_agents(self) -> None:
        """The agents, and first the key custodian where there is one: given both
        replicas' URLs as the agents are, it moves to whichever leads."""
        if self.custodian_id:
            args = ["custodian", "serve", "--dir", str(self.root / self.custodian_id)]
            args += ["--id", self.custodian_id]
            args += ["--aggregator-public-key", self.aggregator_public.hex()]
            for url in self.urls:
                args += ["--aggregator-url", url]
            self.custodian = self._spawn(self.custodian_id, args, {})
        super().start_agents()

    def custodian_alive(self) -> None:
        """Check that the key custodian, where there is one, still serves.

        Raises:
            ConfigError: it exited (it serves until the run ends).
        """
        if self.custodian is not None and self.custodian.poll() is not None:
            raise ConfigError(
                f"the key custodian exited with {self.custodian.returncode}; see {self.logs}"
            )

    def start_replica(self, slot: int, crash_at: str | None) -> None:
        self.started += 1
        extra = {faults.AGGREGATOR_ENV: crash_at} if crash_at else {}
        port = self.urls[slot].rsplit(":", 1)[1]
        args = ["aggregator", "serve", "--workspace", str(self.workspace), "--port", port]
        self.log_names[slot] = f"replica-{slot}-{self.started}"
        self.replicas[slot] = self._spawn(self.log_names[slot], args, extra)
        self.aggregator = self.replicas[slot]  # what the harness's close() ends too

    def wait_takeover(self, slot: int, deadline: float) -> float:
        """Wait until replica ``slot`` (the standby) answers health as ``leader``; the
        time it did.  If it is SIGKILLed first, it led long enough to reach its own crash
        point: the time its death was seen (the caller then fails over again).

        Raises:
            ConfigError: it exited otherwise, or the deadline passed.
        """
        proc = self.replicas[slot]
        assert proc is not None
        while time.monotonic() < deadline:
            answer = health(self.urls[slot])
            if answer is not None and answer.get("role") == "leader":
                return time.monotonic()
            if proc.poll() == -signal.SIGKILL:
                return time.monotonic()
            if proc.poll() is not None:
                raise ConfigError(f"replica {slot} exited with {proc.returncode}; see {self.logs}")
            time.sleep(STATUS_POLL_S)
        raise ConfigError(f"replica {slot} did not take the lead in time; see {self.logs}")

    def stall(self, slot: int, seconds: float) -> None:
        """SIGSTOP replica ``slot`` now and SIGCONT it ``seconds`` later (from a timer
        thread: the caller goes on waiting on conditions meanwhile)."""
        proc = self.replicas[slot]
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGSTOP)

        def wake() -> None:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)

        timer = threading.Timer(seconds, wake)
        timer.daemon = True
        timer.start()

    def wait_role(self, slot: int, role: str, deadline: float) -> float:
        """Wait until replica ``slot`` answers health with ``role``; the time it did.

        Raises:
            ConfigError: it exited, or the deadline passed.
        """
        proc = self.replicas[slot]
        assert proc is not None
        while time.monotonic() < deadline:
            answer = health(self.urls[slot])
            if answer is not None and answer.get("role") == role:
                return time.monotonic()
            if proc.poll() is not None:
                raise ConfigError(f"replica {slot} exited with {proc.returncode}; see {self.logs}")
            time.sleep(STATUS_POLL_S)
        raise ConfigError(f"replica {slot} was not {role} in time; see {self.logs}")

    def leader_status(self) -> wire.FederationStatus | None:
        """Signed ``GET /v1/status`` of whichever replica leads now."""
        for url in self.urls:
            answer = health(url)
            if answer is not None and answer.get("role") == "leader":
                return federation_status(url, self.observer)
        return None

    def close(self) -> None:
        procs = [p for p in (*self.replicas, self.custodian) if p is not None]
        for proc in procs:  # a paused one cannot take SIGTERM
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
        self.aggregator = None
        super().close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def run_replicated(
    plan: ChaosPlan, root: Path, *, pause: bool = False, stall_standby_s: float = 0.0
) -> FailoverRun:
    """Run ``plan`` (its ``aggregator_crashes`` the leaders' crash points, in order) on
    two replicas until it finishes; with ``pause``, SIGSTOP the leader at
    :data:`PAUSE_ROUND` once and SIGCONT it after the standby took over; with
    ``stall_standby_s``, SIGSTOP the standby that long at each kill.

    Raises:
        ConfigError: a replica died other than by an injected crash, every agent exited
            early, or the run passed ``plan.timeout_s``.
    """
    start = time.monotonic()
    deadline = start + plan.timeout_s
    fed = _Replicas(plan, root)
    run = FailoverRun(workspace=fed.workspace, logs=fed.logs)
    fed.create()
    points = list(plan.aggregator_crashes)
    carried: list[str | None] = [None, None]
    try:
        for slot in (0, 1):  # the first to open the database leads
            carried[slot] = points.pop(0) if points else None
            fed.start_replica(slot, carried[slot])
            fed.wait_role(slot, "leader" if slot == 0 else "standby", deadline)
        fed.start_agents()
        leader = 0
        last: wire.FederationStatus | None = None
        while True:
            if time.monotonic() > deadline:
                raise ConfigError(f"the run did not finish in time; logs in {fed.logs}")
            proc = fed.replicas[leader]
            assert proc is not None
            code = proc.poll()
            if code is not None:
                if stall_standby_s and carried[1 - leader] is not None:
                    fed.stall(1 - leader, stall_standby_s)  # its point must still be reached
                leader = _fail_over(fed, run, leader, code, carried, points, deadline)
                continue
            if pause and not run.pause and last is not None and _at_pause(last):
                leader = _pause_leader(fed, run, leader, last, deadline)
                continue
            status = fed.leader_status()
            if status is not None:
                last = status
                if status.finished:
                    break
            if all(p.poll() is not None for p in fed.agents.values()):
                raise ConfigError(f"every agent exited before the federation finished; {fed.logs}")
            fed.custodian_alive()
            time.sleep(STATUS_POLL_S)
        run.history = list(last.history)
        if run.pause:
            paused = fed.urls[run.pause.pop("slot")]
            run.pause["fenced_writes_refused"] = fenced_writes(paused)
            run.pause["role_after"] = (health(paused) or {}).get("role")
        for proc in fed.agents.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, min(20.0, deadline - time.monotonic())))
    finally:
        fed.close()
    run.wall_s = time.monotonic() - start
    run.final_sha256 = _final_sha256(fed.workspace)
    return run


def _fail_over(
    fed: _Replicas,
    run: FailoverRun,
    leader: int,
    code: int,
    carried: list[str | None],
    points: list[str],
    deadline: float,
) -> int:
    """The leader died: time the standby's take-over, then start the dead one again as
    the standby with the next crash point (not before: see the module doc); the new
    leader's slot.

    Raises:
        ConfigError: it died other than by SIGKILL, or the standby did not lead in time.
    """
    died = time.monotonic()
    if code != -signal.SIGKILL:
        raise ConfigError(f"replica {leader} exited with code {code}; see {fed.logs}")
    log = (fed.logs / f"{fed.log_names[leader]}.log").read_text(errors="replace")
    hits = _FAULT_RE.findall(log)
    kill = Kill(point=carried[leader] or "", hit=hits[-1] if hits else "")
    run.kills.append(kill)
    standby = 1 - leader
    kill.takeover_s = round(fed.wait_takeover(standby, deadline) - died, 3)
    carried[leader] = points.pop(0) if points else None
    fed.start_replica(leader, carried[leader])
    return standby


def _at_pause(status: wire.FederationStatus) -> bool:
    return status.round >= PAUSE_ROUND and status.stage != "open"


def _pause_leader(
    fed: _Replicas, run: FailoverRun, leader: int, status: wire.FederationStatus, deadline: float
) -> int:
    """SIGSTOP the leader until the other replica leads, then SIGCONT it and wait for
    it to stand by; the new leader's slot."""
    proc = fed.replicas[leader]
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    other = 1 - leader
    took = fed.wait_role(other, "leader", deadline)
    proc.send_signal(signal.SIGCONT)
    stood_by = fed.wait_role(leader, "standby", deadline)
    run.pause = {
        "slot": leader,
        "at": f"{status.round}:{status.stage}",
        "takeover_s": round(took - paused, 3),
        "stood_by_s": round(stood_by - took, 3),
    }
    return other


def _final_sha256(workspace: Path) -> str:
    from fedsec.aggregator.workspace import Workspace

    ws = Workspace.open(workspace)
    try:
        return ws.models.latest().sha256
    finally:
        ws.close()


def _verified(workspace: Path) -> str:
    """``ok``, or the last line ``fedsec audit verify`` printed when it failed."""
    done = audit_verify(workspace)
    if done.returncode == 0:
        return "ok"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


@contextmanager
def database_server(url: str | None) -> Iterator[Cluster]:
    """Fresh databases from the server at ``url`` (one the role may CREATE DATABASE on),
    or from a temporary cluster of this machine's PostgreSQL when None.

    Raises:
        ConfigError: ``url`` is None and PostgreSQL is not installed.
    """
    if url is not None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        yield Cluster(
            parts.hostname or "127.0.0.1",
            parts.port or 5432,
            parts.username or "",
            parts.password or "",
            parts.path.lstrip("/") or "postgres",
        )
        return
    with temporary_cluster("fedsec_bench", secrets.token_hex(16), "fedsec") as cluster:
        yield cluster


def run_failover(
    agents: int = 6,
    rounds: int = 5,
    points: Sequence[str] = STAGE_POINTS,
    *,
    database_url: str | None = None,
    workdir: Path | None = None,
    timeout_s: float = 400.0,
    pause: bool = True,
) -> dict[str, Any]:
    """The leader killed once per round at each of ``points``; with ``pause``, a second
    run whose leader is paused past its lease; both against an uninterrupted run.

    Returns the ``bench failover`` JSON object.

    Raises:
        ConfigError: a run did not finish, or PostgreSQL is not installed.
    """
    root = workdir or Path(tempfile.mkdtemp(prefix="fedsec-failover-"))
    schedule = tuple(aggregator_schedule(rounds, points))
    base = ChaosPlan(agents=agents, rounds=rounds, dp=False, timeout_s=timeout_s)
    with database_server(database_url) as server:
        reference = run_replicated(
            replace(base, storage_url=server.fresh_database()), root / "reference"
        )
        killed = run_replicated(
            replace(base, storage_url=server.fresh_database(), aggregator_crashes=schedule),
            root / "killed",
        )
        paused = (
            run_replicated(
                replace(base, storage_url=server.fresh_database()), root / "paused", pause=True
            )
            if pause
            else None
        )
        killed_audit = _verified(killed.workspace)
        paused_audit = _verified(paused.workspace) if paused else None
    takeovers = [k.takeover_s for k in killed.kills if k.takeover_s is not None]
    result: dict[str, Any] = {
        "bench": "failover",
        "mode": "secagg",  # sync SecAgg+ rounds (the others: fedsec.bench.failover_modes)
        "task": "breast_cancer",
        "agents": agents,
        "rounds": rounds,
        "dp": False,
        "kills": [k.__dict__ for k in killed.kills],
        "takeover_s": {
            "median": round(statistics.median(takeovers), 3) if takeovers else None,
            "max": max(takeovers) if takeovers else None,
        },
        "rounds_lost": killed.rounds_lost(rounds),
        "final_sha256": killed.final_sha256,
        "reference_sha256": reference.final_sha256,
        "hash_match": bool(killed.final_sha256) and killed.final_sha256 == reference.final_sha256,
        "audit_ok": killed_audit == "ok",
        "audit": killed_audit,
        "wall_s": round(killed.wall_s, 2),
        "reference_wall_s": round(reference.wall_s, 2),
        "workdir": str(root),
    }
    if paused is not None:
        result["pause"] = {
            **paused.pause,
            "rounds_lost": paused.rounds_lost(rounds),
            "hash_match": paused.final_sha256 == reference.final_sha256,
            "audit_ok": paused_audit == "ok",
            "audit": paused_audit,
        }
    return with_environment(result)
