"""``fedsec bench compare``: run a short, fixed set of the standard benchmarks and say
which of their ratios moved since the newest recorded row with the same parameters.

Each check is one ``fedsec`` command line (what ``make bench`` runs, smaller where the
full one takes minutes), the parameters that make two of its rows comparable, and the
metrics compared.  Only ratios and rates are compared, never seconds: a ratio to a
floor measured in the same run survives a slower or busier machine, a time does not.

Noise, per metric (the one place it is defined; :data:`METRICS`):

- ``server_over_floor``: 25 % of the recorded value; ``client_over_floor``: 35 %.  The
  floor cancels the machine's speed but not its load: on the 2-core development
  machine, shared with other work, three rounds of the same code and parameters spread
  by up to 1.25x (server) and 1.35x (member, whose 4 ms floor is the shorter
  measurement) in the ring-width rows of bench/results/secagg.jsonl.
- ``bytes_per_param``: none (5e-7, half the last digit a row records).  The bytes follow
  from the parameters alone; any change is a change of the wire format.
- ``ddp_member_ratio`` (a member's time with distributed DP over its time without, both
  in the same process): 15 %; it is a median over members of a ratio of two timings
  taken back to back, steadier than a ratio to a floor measured once.
- ``final_accuracy`` (the mean over the check's seeds): 5 points.  The small simulation
  (10 members, 15 rounds) is still climbing and its rounds' timing is not
  deterministic: its three seeds gave 0.811, 0.817, 0.773 and then 0.76 on average in
  the next run of the same code, one seed 0.779 and 0.811 in two runs, so the mean of
  three moved by 3.9 points by chance.  5 points catches a broken model, not a subtle
  regression.

A recorded row matches a check's row when every parameter the check names is equal,
a parameter missing from an older row counting as its default (:data:`DEFAULTS`); the
newest is the one with the latest ``recorded_at`` (rows without one are older than any
with one, and among themselves a later line or a later file name is newer).  A timing
ratio is compared with the median of the newest :data:`BASELINE_ROWS` matching rows
(``make bench`` and ``--record`` write three rounds of a run), so one lucky or unlucky
round is not the baseline; an accuracy with each seed's newest row.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Metric:
    """How much a metric may move by chance: ``relative`` of the recorded value, or
    ``absolute`` in its own units (the larger of the two when both are set)."""

    key: str
    relative: float = 0.0
    absolute: float = 0.0

    def noise(self, recorded: float) -> float:
        return max(self.relative * abs(recorded), self.absolute)


METRICS: dict[str, Metric] = {
    "server_over_floor": Metric("server_over_floor", relative=0.25),
    "client_over_floor": Metric("client_over_floor", relative=0.35),
    "bytes_per_param": Metric("bytes_per_param", absolute=5e-7),
    "ddp_member_ratio": Metric("ddp_member_ratio", relative=0.15),
    "final_accuracy": Metric("final_accuracy", absolute=0.05),
}

BASELINE_ROWS = 3

# What a parameter was before it was recorded: older rows lack the codec's and the
# noise's fields, which then had these values.
DEFAULTS: dict[str, Any] = {
    "ddp_noise": 0.0,
    "rotation": "none",
    "keep": 1.0,
    "range_stddevs": 0.0,
    "headroom_bits": 0,
    "partition": "iid",
    "mode": "sync",
}

_SECAGG_PARAMS = (
    "bench",
    "clients",
    "dim",
    "dropout",
    "dropout_stage",
    "neighbors",
    "threshold",
    "bits",
    "ring_bits",
    "ddp_noise",
    "rotation",
    "keep",
    "range_stddevs",
    "headroom_bits",
)
_SIMULATE_PARAMS = (
    "bench",
    "task",
    "agents",
    "rounds",
    "partition",
    "secure_sum",
    "quant_bits",
    "dp_epsilon",
    "server_optimizer",
    "server_lr",
    "mode",
)
_SECAGG = ["bench", "secagg", "--clients", "100", "--dim", "1000000", "--dropout", "0.1"]


@dataclass(frozen=True, slots=True)
class Check:
    """One benchmark of the set: its command lines (one per seed for a simulation),
    the file ``make bench`` records it in, the parameters that match a recorded row,
    and the metrics compared (the median of the check's rows for a timing ratio, the
    mean over seeds for accuracy)."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    results: str
    params: tuple[str, ...]
    metrics: tuple[str, ...]
    per_seed: bool = False


