"""The example installs, is found by its entry point, reads its table and learns.

Here the table is an SQLite file (the SQL source reads any SQLAlchemy URL); fedsec's
own tests run it against a real PostgreSQL server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diabetes_postgres.load_table import load_table

from fedsec.errors import ConfigError
from fedsec.task import load_task
from fedsec.task.dp import check_dp_compatible


def test_the_task_reads_its_table_and_learns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'member.db'}"
    assert load_table(url) == {"train": 354, "test": 88}
    task = load_task("diabetes_postgres", url=url)
    data = task.load()
    assert data.x_train.shape == (354, 10) and data.y_test.shape == (88, 1)
    assert abs(float(data.y_train.mean())) < 1e-5  # standardised on the training rows
    model = task.build_model(0)
    check_dp_compatible(task.name, model)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(200):
        optimizer.zero_grad()
        task.batch_loss(model, (x, y)).backward()
        optimizer.step()
    with torch.no_grad():
        totals = task.metric_totals(
            model(torch.from_numpy(data.x_test)), torch.from_numpy(data.y_test)
        )
    assert totals["r2"] / len(data.y_test) > 0.3  # a linear fit reaches about 0.5


def test_a_table_name_that_is_not_an_identifier_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'member.db'}"
    with pytest.raises(ConfigError, match="not a plain identifier"):
        load_task("diabetes_postgres", url=url, table="x; drop table y").load()
