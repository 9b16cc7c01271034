"""``fedsec peer run --config peer.toml``: three members, each its own peer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.agent.accountant import epsilon_of
from fedsec.agent.ledger import PrivacyLedger
from fedsec.bench.common import free_port
from fedsec.cli import main
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import BudgetExhausted, ConfigError, IntegrityError
from fedsec.keys import load_identity, save_identity
from fedsec.learning.training import DPParams
from fedsec.peer.cli import _run
from fedsec.peer.config import load_peer_config
from fedsec.peer.journal import verify_journal
from fedsec.peer.privacy import plan_peer_charge
from fedsec.peer.topology import sign_topology
from fedsec.protocol.limits import DEFAULT_DELTA
from fedsec.protocol.roster import ROSTER_FORMAT, sign_roster_entry
from fedsec.tasks import get_task
from fedsec.tasks.partition import parse_partition
from tests.support.tls import self_signed

FED = "fed-cli"


def _configs(
    tmp_path: Path,
    n: int = 3,
    admin: SigningIdentity | None = None,
    ids: list[SigningIdentity] | None = None,
    extra: str = "",
    scheme: str = "http",
    privacy: str = "require_dp = false  # a simulation on public data: no DP noise",
    training: str = "",
    rounds: int = 1,
) -> list[Path]:
    """Each member's ``peer.toml``; ``extra`` top-level keys are added to each,
    ``privacy`` and ``training`` keys to those sections, and ``scheme`` is that of every
    member's url."""
    admin = admin or SigningIdentity.generate()
    ids = ids or [SigningIdentity.generate() for _ in range(n)]
    ports = [free_port() for _ in ids]
    topology = sign_topology(admin, FED, bytes(32), 2)
    members = "".join(
        f'[[members]]\npublic_key = "{i.public_bytes.hex()}"\nurl = "{scheme}://127.0.0.1:{p}"\n'
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
rounds = {rounds}
{extra}
topology = {{ federation_id = "{FED}", seed = "{topology.seed}", degree = 2, \
signature = "{topology.signature}" }}

[training]
task = "breast_cancer"
shard = {k}
shards = {n}
local_epochs = 1
{training}

[gossip]
exchanges = 2

[privacy]
{privacy}

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


@pytest.mark.asyncio
async def test_peers_charge_their_ledgers_and_stop_signed_when_the_budget_is_spent(
    tmp_path: Path,
) -> None:
    task = get_task("breast_cancer")
    params = dataclasses.replace(task.defaults, local_epochs=1)
    shards = parse_partition("iid").apply(task.load().y_train, 3, 0)
    costs = [plan_peer_charge(0, len(s), params, DPParams(1.0, 1.0, DEFAULT_DELTA)) for s in shards]
    one = max(epsilon_of([c.cost], DEFAULT_DELTA) for c in costs)
    two = min(epsilon_of([c.cost] * 2, DEFAULT_DELTA) for c in costs)
    assert one < two
    budget = f"epsilon = {(one + two) / 2}"  # round 0 fits, round 1 does not
    paths = _configs(tmp_path, privacy=budget, training="noise_multiplier = 1.0", rounds=2)
    configs = [load_peer_config(p) for p in paths]
    runs = [_run(c, p.parent) for c, p in zip(configs, paths, strict=True)]
    stopped = await asyncio.gather(*runs, return_exceptions=True)
    assert all(isinstance(e, BudgetExhausted) for e in stopped), stopped
    assert "training round 1 would spend epsilon" in str(stopped[0])
    for k, path in enumerate(paths):
        (charge,) = PrivacyLedger(path.parent / "state").history(f"breast_cancer:iid:0:{k}/3")
        assert (charge.round, charge.released_to, charge.holder) == (0, (0, 0), f"peer:{FED}")
        lines = (path.parent / "peer-journal.jsonl").read_bytes().splitlines()
        assert verify_journal(lines, _own_key(path), FED) == len(lines) - 2  # signed to the end
        rounds = {json.loads(line)["body"].get("round") for line in lines[:-1]}
        assert rounds == {0}  # round 0 gossiped; nothing of round 1 was trained or sent


@pytest.mark.asyncio
async def test_a_peer_without_dp_noise_is_refused_unless_the_member_allows_it(
    tmp_path: Path,
) -> None:
    path = _configs(tmp_path, privacy="")[0]
    with pytest.raises(ConfigError, match="require_dp"):
        await _run(load_peer_config(path), path.parent)
    assert not (path.parent / "peer-journal.jsonl").exists()


def _own_key(path: Path) -> bytes:
    return load_identity(path.parent / "member.key").public_bytes


def test_an_invalid_config_is_refused_with_its_key_path(tmp_path: Path) -> None:
    path = _configs(tmp_path)[0]
    path.write_text(path.read_text().replace("shard = 0", 'shard = "zero"'))
    result = CliRunner().invoke(main, ["peer", "run", "--config", str(path)])
    assert result.exit_code != 0
    assert "$.training.shard" in result.output and "Traceback" not in result.output


def _signed_roster(path: Path, admin: SigningIdentity, members: list[SigningIdentity]) -> None:
    entries = [
        sign_roster_entry(
            federation_id=FED,
            agent_id=f"m{k}",
            public_key=m.public_bytes,
            role="agent",
            admin=admin,
        ).to_dict()
        for k, m in enumerate(members)
    ]
    doc = {
        "format": ROSTER_FORMAT,
        "federation_id": FED,
        "admin_key_id": admin.key_id,
        "serial": len(entries),
        "entries": entries,
    }
    path.write_text(json.dumps(doc))


@pytest.mark.asyncio
async def test_peers_whose_members_are_the_signed_roster_run(tmp_path: Path) -> None:
    admin, ids = SigningIdentity.generate(), [SigningIdentity.generate() for _ in range(3)]
    _signed_roster(tmp_path / "roster.json", admin, ids)
    paths = _configs(tmp_path, admin=admin, ids=ids, extra='roster_file = "../roster.json"')
    configs = [load_peer_config(p) for p in paths]
    runs = await asyncio.gather(*(_run(c, p.parent) for c, p in zip(configs, paths, strict=True)))
    assert all(len(o.accepted) == 2 for outcomes in runs for o in outcomes)


@pytest.mark.asyncio
async def test_a_member_outside_the_signed_roster_or_a_forged_roster_is_refused(
    tmp_path: Path,
) -> None:
    admin, ids = SigningIdentity.generate(), [SigningIdentity.generate() for _ in range(3)]
    roster = tmp_path / "roster.json"
    paths = _configs(tmp_path, admin=admin, ids=ids, extra='roster_file = "../roster.json"')
    config = load_peer_config(paths[0])
    _signed_roster(roster, admin, ids[:2])  # the third member was never enrolled
    with pytest.raises(ConfigError, match=f"{ids[2].key_id} is not an active agent"):
        await _run(config, paths[0].parent)
    _signed_roster(roster, SigningIdentity.generate(), ids)  # not the federation's admin
    with pytest.raises(IntegrityError, match="was written for admin key"):
        await _run(config, paths[0].parent)
    assert not (paths[0].parent / "peer-journal.jsonl").exists()


@pytest.mark.asyncio
async def test_peers_gossip_over_tls(tmp_path: Path) -> None:
    self_signed(tmp_path / "cert.pem", tmp_path / "key.pem")
    tls = 'tls_cert = "../cert.pem"\ntls_key = "../key.pem"\ntls_ca = "../cert.pem"'
    paths = _configs(tmp_path, extra=tls, scheme="https")
    configs = [load_peer_config(p) for p in paths]
    runs = await asyncio.gather(*(_run(c, p.parent) for c, p in zip(configs, paths, strict=True)))
    assert all(len(o.accepted) == 2 for outcomes in runs for o in outcomes)
