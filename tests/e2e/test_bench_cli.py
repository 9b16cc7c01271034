"""The benchmark entry points run and report what they claim (tiny sizes; no timings)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.cli import main


@pytest.mark.parametrize("stage", ["advertise", "share", "masked", "unmask"])
def test_bench_secagg_reports_an_exact_round(stage: str) -> None:
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "secagg",
            "--clients",
            "12",
            "--dim",
            "300",
            "--dropout",
            "0.2",
            "--dropout-stage",
            stage,
            "--neighbors",
            "6",
            "--threshold",
            "4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert record["exact"] is True
    assert record["dropout_stage"] == stage and record["clients"] == 12
    assert record["max_abs_err"] <= record["quant_step"]
    assert record["bytes_per_param"] == pytest.approx(
        (record["dim"] + 1) * record["ring_bits"] / 8 / record["dim"], abs=1 / record["dim"]
    )
    for key in ("client_s", "server_s", "floor_s", "share_bytes_per_client", "peak_rss_mb"):
        assert record[key] >= 0


def test_bench_secagg_with_distributed_noise_sums_exactly_and_hits_the_noise() -> None:
    args = ["bench", "secagg", "--clients", "12", "--dim", "3000", "--bits", "12"]
    result = CliRunner().invoke(main, [*args, "--ddp-noise", "1.0", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert record["exact"] is True and record["ddp_noise"] == 1.0
    noise = record["ddp_noise_std"]
    # 3,000 coordinates: the measured std is within a few percent of the target
    assert noise["measured"] == pytest.approx(noise["target"], rel=0.1)


def test_bench_secagg_with_a_codec_sums_exactly_and_counts_every_upload_byte() -> None:
    args = ["bench", "secagg", "--clients", "12", "--dim", "3000", "--neighbors", "6"]
    args += ["--bits", "2", "--rotation", "hadamard", "--sparsity", "0.25", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert record["exact"] is True and record["range_stddevs"] == 3.0  # the default
    # 12 members of 2 bits: a 6-bit ring; 25 % of 4,096 rotated coordinates and the weight
    kept = round(0.25 * 3000)
    assert record["ring_bits"] == 6
    assert record["bytes_per_param"] == pytest.approx((kept + 1) * 6 / 8 / 3000, abs=1 / 3000)
    vector = record["bytes_per_param"] * 3000
    assert record["payload_compression_ratio"] == pytest.approx(12_000 / vector, rel=1e-3)
    # keys and signature, 6 encrypted shares, the vector and the unmask shares
    floor = 128 + 6 * record["share_ciphertext_bytes"] + vector
    assert record["bytes_up_per_client"] > floor
    assert record["compression_ratio"] == pytest.approx(
        12_000 / record["bytes_up_per_client"], rel=1e-3
    )
    for key in ("codec_subset_s", "codec_encode_s", "codec_decode_s"):
        assert record[key] > 0
    # an unbiased estimate from a quarter of the coordinates: off, but not by orders
    assert 0 < record["codec_relative_error"] < 10


def test_bench_secagg_with_fewer_headroom_bits_masks_in_the_smaller_ring() -> None:
    """12 members at 2 bits need 4 headroom bits; with 2 the ring has 4 bits, which SecAgg+
    masks and unmasks exactly, and the weight travels as two 1-bit digits (12 < 16)."""
    args = ["bench", "secagg", "--clients", "12", "--dim", "3000", "--neighbors", "6"]
    args += ["--bits", "2", "--rotation", "hadamard", "--sparsity", "0.25", "--json"]
    result = CliRunner().invoke(main, [*args, "--headroom-bits", "2"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert record["exact"] is True
    assert (record["ring_bits"], record["headroom_bits"]) == (4, 2)
    kept = round(0.25 * 3000)
    assert record["bytes_per_param"] == pytest.approx((kept + 2) * 4 / 8 / 3000, abs=1 / 3000)
    refused = CliRunner().invoke(main, [*args, "--headroom-bits", "1"])  # 12 weights > 7
    assert refused.exit_code != 0
    assert "cannot hold the weights of 12 members" in refused.output


def test_bench_secagg_refuses_a_codec_with_distributed_noise() -> None:
    args = ["bench", "secagg", "--clients", "6", "--dim", "100", "--ddp-noise", "1"]
    result = CliRunner().invoke(main, [*args, "--rotation", "hadamard"])
    assert result.exit_code != 0
    assert "distributed noise" in str(result.exception)


def test_simulate_uses_the_requested_local_settings() -> None:
    """A tiny real federation over loopback: the options reach the members' training."""
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--task",
            "breast_cancer",
            "--agents",
            "3",
            "--rounds",
            "2",
            "--secure-sum",
            "none",
            "--batch-size",
            "8",
            "--local-epochs",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert (record["batch_size"], record["local_epochs"], record["rounds"]) == (8, 1, 2)
    assert record["aborted_rounds"] == 0
    assert 0.5 < record["final_accuracy"] <= 1.0


