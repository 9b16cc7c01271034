"""``fedsec bench inventory``: the data map's speed and memory, and its sensitive-field
detection on a labelled table.

Scan: a CSV of ``--rows`` × ``--columns`` (numbers, integers, categories, names, e-mail
addresses, dates) is written first (not timed), then profiled by ``fedsec agent
inventory``'s code in a child process, whose peak RSS is reported.  The floor, measured
in the same run on the same file, is a child that only streams the file through the
same Arrow CSV reader.  Detection: the labelled table of :func:`sensitive_table`
(44 columns, 24 sensitive, several with disguised or neutral names), recall and the
false positives listed.

Synthetic values come from a seeded non-cryptographic generator: they are test data,
not secrets.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from fedsec.bench.common import with_environment

_FIRST = [
    "Ann",
    "Bob",
    "Carla",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Nils",
    "Olga",
]
_LAST = [
    "Smith",
    "Jones",
    "Garcia",
    "Müller",
    "Rossi",
    "Dubois",
    "Tanaka",
    "Novak",
    "Silva",
    "Okafor",
    "Larsen",
    "Kim",
]
_STREETS = ["Baker Street", "Rue de Rivoli", "High Road", "Elm Avenue", "Mill Lane", "Oak Drive"]
_NOTES = [
    "Patient reports chest pain radiating to the left arm since yesterday evening",
    "Follow-up visit after the change of medication, blood pressure well controlled",
    "Referred by the general practitioner for persistent cough and mild fever",
    "Discussed lifestyle changes and scheduled a new blood test in three months",
]


def sensitive_table(rows: int = 300, seed: int = 0) -> tuple[dict[str, list[str]], dict[str, str]]:
    """A labelled table for detection: column -> values, and column -> the category of
    sensitive data it holds ("" for none)."""
    rng = random.Random(seed)

    def pick(options: list[str]) -> str:
        return rng.choice(options)

    def name() -> str:
        return f"{pick(_FIRST)} {pick(_LAST)}"

    def email() -> str:
        return f"{pick(_FIRST).lower()}.{pick(_LAST).lower()}@{pick(['mail.org', 'x.com'])}"

    def phone() -> str:
        return pick(
            [
                f"+44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}",
                f"({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
                f"0{rng.randint(6, 7)}.{rng.randint(10, 99)}.{rng.randint(10, 99)}."
                f"{rng.randint(10, 99)}.{rng.randint(10, 99)}",
            ]
        )

    def ssn() -> str:
        return f"{rng.randint(100, 899)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"

    def date(lo: int, hi: int) -> str:
        return f"{rng.randint(lo, hi)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"

    def address() -> str:
        return f"{rng.randint(1, 250)} {pick(_STREETS)}"

    def note() -> str:
        return pick(_NOTES) + pick(["", ".", "; no allergies.", " and dizziness."])

    sensitive: dict[str, tuple[str, Any]] = {
        "pt_nm": ("name", name),
        "patient_name": ("name", name),
        "first_name": ("name", lambda: pick(_FIRST)),
        "surname": ("name", lambda: pick(_LAST)),
        "ref_person": ("name", name),  # neutral name, names inside
        "email": ("email", email),
        "e_mail_addr": ("email", email),
        "c1": ("email", email),  # neutral name
        "phone": ("phone", phone),
        "tel_no": ("phone", phone),
        "x7": ("phone", phone),  # neutral name
        "ssn": ("national_id", ssn),
        "mrn": ("national_id", lambda: f"MRN{rng.randint(100000, 999999)}"),
        "ident": ("national_id", ssn),  # neutral name, SSN-shaped values
        "dob": ("birth_date", lambda: date(1930, 2015)),
        "BirthDt": ("birth_date", lambda: date(1930, 2015)),
        "d2": ("birth_date", lambda: date(1930, 2015)),  # neutral name
        "admit_date": ("date", lambda: date(2022, 2024)),
        "home_addr": ("address", address),
        "zip_cd": ("address", lambda: f"{rng.randint(10000, 99999)}"),
        "loc": ("address", address),  # neutral name
        "clinical_notes": ("free_text", note),
        "comments": ("free_text", note),
        "obs": ("free_text", note),  # neutral name
    }
    plain: dict[str, Any] = {
        "age": lambda: str(rng.randint(18, 95)),
        "bmi": lambda: f"{rng.uniform(16, 40):.1f}",
        "weight_kg": lambda: f"{rng.uniform(45, 120):.1f}",
        "height_cm": lambda: str(rng.randint(145, 200)),
        "systolic_bp": lambda: str(rng.randint(90, 180)),
        "diastolic_bp": lambda: str(rng.randint(60, 110)),
        "heart_rate": lambda: str(rng.randint(50, 120)),
        "glucose": lambda: f"{rng.uniform(3.5, 12):.2f}",
        "hba1c": lambda: f"{rng.uniform(4, 11):.1f}",
        "temp_c": lambda: f"{rng.uniform(35.5, 40):.1f}",
        "sex": lambda: pick(["F", "M"]),
        "smoker": lambda: pick(["yes", "no"]),
        "icd10": lambda: pick(["J45", "E11", "I10", "J18", "N39"]),
        "ward": lambda: pick(list("ABCDEF")),
        "visit_count": lambda: str(rng.randint(1, 30)),
        "los_days": lambda: str(rng.randint(0, 40)),
        "insurance": lambda: pick(["public", "private", "none"]),
        "department": lambda: pick(["Cardiology", "Oncology", "Pediatrics", "Surgery"]),
        "drug_name": lambda: pick(["Metformin", "Lisinopril", "Atorvastatin", "Salbutamol"]),
        "country": lambda: pick(["France", "Germany", "United Kingdom", "Japan", "Brazil"]),
    }
    columns: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for col, (category, make) in sensitive.items():
        columns[col], labels[col] = [make() for _ in range(rows)], category
    for col, make in plain.items():
        columns[col], labels[col] = [make() for _ in range(rows)], ""
    return columns, labels


def detection_score(columns: dict[str, list[str]], labels: dict[str, str]) -> dict[str, Any]:
    """Recall over the sensitive columns and the flagged plain ones."""
    from fedsec.data.sensitive import detect

    flagged = {c: detect(c, values) for c, values in columns.items()}
    sensitive = [c for c, cat in labels.items() if cat]
    missed = [c for c in sensitive if flagged[c] is None]
    false_positives = {
        c: f"{f.category} by {f.by} ({f.evidence})"
        for c, f in flagged.items()
        if f is not None and not labels[c]
    }
    wrong_category = {
        c: f"{labels[c]} flagged as {f.category}"
        for c, f in flagged.items()
        if f is not None and labels[c] and f.category != labels[c]
    }
    return {
        "columns": len(columns),
        "sensitive": len(sensitive),
        "recall": round((len(sensitive) - len(missed)) / len(sensitive), 4),
        "missed": missed,
        "false_positives": false_positives,
        "other_category": wrong_category,
    }


def write_wide_csv(path: Path, rows: int, columns: int, seed: int = 0) -> None:
    """A ``rows`` × ``columns`` CSV like a hospital export, written in blocks."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    kinds = ["float", "int", "category", "name", "email", "date"]
    names = [f"{kinds[i % len(kinds)]}_{i}" for i in range(columns)]
    first = np.array(_FIRST)
    last = np.array(_LAST)
    block = 100_000
    with pacsv.CSVWriter(path, pa.schema([(n, pa.string()) for n in names])) as writer:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            arrays = []
            for i in range(columns):
                kind = kinds[i % len(kinds)]
                if kind == "float":
                    values = np.char.mod("%.3f", rng.normal(50, 10, n))
                elif kind == "int":
                    values = rng.integers(0, 1000, n).astype(str)
                elif kind == "category":
                    values = np.array(["A", "B", "C", "D", ""])[rng.integers(0, 5, n)]
                elif kind == "name":
                    values = np.char.add(
                        np.char.add(first[rng.integers(0, len(first), n)], " "),
                        last[rng.integers(0, len(last), n)],
                    )
                elif kind == "email":
                    values = np.char.add(
                        np.char.lower(last[rng.integers(0, len(last), n)]),
                        np.char.mod("%d@example.org", rng.integers(0, 10_000, n)),
                    )
                else:
                    values = np.char.mod("2023-01-%02d", rng.integers(1, 29, n))
                arrays.append(pa.array(values.tolist(), type=pa.string()))
            writer.write_table(pa.table(arrays, names=names))


