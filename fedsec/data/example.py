"""Three hospital exports that differ the way real ones do, and the rules that align them.

Used by ``fedsec demo --data csv``, the end-to-end test and ``docs/data.md``.  The
records are synthetic (a seeded generator, not patient data): the diagnosis depends on
glucose, BMI, age and smoking, so a model trained on the union learns something real.

How the exports differ:

- ``hospital-a.csv``: the reference layout, with a ``patient_name`` column;
- ``hospital-b.csv``: other column order, ``age_years`` and ``dx`` instead of ``age`` and
  ``diagnosis`` (renamed by its rules), an extra ``email`` column, missing BMI values
  written as blanks and ``NA``;
- ``hospital-c.csv``: the patient's name as ``pt_nm`` and a social-security number
  ``ssn`` (both excluded by its rules), post codes generalised to their first two
  digits, and no ``former`` smokers at all: a category it lacks.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Any

from fedsec.data.settings import ColumnRules, SourceSpec
from fedsec.protocol.data_schema import DataSchema, SchemaColumn

SCHEMA = DataSchema(
    label="diagnosis",
    classes=["healthy", "prediabetes", "diabetes"],
    columns=[
        SchemaColumn(name="age", unit="years"),
        SchemaColumn(name="sex", kind="categorical", categories=["F", "M"]),
        SchemaColumn(name="bmi", unit="kg/m2", missing="indicator"),
        SchemaColumn(
            name="smoker",
            kind="categorical",
            categories=["never", "former", "current"],
            missing="impute",
        ),
        SchemaColumn(name="glucose", unit="mmol/L"),
        SchemaColumn(name="systolic_bp", unit="mmHg"),
    ],
)

RULES: dict[str, ColumnRules] = {
    "hospital-a": ColumnRules(exclude=["patient_name"]),
    "hospital-b": ColumnRules(
        rename={"age_years": "age", "dx": "diagnosis"}, exclude=["patient_name", "email"]
    ),
    "hospital-c": ColumnRules(exclude=["pt_nm", "ssn"], anonymise={"zip": "generalise:prefix:2"}),
}

_FIRST = ["Ann", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
_LAST = ["Smith", "Jones", "Garcia", "Rossi", "Dubois", "Tanaka", "Novak", "Silva"]


def _patient(rng: random.Random, smokers: list[str]) -> dict[str, Any]:
    age = rng.randint(25, 85)
    bmi = round(rng.gauss(27, 5), 1)
    smoker = rng.choice(smokers)
    glucose = rng.gauss(5.2, 0.6) + 0.04 * (bmi - 27) + 0.01 * (age - 50)
    glucose += {"never": 0.0, "former": 0.2, "current": 0.4}[smoker] + rng.gauss(0, 0.3)
    diagnosis = "healthy" if glucose < 5.6 else "prediabetes" if glucose < 6.5 else "diabetes"
    return {
        "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        "age": age,
        "sex": rng.choice(["F", "M"]),
        "bmi": bmi,
        "smoker": smoker,
        "glucose": round(glucose + rng.gauss(0, 0.15), 2),
        "systolic_bp": int(rng.gauss(125, 15) + 0.3 * (age - 50)),
        "diagnosis": diagnosis,
    }


EXPORT_ROWS = 400  # per hospital: enough for a few DP-SGD rounds to learn the rule


def write_hospital_exports(
    directory: Path, rows: int = EXPORT_ROWS, seed: int = 0
) -> dict[str, Path]:
    """Write the three exports into ``directory``; return hospital -> file."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    smokers_all = ["never", "never", "former", "current"]
    out: dict[str, Path] = {}

    def write(name: str, header: list[str], records: list[list[Any]]) -> None:
        path = directory / f"{name}.csv"
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(records)
        out[name] = path

    a = [_patient(rng, smokers_all) for _ in range(rows)]
    write(
        "hospital-a",
        ["patient_name", "age", "sex", "bmi", "smoker", "glucose", "systolic_bp", "diagnosis"],
        [
            [p["name"], p["age"], p["sex"], p["bmi"], p["smoker"], p["glucose"],
             p["systolic_bp"], p["diagnosis"]]
            for p in a
        ],
    )  # fmt: skip
    b = [_patient(rng, smokers_all) for _ in range(rows)]
    write(
        "hospital-b",
        ["dx", "glucose", "email", "smoker", "bmi", "systolic_bp", "sex", "patient_name",
         "age_years"],
        [
            [p["diagnosis"], p["glucose"],
             p["name"].lower().replace(" ", ".") + "@mail.example", p["smoker"],
             "" if i % 9 == 0 else "NA" if i % 13 == 0 else p["bmi"], p["systolic_bp"],
             p["sex"], p["name"], p["age"]]
            for i, p in enumerate(b)
        ],
    )  # fmt: skip
    c = [_patient(rng, ["never", "current"]) for _ in range(rows)]
    write(
        "hospital-c",
        ["pt_nm", "ssn", "zip", "sex", "age", "bmi", "smoker", "systolic_bp", "glucose",
         "diagnosis"],
        [
            [p["name"], f"{rng.randint(100, 899)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}",
             f"{rng.randint(10000, 99999)}", p["sex"], p["age"], p["bmi"], p["smoker"],
             p["systolic_bp"], p["glucose"], p["diagnosis"]]
            for p in c
        ],
    )  # fmt: skip
    return out


def hospital_source(path: Path) -> SourceSpec:
    return SourceSpec(kind="csv", path=str(path))
