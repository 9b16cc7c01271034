"""A throw-away PostgreSQL cluster: initdb + pg_ctl in a temporary directory, on loopback.

What the replicated-aggregator benchmark (``fedsec bench failover``) and the storage
tests run against.  The server binaries come from Debian's ``postgresql`` package
(``make system-deps`` installs it when run as root).  PostgreSQL refuses to run as root,
so as root the cluster runs as the ``postgres`` system user (``runuser``).
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
from typing import Final

import psycopg

from fedsec.errors import ConfigError

#: How long the server may take to start: a cold start on a busy 2-core machine.
START_TIMEOUT_S: Final = 60


@dataclass(frozen=True)
class Cluster:
    """A running cluster: its loopback address and its owner's login."""

    host: str
    port: int
    user: str
    password: str
    database: str

    def url(self, database: str | None = None) -> str:
        """The libpq URL of ``database`` (default: the one created with the cluster)."""
        name = database or self.database
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{name}"

    def fresh_database(self) -> str:
        """Create a new empty database; its URL (a clean state without a new cluster).

        Raises:
            psycopg.Error: the server refuses.
        """
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def server_bindir() -> Path | None:
    """The newest installed PostgreSQL server's ``bin`` directory, None without one."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def temporary_cluster(user: str, password: str, database: str) -> Iterator[Cluster]:
    """Start a cluster owned by ``user`` (password auth over TCP) with ``database``;
    stop it and delete its files on exit.

    Raises:
        ConfigError: the server binaries are not installed.
        subprocess.CalledProcessError: initdb, pg_ctl or createdb failed.
    """
    bindir = server_bindir()
    if bindir is None:
        raise ConfigError("PostgreSQL server binaries missing (apt-get install postgresql)")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="fedsec-pg-"))  # /tmp: reachable by postgres
    data, log = root / "data", root / "server.log"
    pwfile = root / "pw"
    pwfile.write_text(password)
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
            user,
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
            run(str(bindir / "createdb"), "-h", str(root), "-p", str(port), "-U", user, database)
            yield Cluster("127.0.0.1", port, user, password, database)
        finally:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