_CHILD = """
import json, resource, sys, time
mode, path = sys.argv[1], sys.argv[2]
from fedsec.data.settings import SourceSpec
from fedsec.data.sources import open_source
source = open_source(SourceSpec(kind="csv", path=path))
start = time.perf_counter()
if mode == "floor":
    rows = sum(c.rows for c in source.chunks())
    columns = None
else:
    from fedsec.data.inventory import build_map
    m = build_map([source])
    rows = m["sources"][0]["rows"]
    columns = len(m["sources"][0]["columns"])
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent, which wrote
# the file; VmHWM is this process image's own peak
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
rss = int(hwm[0].split()[1]) / 1024 if hwm else 0.0
print(json.dumps({"seconds": seconds, "rows": rows, "columns": columns, "peak_rss_mb": rss}))
"""


def _child(mode: str, path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(path)], check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@click.command("inventory")
@click.option("--rows", default=1_000_000, show_default=True, help="rows of the scanned CSV")
@click.option("--columns", default=50, show_default=True, help="columns of the scanned CSV")
@click.option("--repeat", default=3, show_default=True, help="timed scans (one line each)")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_inventory(rows: int, columns: int, repeat: int, as_json: bool) -> None:
    """Data-map scan time and peak memory on a wide CSV; sensitive-field detection."""
    with tempfile.TemporaryDirectory(prefix="fedsec-inventory-") as tmp:
        path = Path(tmp) / "export.csv"
        started = time.perf_counter()
        write_wide_csv(path, rows, columns)
        written = time.perf_counter() - started
        size_mb = path.stat().st_size / 2**20
        for run in range(repeat):
            floor = _child("floor", path)
            scan = _child("inventory", path)
            result = {
                "bench": "inventory",
                "run": run,
                "rows": scan["rows"],
                "columns": scan["columns"],
                "file_mb": round(size_mb, 1),
                "write_s": round(written, 2),
                "inventory_s": round(scan["seconds"], 3),
                "inventory_peak_rss_mb": round(scan["peak_rss_mb"], 1),
                "floor_read_s": round(floor["seconds"], 3),
                "floor_peak_rss_mb": round(floor["peak_rss_mb"], 1),
                "ratio_to_floor": round(scan["seconds"] / floor["seconds"], 2),
            }
            click.echo(json.dumps(with_environment(result)))
    table, labels = sensitive_table()
    detection = {"bench": "inventory-detection", **detection_score(table, labels)}
    click.echo(json.dumps(with_environment(detection)))
