"""``fedsec peer run --config peer.toml``: three members, each its own peer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.bench.common import free_port
from fedsec.cli import main
from fedsec.crypto.identity import SigningIdentity
from fedsec.keys import load_identity, save_identity
from fedsec.peer.cli import _run
from fedsec.peer.config import load_peer_config
from fedsec.peer.journal import verify_journal
from fedsec.peer.topology import sign_topology

FED = "fed-cli"


def _configs(tmp_path: Path, n: int = 3) -> list[Path]:
    admin = SigningIdentity.generate()
    ids = [SigningIdentity.generate() for _ in range(n)]
    ports = [free_port() for _ in ids]
    topology = sign_topology(admin, FED, bytes(32), 2)
    members = "".join(
        f'[[members]]\npublic_key = "{i.public_bytes.hex()}"\nurl = "http://127.0.0.1:{p}"\n'
        for i, p in zip(ids, ports, strict=True)
    )
    paths = []
    for k, (identity, port) in enumerate(zip(ids, ports, strict=True)):
        home = tmp_path / f"m{k}"
        save_identity(identity, home / "member.key")
        text = f"""federation_id = "{FED}"
key_file = "member.key"
port = {port}
admin_public_key = "{admin.public_bytes.hex()}"
rounds = 1
topology = {{ federation_id = "{FED}", seed = "{topology.seed}", degree = 2, \
signature = "{topology.signature}" }}

[training]
task = "breast_cancer"
shard = {k}
shards = {n}
local_epochs = 1

[gossip]
exchanges = 2

{members}"""
        (home / "peer.toml").write_text(text)
        paths.append(home / "peer.toml")
    return paths


@pytest.mark.asyncio
async def test_three_peers_run_from_their_configs(tmp_path: Path) -> None:
    paths = _configs(tmp_path)
    configs = [load_peer_config(p) for p in paths]
    runs = await asyncio.gather(*(_run(c, p.parent) for c, p in zip(configs, paths, strict=True)))
    for outcomes, path in zip(runs, paths, strict=True):
        assert [o.exchange for o in outcomes] == [0, 1]
        assert all(len(o.accepted) == 2 for o in outcomes)
        lines = (path.parent / "peer-journal.jsonl").read_bytes().splitlines()
        assert verify_journal(lines[:-1], _own_key(path), FED) == -1
        assert verify_journal(lines, _own_key(path), FED) == len(lines) - 2


def _own_key(path: Path) -> bytes:
    return load_identity(path.parent / "member.key").public_bytes


def test_an_invalid_config_is_refused_with_its_key_path(tmp_path: Path) -> None:
    path = _configs(tmp_path)[0]
    path.write_text(path.read_text().replace("shard = 0", 'shard = "zero"'))
    result = CliRunner().invoke(main, ["peer", "run", "--config", str(path)])
    assert result.exit_code != 0
    assert "$.training.shard" in result.output and "Traceback" not in result.output
