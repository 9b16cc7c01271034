"""Fault injection as an object: nothing happens without one, a child process reads its
own from the environment once, and the unsafe seed's bytes stay what chaos runs compare."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap

from fedsec.faults import AGENT_ENV, AGGREGATOR_ENV, NO_FAULTS, SEED_ENV, Faults


def test_without_variables_a_process_gets_no_faults() -> None:
    assert Faults.from_environment("agent", {}) is NO_FAULTS
    empty = {AGENT_ENV: "", AGGREGATOR_ENV: "", SEED_ENV: ""}
    assert Faults.from_environment("aggregator", empty) is NO_FAULTS
    assert NO_FAULTS.seeded_bytes("a0", 1, "training") is None
    NO_FAULTS.crash(1, "advertise")  # still alive


def test_each_role_reads_its_own_crash_variable() -> None:
    environ = {AGENT_ENV: "4:share_keys", AGGREGATOR_ENV: "2:model_write", SEED_ENV: "7"}
    assert Faults.from_environment("agent", environ) == Faults("4:share_keys", "7")
    assert Faults.from_environment("aggregator", environ) == Faults("2:model_write", "7")


def test_seeded_bytes_are_those_chaos_runs_were_recorded_with() -> None:
    expected = hashlib.sha256(b"s3cret\x00a0\x003\x00rounding").digest()
    assert Faults(seed="s3cret").seeded_bytes("a0", 3, "rounding") == expected
    assert Faults(seed="other").seeded_bytes("a0", 3, "rounding") != expected


def test_a_crash_point_kills_only_at_its_round_and_point() -> None:
    driver = textwrap.dedent(
        """
        from fedsec.faults import Faults
        faults = Faults(crash_at="2:archive_prune")
        faults.crash(1, "archive_prune")
        faults.crash(2, "advertise")
        print("alive", flush=True)
        faults.crash(2, "archive_prune")
        print("after", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert proc.stdout == "alive\n"
    assert "event=fault_injected crash_at=2:archive_prune" in proc.stderr
