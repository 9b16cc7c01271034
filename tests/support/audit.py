"""A real federation's records, produced once per test session, and ways to tamper with them.

:func:`audit_workspace` runs a small federation end to end (a real aggregator on
loopback HTTP, three real agents, breast_cancer, SecAgg+, DP-SGD, three rounds)
through :func:`fedsec.simulation.run_simulation` in a subprocess, so the test
process keeps its own torch and logging settings.  The result is laid out like a
``fedsec demo`` directory: ``aggregator/`` (log, archive, models, manifests, keys)
and ``agent-N/`` (identity key, receipts).

Tests never touch that directory: :func:`workspace_copy` gives each test its own
copy to tamper with.  The helpers below edit log lines the way an attacker would,
either naively (one line changed, the chain breaks right after it) or consistently
(every later ``prev`` recomputed, so only a signed ``head`` can tell).

The fixtures are registered for tests/audit by its conftest.py; a test module elsewhere
that needs them imports them the same way.  The run itself is memoised here, so the
federation runs once per session however many modules use it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedsec.crypto.identity import SigningIdentity, canonical_json
from fedsec.keys import load_identity
from fedsec.protocol.log import entry_from_line
from fedsec.protocol.log_builder import resign

ROUNDS = 3
AGENTS = 3
LOG = Path("aggregator/audit/log.jsonl")
ARCHIVE = Path("aggregator/audit/archive")
MODELS = Path("aggregator/models")

_DRIVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from fedsec.simulation import SimulationSpec, run_simulation

    spec = SimulationSpec(
        task="breast_cancer", agents=int(sys.argv[2]), rounds=int(sys.argv[3]),
        partition="iid", secure_sum="secagg", dp_epsilon=8.0, seed=0,
        server_optimizer=sys.argv[4], baseline=False, **json.loads(sys.argv[5]),
    )
    result = asyncio.run(run_simulation(spec, Path(sys.argv[1])))
    assert result["rounds"] == int(sys.argv[3]), result
    """
)


def build_workspace(
    root: Path,
    agents: int = AGENTS,
    rounds: int = ROUNDS,
    server_optimizer: str = "fedavg",
    **spec: Any,
) -> Path:
    """Run a federation into ``root`` (which must not exist yet); return ``root``.
    ``spec`` overrides fields of the run's ``SimulationSpec`` (a codec, a DP mode)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _DRIVER,
            str(root),
            str(agents),
            str(rounds),
            server_optimizer,
            json.dumps(spec),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"federation run failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return root


_built: list[Path] = []  # the session's federation, once run


@pytest.fixture(scope="session")
def audit_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pristine records of one real federation run (read-only by convention)."""
    if not _built:
        _built.append(build_workspace(tmp_path_factory.mktemp("audit-src") / "federation"))
    return _built[0]


@pytest.fixture
def workspace_copy(audit_workspace: Path, tmp_path: Path) -> Path:
    """This test's own copy of the federation's records."""
    target = tmp_path / "federation"
    shutil.copytree(audit_workspace, target, ignore=shutil.ignore_patterns("*.lock"))
    return target


# -- reading and writing the log ------------------------------------------------------------------


def read_lines(root: Path) -> list[bytes]:
    """The log's lines, without their newlines."""
    return (root / LOG).read_bytes().splitlines()


def write_lines(root: Path, lines: list[bytes]) -> None:
    (root / LOG).write_bytes(b"".join(line + b"\n" for line in lines))


def entries(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_lines(root)]


def find(root: Path, kind: str, nth: int = 0, **match: Any) -> int:
    """Index of the ``nth`` entry of ``kind`` whose body has the ``match`` fields."""
    hits = [
        e["index"]
        for e in entries(root)
        if e["kind"] == kind and all(e["body"].get(k) == v for k, v in match.items())
    ]
    return hits[nth]


def encode(doc: dict[str, Any]) -> bytes:
    return canonical_json(doc)


def rechain(lines: list[bytes], start: int = 0, *, fix_heads: bool = True) -> list[bytes]:
    """Recompute every ``index`` and ``prev`` from line ``start`` on, as an attacker would.

    With ``fix_heads`` the ``signed_hash`` of every later head is updated too (its
    signature cannot be, without the aggregator's key).
    """
    out = list(lines[:start])
    prev = hashlib.sha256(out[-1]).hexdigest() if out else "0" * 64
    for i, line in enumerate(lines[start:], start=start):
        doc = json.loads(line)
        doc["index"], doc["prev"] = i, prev
        if fix_heads and doc["kind"] == "head":
            doc["body"]["signed_index"] = i - 1
            doc["body"]["signed_hash"] = prev
        new = encode(doc)
        out.append(new)
        prev = hashlib.sha256(new).hexdigest()
    return out


def edit_entry(
    root: Path,
    index: int,
    change: Callable[[dict[str, Any]], None],
    *,
    consistent: bool = True,
) -> None:
    """Change entry ``index``'s document; with ``consistent`` re-hash the rest of the chain."""
    lines = read_lines(root)
    doc = json.loads(lines[index])
    change(doc)
    lines[index] = encode(doc)
    write_lines(root, rechain(lines, index + 1) if consistent else lines)


def rewrite_signed(root: Path, index: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Change entry ``index`` as the operator could: re-chain and re-sign every later head
    (:func:`fedsec.protocol.log_builder.resign`).  The changed entry itself is written as
    ``change`` leaves it, schema or not."""
    lines = read_lines(root)
    doc = json.loads(lines[index])
    change(doc)
    lines[index] = encode(doc)
    logged = [entry_from_line(line) for line in lines]
    write_lines(root, [e.line for e in resign(logged, index + 1, aggregator_key(root))])


def agent_key(root: Path, member: str) -> SigningIdentity:
    return load_identity(root / member / "identity.key")


def aggregator_key(root: Path) -> SigningIdentity:
    return load_identity(root / "aggregator" / "aggregator.key")


def archive_path(root: Path, digest: str) -> Path:
    return root / ARCHIVE / digest[:2] / digest


def model_path(root: Path, digest: str) -> Path:
    return root / MODELS / f"{digest}.safetensors"
