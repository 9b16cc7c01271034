"""Write scikit-learn's bundled diabetes records into a database table (what a member's
own database would already hold): ``python -m diabetes_postgres.load_table URL [TABLE]``.

Each row gets an ``id`` and a ``split`` (80 % train, 20 % test, drawn once with a fixed
seed). Nothing is downloaded; an existing table of that name is replaced.
"""

from __future__ import annotations

import sys

import numpy as np
import sqlalchemy
from sklearn.datasets import load_diabetes

from diabetes_postgres.task import DEFAULT_TABLE, FEATURES, SPLIT, TARGET, _query

TEST_FRACTION = 0.2


def load_table(url: str, table: str = DEFAULT_TABLE, seed: int = 0) -> dict[str, int]:
    """Create ``table`` at ``url`` from the bundled records; returns rows per split.

    Raises:
        fedsec.errors.ConfigError: ``table`` is not a plain identifier.
        sqlalchemy.exc.SQLAlchemyError: the database refused.
    """
    _query(table)  # the same identifier check as the reader's
    bunch = load_diabetes(scaled=False)
    rng = np.random.default_rng(seed)
    test = rng.permutation(len(bunch.target))[: round(TEST_FRACTION * len(bunch.target))]
    split = np.full(len(bunch.target), "train", dtype=object)
    split[test] = "test"
    values = ", ".join(f"{name} double precision not null" for name in (*FEATURES, TARGET))
    create = f"CREATE TABLE {table} (id integer primary key, {values}, {SPLIT} text not null)"
    rows = [
        {"id": i, **dict(zip(FEATURES, map(float, x), strict=True)), TARGET: float(y), SPLIT: s}
        for i, (x, y, s) in enumerate(zip(bunch.data, bunch.target, split, strict=True))
    ]
    names = ("id", *FEATURES, TARGET, SPLIT)
    insert = (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(':' + n for n in names)})"
    )
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(sqlalchemy.text(create))
            conn.execute(sqlalchemy.text(insert), rows)
    finally:
        engine.dispose()
    return {"train": int(np.sum(split == "train")), "test": int(np.sum(split == "test"))}


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m diabetes_postgres.load_table URL [TABLE]")
    print(load_table(*sys.argv[1:]))