def test_simulate_reports_how_much_the_codec_saturated() -> None:
    """Updates clipped to a tiny norm all have the clip's norm, so a range of ±1 standard
    deviation of a rotated coordinate clamps about a third of them (P(|Z| > 1) = 0.317)."""
    args = ["simulate", "--task", "breast_cancer", "--agents", "3", "--rounds", "1"]
    args += ["--secure-sum", "secagg", "--clip", "0.001", "--json"]
    codec = ["--rotation", "hadamard", "--sparsity", "0.5", "--quant-bits", "4"]
    narrow = CliRunner().invoke(main, [*args, *codec, "--range-stddevs", "1"])
    assert narrow.exit_code == 0, narrow.output
    record = json.loads(narrow.output.strip().splitlines()[-1])
    assert record["rounds"] == 1
    assert 0.25 < record["saturation_rate"] < 0.4  # 1,587 coordinates: sd 0.012
    wide = CliRunner().invoke(main, [*args, *codec, "--range-stddevs", "8"])
    assert wide.exit_code == 0, wide.output
    assert json.loads(wide.output.strip().splitlines()[-1])["saturation_rate"] == 0.0


def test_simulate_with_fewer_headroom_bits_sends_less_and_counts_likely_wraps() -> None:
    """3 members at 4 bits need 2 headroom bits for sums that never wrap.  With 1 the ring
    has 5 bits, not 6: the same coordinates cost 5/6 of the bytes (the weight's two digits
    aside), and the three members' aligned, saturated updates put many centred sums near
    the ring's edge, which the round counts; with 2 nothing can wrap and none is counted."""
    args = ["simulate", "--task", "breast_cancer", "--agents", "3", "--rounds", "1"]
    args += ["--secure-sum", "secagg", "--clip", "0.001", "--json", "--rotation", "hadamard"]
    args += ["--sparsity", "0.5", "--quant-bits", "4", "--range-stddevs", "1"]
    records = {}
    for headroom in ("1", "2"):
        run = CliRunner().invoke(main, [*args, "--headroom-bits", headroom])
        assert run.exit_code == 0, run.output
        records[headroom] = json.loads(run.output.strip().splitlines()[-1])
        assert records[headroom]["rounds"] == 1 and records[headroom]["aborted_rounds"] == 0
    wrapping, whole = records["1"], records["2"]
    # 529 kept coordinates: (529 + 2)·5 bits against (529 + 1)·6 bits
    assert (wrapping["payload_bytes_per_agent_round"], whole["payload_bytes_per_agent_round"]) == (
        332.0,
        398.0,
    )
    assert 0.02 < wrapping["wrap_rate"] < 0.5
    assert whole["wrap_rate"] is None


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _rounds_closed(aggregator: int) -> int:
    """Rounds the aggregator process ``aggregator`` has closed, read from its state
    database (named by its ``--workspace`` argument); 0 while there is none yet."""
    args = Path(f"/proc/{aggregator}/cmdline").read_bytes().split(b"\0")
    state = Path(os.fsdecode(args[args.index(b"--workspace") + 1])) / "state.db"
    if not state.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{state}?mode=ro", uri=True)) as db:
        try:
            row = db.execute("SELECT count(*) FROM rounds WHERE stage = 'closed'").fetchone()
        except sqlite3.OperationalError:  # schema not written yet
            return 0
    return int(row[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("secure_sum", ["secagg", "he"])
def test_simulate_stopped_with_sigterm_stops_its_children_too(secure_sum: str) -> None:
    """The aggregator (and with he, the key custodian) run as child processes; a
    simulation stopped with SIGTERM stops them before it exits."""
    command = [sys.executable, "-m", "fedsec", "simulate", "--task", "breast_cancer"]
    command += ["--agents", "3", "--rounds", "500", "--secure-sum", secure_sum, "--json"]
    sim = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wanted = [b"aggregator"] + ([b"custodian"] if secure_sum == "he" else [])
    found: dict[bytes, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(found) < len(wanted) and time.monotonic() < deadline and sim.poll() is None:
            for child in _children(sim.pid):
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                for role in wanted:
                    if role in cmdline and b"serve" in cmdline:
                        found[role] = child
                        if role == b"aggregator":
                            arg = cmdline[cmdline.index(b"--workspace") + 1]
                            workspace = Path(arg.decode())
            time.sleep(0.2)
        assert len(found) == len(wanted), (found, sim.communicate(timeout=30))
        while _rounds_closed(found[b"aggregator"]) < 1:  # into the rounds
            assert time.monotonic() < deadline and sim.poll() is None, "no round closed"
            time.sleep(0.2)
        sim.send_signal(signal.SIGTERM)
        _, err = sim.communicate(timeout=90)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
            for pid in found.values():  # a failed run must not leave its servers behind
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert sim.returncode == 1
    assert b"simulation stopped (SIGTERM)" in err and b"Traceback" not in err
    assert not any(_alive(pid) for pid in found.values())
    # the simulation's temporary federation (in RAM where /dev/shm exists) went with it
    assert not workspace.parent.exists(), sorted(workspace.parent.iterdir())
