"""A throw-away PostgreSQL cluster for tests (:mod:`fedsec.bench.pgcluster`: initdb +
pg_ctl in a temp dir, on loopback).

Without the server binaries the tests skip, except under ``CI=true``, where they fail:
CI must test for real.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from fedsec.bench.pgcluster import Cluster, server_bindir, temporary_cluster

USER = "fedsec_owner"
PASSWORD = "pg-test-secret-7f3a"  # the tests check it never appears in output
DATABASE = "records"


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int

    def url(self, password: bool = True, database: str = DATABASE) -> str:
        secret = f":{PASSWORD}" if password else ""
        return f"postgresql+psycopg://{USER}{secret}@{self.host}:{self.port}/{database}"

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.host, self.port, USER, PASSWORD, DATABASE)


@contextmanager
def postgres_server() -> Iterator[Postgres]:
    """Start a cluster with user :data:`USER` (password auth over TCP) and database
    :data:`DATABASE`; stop it and delete its files on exit."""
    if server_bindir() is None:
        message = "PostgreSQL server binaries missing (apt-get install postgresql)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true requires them")
        pytest.skip(message)
    with temporary_cluster(USER, PASSWORD, DATABASE) as cluster:
        yield Postgres(cluster.host, cluster.port)


def fresh_database(server: Postgres) -> str:
    """Create a new empty database on ``server``; return its libpq URL (each test that
    needs a clean state gets one, without a new cluster)."""
    return server.cluster.fresh_database()
