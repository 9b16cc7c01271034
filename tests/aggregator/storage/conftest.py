"""Fixtures of the PostgreSQL storage tests: one real cluster per module
(tests.support.postgres), a fresh database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import Postgres, fresh_database, postgres_server


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


@pytest.fixture
def database(postgres: Postgres) -> str:
    """The URL of a new, empty database."""
    return fresh_database(postgres)