CHECKS: tuple[Check, ...] = (
    Check(
        "secagg",
        (
            (
                *_SECAGG,
                "--dropout-stage",
                "masked",
                "--bits",
                "8",
                "--repeat",
                "3",
            ),
        ),
        "secagg.jsonl",
        _SECAGG_PARAMS,
        ("server_over_floor", "client_over_floor", "bytes_per_param"),
    ),
    Check(
        "secagg-codec-8x",
        (
            (
                *_SECAGG,
                "--bits",
                "4",
                "--rotation",
                "hadamard",
                "--sparsity",
                "0.36",
                "--repeat",
                "2",
            ),
        ),
        "compression.jsonl",
        _SECAGG_PARAMS,
        ("server_over_floor", "bytes_per_param"),
    ),
    Check(
        "secagg-ddp",
        ((*_SECAGG, "--bits", "9", "--ddp-noise", "1.0", "--repeat", "2"),),
        "ddp.jsonl",
        _SECAGG_PARAMS,
        ("ddp_member_ratio", "server_over_floor", "bytes_per_param"),
    ),
    Check(
        "simulate",
        tuple(
            (
                "simulate",
                "--task",
                "mnist1d",
                "--agents",
                "10",
                "--rounds",
                "15",
                "--secure-sum",
                "secagg",
                "--dp-epsilon",
                "none",
                "--seed",
                str(seed),
            )
            for seed in (0, 1, 2)
        ),
        "simulate.jsonl",
        (*_SIMULATE_PARAMS, "seed"),
        ("final_accuracy",),
        per_seed=True,
    ),
)


@dataclass(frozen=True, slots=True)
class Finding:
    """One metric of one check: today's value against the recorded one."""

    check: str
    metric: str
    current: float | None
    recorded: float | None
    noise: float | None
    note: str
    failed: bool = False

    @property
    def moved(self) -> bool:
        return (
            self.current is not None
            and self.recorded is not None
            and self.noise is not None
            and abs(self.current - self.recorded) > self.noise
        )

    def line(self) -> str:
        if self.current is None or self.recorded is None or self.noise is None:
            return f"{self.check}: {self.metric}: {self.note}"
        change = self.current - self.recorded
        verdict = "MOVED" if self.moved else "within noise"
        return (
            f"{self.check}: {self.metric} {self.recorded:.4g} -> {self.current:.4g} "
            f"({change:+.4g}, noise ±{self.noise:.3g}): {verdict}"
        )


def load_recorded(results: Path) -> list[Row]:
    """Every row of every ``*.jsonl`` under ``results``, oldest first (see the module's
    rule for "newest"); lines that are not JSON objects are skipped."""
    rows: list[tuple[tuple[int, str, str, int], Row]] = []
    for path in sorted(results.glob("*.jsonl")):
        for index, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                stamp = row.get("recorded_at")
                stamped = isinstance(stamp, str) and bool(stamp)
                key = (int(stamped), str(stamp) if stamped else "", path.name, index)
                rows.append((key, row))
    rows.sort(key=lambda item: item[0])
    return [row for _, row in rows]


def _param(row: Row, key: str) -> Any:
    value = row.get(key, DEFAULTS.get(key))
    return DEFAULTS.get(key) if value is None else value


def newest_matches(
    recorded: Sequence[Row], row: Row, params: Iterable[str], count: int = 1
) -> list[Row]:
    """The newest ``count`` recorded rows (newest first) whose every parameter in
    ``params`` equals ``row``'s."""
    keys = tuple(params)
    want = tuple(_param(row, k) for k in keys)
    found: list[Row] = []
    for candidate in reversed(recorded):
        if len(found) < count and tuple(_param(candidate, k) for k in keys) == want:
            found.append(candidate)
    return found


def newest_match(recorded: Sequence[Row], row: Row, params: Iterable[str]) -> Row | None:
    """The newest recorded row whose every parameter in ``params`` equals ``row``'s."""
    found = newest_matches(recorded, row, params)
    return found[0] if found else None


def _number(row: Row | None, key: str) -> float | None:
    value = None if row is None else row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _missing(check: Check, metric: str, note: str) -> Finding:
    return Finding(check.name, metric, None, None, None, note)


def _over_seeds(
    check: Check, name: str, measured: Sequence[Row], baselines: Sequence[Row | None]
) -> Finding:
    """The mean over the check's seeds against the mean of each seed's newest row."""
    pairs = [(_number(m, name), _number(b, name)) for m, b in zip(measured, baselines, strict=True)]
    unrecorded = [m.get("seed") for m, (_, b) in zip(measured, pairs, strict=True) if b is None]
    if unrecorded:
        return _missing(
            check, name, f"no recorded row with these parameters for seeds {unrecorded}"
        )
    currents = [c for c, _ in pairs if c is not None]
    if len(currents) != len(pairs):
        return _missing(check, name, "not measured")
    recorded = statistics.fmean(b for _, b in pairs if b is not None)
    noise = METRICS[name].noise(recorded)
    return Finding(check.name, name, statistics.fmean(currents), recorded, noise, "")


