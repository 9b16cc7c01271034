"""Fixtures of the data tests: a real PostgreSQL server (tests.support.postgres)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import Postgres, postgres_server


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server
