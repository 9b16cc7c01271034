"""The simulated members of ``fedsec simulate``: in the simulating process, or spread over
member processes on this machine and others.

Every simulated member is a full :class:`~fedsec.agent.runtime.AgentRuntime` (signed
requests, its own ledger, vault and receipts) running as an asyncio task.  In one process
all of them share one interpreter lock, and each member's SecAgg+ stage reads the whole
cohort's key list, so the members' work in one process grows as n²: 1,000 members took
minutes a stage on one core (``STAGE_S_PER_MEMBER`` in :mod:`fedsec.simulation`).  Member
processes spread that work over the cores.

A member process is a plain ``fedsec simulate --members-only PLAN --member-range A:B``
child: a fresh interpreter each, never a fork of the simulating process (it holds threads:
the training pool, asyncio's default executor, and a fork would copy their locks in
whatever state they were).  It is the same command that runs members on another machine,
so the local path tests the remote one.

The plan (:data:`PLAN_FILE`, beside the members' homes) is everything a member derives its
configuration from: the aggregator's URL and public key, the task, the partition, the
seed and the privacy settings.  It holds no secret: each member's identity key stays in
its own home, and a machine running members A..B needs the plan and only those homes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from fedsec.agent.runtime import AgentRuntime
from fedsec.aggregator.capacity import (
    CONNECTIONS_PER_IDENTITY,
    descriptors_needed,
    ensure_descriptors,
)
from fedsec.errors import ConfigError
from fedsec.faults import NO_FAULTS, Faults
from fedsec.federation import LocalAgent, agent_config
from fedsec.keys import load_identity

#: The plan's file name, in the directory that holds the members' homes.
PLAN_FILE = "members.json"
#: Members one process holds before another process is worth its cost.  A member process
#: costs a fresh interpreter with torch and the task's data (~480 MB with MNIST-1D, a few
#: seconds to start); below ~100 members the members' SecAgg+ work in one process is about
#: a second a round (a 50-member MNIST-1D round, training included, took 1.1-1.3 s on 2
#: cores: bench/results/simulation-notes.md), so a second process would only add its
#: start-up.
MEMBERS_PER_PROCESS = 100
#: Seconds a member process may take to stop after SIGTERM before it is killed.
STOP_S = 30.0


class MemberPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every simulated member's configuration derives from (no secret in it).

    ``members`` is the whole federation's count (a member's data part is part ``i`` of
    ``members``); the first ``slow_members`` train ``slowdown`` times slower;
    ``unsafe_seed`` is :mod:`fedsec.faults`' deterministic seed ("" = the OS CSPRNG).
    """

    url: str
    aggregator_public_key: str
    task: str
    members: int
    partition: str
    seed: int
    dp_epsilon: float | None
    distributed_dp: bool
    slow_members: int = 0
    slowdown: float = 1.0
    unsafe_seed: str = ""

    @property
    def faults(self) -> Faults:
        return Faults(seed=self.unsafe_seed) if self.unsafe_seed else NO_FAULTS


class MemberTally(msgspec.Struct, frozen=True):
    """What a set of members reports back: how many ran, and the codec's rounding counts
    over their round attempts (for the run's saturation rate)."""

    members: int = 0
    rounded: int = 0
    saturated: int = 0

    def __add__(self, other: MemberTally) -> MemberTally:
        return MemberTally(
            self.members + other.members,
            self.rounded + other.rounded,
            self.saturated + other.saturated,
        )


def write_plan(plan: MemberPlan, directory: Path) -> Path:
    """Write ``plan`` as ``directory/members.json``; return its path."""
    path = directory / PLAN_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(plan)))
    return path


def read_plan(path: Path) -> MemberPlan:
    """The plan in ``path``.

    Raises:
        ConfigError: unreadable, or not a plan (the message says which field).
    """
    try:
        return msgspec.json.decode(path.read_bytes(), type=MemberPlan)
    except OSError as exc:
        raise ConfigError(f"cannot read the members' plan {path}: {exc.strerror}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path} is not a members' plan: {exc}") from None


def parse_member_range(text: str, members: int) -> range:
    """Members ``A:B`` (from 0, B excluded, as a Python slice) of ``members``; "" = all.

    Raises:
        ConfigError: not ``A:B`` with 0 <= A < B <= ``members``.
    """
    if not text:
        return range(members)
    first, sep, stop = text.partition(":")
    try:
        chosen = range(int(first), int(stop))
    except ValueError:
        chosen = range(0)
    if not sep or not chosen or chosen.start < 0 or chosen.stop > members:
        raise ConfigError(
            f"member range {text!r}: give A:B with 0 <= A < B <= {members} "
            "(members A to B-1, counted from 0)"
        )
    return chosen


def default_member_processes(members: int, cores: int) -> int:
    """Member processes for ``members`` on ``cores`` cores: one per
    :data:`MEMBERS_PER_PROCESS` members, at most one per core but the aggregator's (its
    own process, on the round's critical path), at least one."""
    return max(1, min(cores - 1, math.ceil(members / MEMBERS_PER_PROCESS)))