def _median(check: Check, name: str, measured: Sequence[Row], baseline: Sequence[Row]) -> Finding:
    """The median of the check's rows against the median of the newest matching rows."""
    if not baseline:
        return _missing(check, name, "no recorded row with these parameters")
    numbers = [v for v in (_number(b, name) for b in baseline) if v is not None]
    if not numbers:
        return _missing(check, name, "the recorded row lacks it")
    recorded = statistics.median(numbers)
    values = [v for v in (_number(m, name) for m in measured) if v is not None]
    if not values:
        return _missing(check, name, "not measured")
    noise = METRICS[name].noise(recorded)
    return Finding(check.name, name, statistics.median(values), recorded, noise, "")


def compare(check: Check, measured: Sequence[Row], recorded: Sequence[Row]) -> list[Finding]:
    """Each metric of ``check``: the median of ``measured`` (one command's repeats)
    against the median of the newest matching rows, or their mean over seeds against
    each seed's newest matching row."""
    if not measured:
        return [_missing(check, "-", "the benchmark produced no row")]
    if check.per_seed:
        baselines = [newest_match(recorded, row, check.params) for row in measured]
        return [_over_seeds(check, name, measured, baselines) for name in check.metrics]
    latest = newest_matches(recorded, measured[-1], check.params, BASELINE_ROWS)
    return [_median(check, name, measured, latest) for name in check.metrics]


def run_command(argv: Sequence[str]) -> list[Row]:
    """Run ``fedsec <argv> --json`` in a child process; its JSON object lines.

    Raises:
        RuntimeError: the command failed (its last output lines are in the message).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "fedsec", *argv, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"fedsec {' '.join(argv)} failed ({proc.returncode}): {tail}")
    rows = []
    for line in proc.stdout.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def run_checks(
    checks: Sequence[Check],
    results: Path,
    run: Callable[[Sequence[str]], list[Row]] | None = None,
    record: bool = False,
    stamp: str = "",
) -> list[Finding]:
    """Run ``checks`` (each command line through ``run``, :func:`run_command` by
    default) and compare them with what ``results`` records (read once, before
    anything is appended); a check whose benchmark fails is one failed finding.
    ``record`` appends each check's rows to its results file, to be the next run's
    baseline, stamped ``stamp`` (``recorded_at``) where the row carries no stamp.
    """
    run = run or run_command
    recorded = load_recorded(results)
    findings = []
    for check in checks:
        try:
            measured = [row for argv in check.commands for row in run(argv)]
        except RuntimeError as exc:  # said, and the other checks still run
            findings.append(Finding(check.name, "-", None, None, None, f"FAILED: {exc}", True))
            continue
        findings.extend(compare(check, measured, recorded))
        if record and measured:
            with (results / check.results).open("a", encoding="utf-8") as out:
                for row in measured:
                    out.write(json.dumps({"recorded_at": stamp, **row}) + "\n")
    return findings


@click.command("compare")
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench/results"),
    show_default=True,
    help="the recorded rows (*.jsonl)",
)
@click.option(
    "--only",
    multiple=True,
    type=click.Choice([c.name for c in CHECKS]),
    help="run only this check (repeatable)",
)
@click.option("--record", is_flag=True, help="append today's rows: the next baseline")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per metric")
def bench_compare(results: Path, only: tuple[str, ...], record: bool, as_json: bool) -> None:
    """Run a short fixed set of the standard benchmarks; print what moved by more than
    its noise since the newest recorded row with the same parameters.  Exits 1 when
    something moved or a benchmark failed."""
    checks = [c for c in CHECKS if not only or c.name in only]
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    findings = run_checks(checks, results, record=record, stamp=stamp)
    for finding in findings:
        if as_json:
            fields = ("check", "metric", "current", "recorded", "noise", "note", "failed")
            out = {k: getattr(finding, k) for k in fields}
            click.echo(json.dumps({**out, "moved": finding.moved}))
        else:
            click.echo(finding.line())
    moved = [f for f in findings if f.moved]
    failed = [f for f in findings if f.failed]
    if not as_json:
        click.echo(f"{len(moved)} of {len(findings)} metrics moved by more than their noise")
    if moved or failed:
        sys.exit(1)
