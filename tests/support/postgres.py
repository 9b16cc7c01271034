"""A throw-away PostgreSQL cluster for tests: initdb + pg_ctl in a temp dir, on loopback.

The server binaries come from Debian's ``postgresql`` package (``make system-deps``
installs it when run as root).  PostgreSQL refuses to run as root, so as root the
cluster runs as the ``postgres`` system user (``runuser``).  Without the binaries the
tests skip, except under ``CI=true``, where they fail: CI must test for real.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

USER = "fedsec_owner"
PASSWORD = "pg-test-secret-7f3a"  # the tests check it never appears in output
DATABASE = "records"
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int

    def url(self, password: bool = True, database: str = DATABASE) -> str:
        secret = f":{PASSWORD}" if password else ""
        return f"postgresql+psycopg://{USER}{secret}@{self.host}:{self.port}/{database}"


def _bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def postgres_server() -> Iterator[Postgres]:
    """Start a cluster with user :data:`USER` (password auth over TCP) and database
    :data:`DATABASE`; stop it and delete its files on exit."""
    bindir = _bindir()
    if bindir is None:
        message = "PostgreSQL server binaries missing (apt-get install postgresql)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true requires them")
        pytest.skip(message)
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="fedsec-pg-"))  # /tmp: reachable by postgres
    data, log = root / "data", root / "server.log"
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD)
    if as_postgres:
        shutil.chown(root, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    port = _free_port()

    def run(*args: str) -> None:
        subprocess.run([*as_postgres, *args], check=True, capture_output=True, timeout=120)

    try:
        run(
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        run(
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(log),
            "-o",
            options,
            "-w",
            "-t",
            str(START_TIMEOUT_S),
            "start",
        )
        try:
            run(str(bindir / "createdb"), "-h", str(root), "-p", str(port), "-U", USER, DATABASE)
            yield Postgres("127.0.0.1", port)
        finally:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(server: Postgres) -> str:
    """Create a new empty database on ``server``; return its libpq URL (each test that
    needs a clean state gets one, without a new cluster)."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = f"postgresql://{USER}:{PASSWORD}@{server.host}:{server.port}/{DATABASE}"
    with psycopg.connect(admin, autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql://{USER}:{PASSWORD}@{server.host}:{server.port}/{name}"