def split(members: range, processes: int) -> list[range]:
    """``members`` in ``processes`` contiguous ranges differing by at most one member."""
    count = min(processes, len(members))
    edges = [members.start + len(members) * k // count for k in range(count + 1)]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def member_id(index: int) -> str:
    """The roster id of member ``index`` (from 0), as :func:`enrol_agents` names it."""
    return f"agent-{index + 1}"


def member_runtimes(
    plan: MemberPlan,
    members: Sequence[tuple[int, LocalAgent]],
    trainers: concurrent.futures.Executor,
) -> list[AgentRuntime]:
    """One runtime per ``(index, agent)``, configured from ``plan``."""
    return [
        AgentRuntime(
            agent_config(
                agent,
                url=plan.url,
                aggregator_public=bytes.fromhex(plan.aggregator_public_key),
                task=plan.task,
                part_index=index,
                parts=plan.members,
                partition=plan.partition,
                seed=plan.seed,
                epsilon=plan.dp_epsilon or 1e9,
                require_dp=plan.dp_epsilon is not None,
                allow_distributed=plan.distributed_dp,
            ),
            agent.identity,
            slowdown=plan.slowdown if index < plan.slow_members else 1.0,
            training_executor=trainers,
            faults=plan.faults,
        )
        for index, agent in members
    ]


def tally(results: Sequence[Any]) -> MemberTally:
    """The tally of the members' :meth:`AgentRuntime.run` results (as gathered with
    ``return_exceptions``); members cancelled on purpose count, without outcomes.

    Raises:
        BaseException: the first member's error other than its cancellation.
    """
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
    outcomes = [o for r in results if isinstance(r, list) for o in r]
    return MemberTally(
        len(results), sum(o.rounded for o in outcomes), sum(o.saturated for o in outcomes)
    )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what is loaded so far (torch, datasets, the members' state, all of it alive
    for the whole run) out of the collector's full passes, which otherwise stopped every
    member for ~0.2 s every few rounds (50 members, MNIST-1D)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


async def run_member_range(plan_path: Path, members: range, training_threads: int) -> MemberTally:
    """Run members ``members`` of the plan in ``plan_path`` in this process until the
    federation finishes (``fedsec simulate --members-only``).

    Args:
        plan_path: the plan; the members' homes are beside it (``agent-<i+1>/``).
        members: which members, counted from 0.
        training_threads: threads that train; 0 = one per usable core.

    Raises:
        ConfigError: no such plan, members outside it, the descriptors they need.
        KeyFileError: a member's home lacks its identity key.
        FedsecError: a member's fatal error (see :meth:`AgentRuntime.run`).
    """
    plan = read_plan(plan_path)
    if members.stop > plan.members:
        raise ConfigError(f"the plan {plan_path} has {plan.members} members, not {members.stop}")
    # each member's long poll, the request beside it and one being opened
    needed = descriptors_needed(CONNECTIONS_PER_IDENTITY * len(members))
    ensure_descriptors(needed, f"{len(members)} simulated members")
    torch.set_num_threads(1)  # members train in parallel threads; avoid oversubscription
    root = plan_path.parent
    local = []
    for index in members:
        home = root / member_id(index)
        local.append(
            (index, LocalAgent(member_id(index), home, load_identity(home / "identity.key")))
        )
    threads = training_threads or usable_cores()
    with concurrent.futures.ThreadPoolExecutor(threads, "fedsec-train") as trainers:
        runtimes = member_runtimes(plan, local, trainers)
        await asyncio.gather(*(asyncio.to_thread(rt.prepare) for rt in runtimes))
        with frozen_heap():
            results = await asyncio.gather(*(rt.run() for rt in runtimes), return_exceptions=True)
    return tally(results)


async def run_member_processes(
    plan_path: Path, ranges: Sequence[range], training_threads: int
) -> MemberTally:
    """Run each of ``ranges`` in its own ``fedsec simulate --members-only`` process until
    all have ended; stop them all (SIGTERM, then SIGKILL after :data:`STOP_S`) if this is
    cancelled or one of them fails.

    Raises:
        ConfigError: a member process failed; the message names its log.
    """
    root = plan_path.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSEC_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs: list[tuple[range, subprocess.Popen[bytes], Path, Path]] = []
    try:
        for members in ranges:
            name = f"members-{members.start}-{members.stop}"
            out, log = root / f"{name}.json", root / f"{name}.log"
            args = ["simulate", "--members-only", str(plan_path)]
            args += ["--member-range", f"{members.start}:{members.stop}"]
            args += ["--training-threads", str(training_threads)]
            with out.open("wb") as stdout, log.open("ab") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fedsec", *args], stdout=stdout, stderr=stderr, env=env
                )
            procs.append((members, proc, out, log))
        return await _results(procs)
    finally:
        await asyncio.to_thread(_stop_all, [proc for _, proc, _, _ in procs])


async def _results(procs: list[tuple[range, subprocess.Popen[bytes], Path, Path]]) -> MemberTally:
    """Wait for every member process; the sum of their tallies.

    Raises:
        ConfigError: the first to fail (the others are stopped by the caller).
    """
    waits = {
        asyncio.ensure_future(asyncio.to_thread(p.wait)): i for i, (_, p, _, _) in enumerate(procs)
    }
    total = MemberTally()
    pending = set(waits)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for wait in done:
                members, _, out, log = procs[waits[wait]]
                code = wait.result()
                lines = out.read_bytes().splitlines() if code == 0 else []
                if not lines:
                    raise ConfigError(
                        f"the process of simulated members {members.start}:{members.stop} "
                        f"exited with code {code}; see {log}"
                    )
                total += msgspec.json.decode(lines[-1], type=MemberTally)
    finally:
        for wait in pending:  # threads blocked in wait(); they return once stopped
            wait.cancel()
    return total


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, then SIGKILL those that outlast STOP_S."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
