"""``fedsec audit verify --peer-journal``: gossip peers' journals from a real loopback run
are checked one by one and against each other; a tampered, dropped or contradicting
entry fails with a sentence naming the journal and the message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
from click.testing import CliRunner

from fedsec.audit.peer_journals import cross_check_journals
from fedsec.cli import main
from fedsec.crypto.identity import SigningIdentity
from fedsec.peer.gossip import GossipSettings
from fedsec.peer.journal import PeerJournal
from fedsec.peer.loopback import LoopbackMember, run_loopback
from fedsec.peer.messages import Vector
from fedsec.peer.runner import Timing
from fedsec.peer.topology import sign_topology
from fedsec.protocol.peer_journal import (
    JournalBody,
    PeerCaughtUp,
    PeerReceived,
    PeerSent,
    read_journal,
)

FED = "fed-audit-gossip"


@dataclass
class Run:
    ids: dict[str, SigningIdentity]
    files: dict[str, Path]

    @property
    def roster(self) -> dict[str, bytes]:
        return {k: i.public_bytes for k, i in self.ids.items()}

    def check(self) -> str | None:
        return cross_check_journals(sorted(self.files.values()), self.roster).problem

    def bodies(self, key: str) -> list[JournalBody]:
        return self.bodies_of(self.files[key].read_bytes())

    def bodies_of(self, data: bytes) -> list[JournalBody]:
        return read_journal(data.splitlines(), self.roster).bodies

    def rewrite(self, key: str, change: Callable[[list[JournalBody]], list[JournalBody]]) -> None:
        """The member ``key`` rewrites its own journal, re-chained and re-signed."""
        journal = PeerJournal(FED, self.ids[key])
        for body in change(self.bodies(key)):
            journal.append(body)
        journal.head()
        self.files[key].write_bytes(b"".join(e.line + b"\n" for e in journal.entries))


def _step(seed: int) -> Callable[[Vector, int], Vector]:
    direction = np.random.default_rng(seed).standard_normal(6)

    def train(model: Vector, round_: int) -> Vector:
        return model + 0.1 * direction

    return train


@dataclass(frozen=True)
class Honest:
    ids: dict[str, SigningIdentity]
    journals: dict[str, bytes]


@pytest.fixture(scope="module")
def honest() -> Honest:
    """The journals of four peers of degree 2 after two rounds of two exchanges."""
    admin = SigningIdentity.generate()
    ids = [SigningIdentity.generate() for _ in range(4)]
    members = [LoopbackMember(i, _step(n), 10) for n, i in enumerate(ids)]
    topology = sign_topology(admin, FED, bytes(32), 2)
    results = asyncio.run(
        run_loopback(
            FED,
            admin.public_bytes,
            topology,
            members,
            np.zeros(6),
            2,
            GossipSettings(exchanges=2, robust=False),
            Timing(20.0, 10.0),
        )
    )
    journals = {}
    for key, result in results.items():
        result.peer.journal.head()
        journals[key] = b"".join(e.line + b"\n" for e in result.peer.journal.entries)
    return Honest({i.key_id: i for i in ids}, journals)


def test_honest_journals_agree(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    result = cross_check_journals(sorted(run.files.values()), run.roster)
    assert result.ok, result.problem
    # 4 peers of degree 2, 2 rounds of 2 exchanges: each sends 4 messages to each of 2
    assert (result.journals, result.matched, result.outside) == (4, 32, 0)
    keys = [a for k in run.roster.values() for a in ("--peer-key", k.hex())]
    cli = CliRunner().invoke(main, ["audit", "verify", "--peer-journal", str(tmp_path), *keys])
    assert cli.exit_code == 0, cli.output
    assert "messages matched 32" in cli.output and "OK: peer journals agree" in cli.output


def test_a_journal_of_a_member_not_given_is_counted_not_matched(
    honest: Honest, tmp_path: Path
) -> None:
    run = _run(honest, tmp_path)
    dropped = sorted(run.files)[0]
    run.files.pop(dropped).unlink()
    result = cross_check_journals(sorted(run.files.values()), run.roster)
    assert result.ok and result.outside == 16 and result.matched == 16


def test_a_tampered_entry_fails_naming_the_line(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    path = sorted(run.files.values())[1]
    lines = path.read_bytes().splitlines()
    i = next(n for n, line in enumerate(lines) if b'"peer_received"' in line)
    doc = msgspec.json.decode(lines[i])
    doc["body"]["sha256"] = "0" * 64  # canonical still, but the chain no longer holds
    lines[i] = msgspec.json.encode(doc)  # msgspec keeps the key order: sorted as written
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert run.check() == f"{path}: journal line {i + 1}: the chain breaks here"


def test_a_dropped_entry_fails(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    path = sorted(run.files.values())[2]
    lines = path.read_bytes().splitlines()
    del lines[3]
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert run.check() == f"{path}: journal line 3: the chain breaks here"


def test_a_receipt_dropped_and_re_signed_by_its_member_fails_naming_the_message(
    honest: Honest, tmp_path: Path
) -> None:
    run = _run(honest, tmp_path)
    key = sorted(run.files)[0]
    i, gone = next((n, b) for n, b in enumerate(run.bodies(key)) if isinstance(b, PeerReceived))
    run.rewrite(key, lambda bodies: bodies[:i] + bodies[i + 1 :])
    problem = run.check()
    assert problem is not None
    assert problem.endswith(f"as sent to {key}, but {run.files[key]} has no receipt of it")
    assert f"logs round {gone.round} exchange {gone.exchange} (sha256 {gone.sha256[:16]}" in problem


def test_a_message_received_with_another_digest_fails(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    key = sorted(run.files)[1]
    bodies = run.bodies(key)
    i = next(n for n, b in enumerate(bodies) if isinstance(b, PeerReceived))
    changed = msgspec.structs.replace(bodies[i], sha256="ab" * 32)
    run.rewrite(key, lambda bs: [changed if n == i else b for n, b in enumerate(bs)])
    problem = run.check()
    assert problem is not None
    assert problem.endswith(
        f"as sent to {key}, but {run.files[key]} logs it received with another digest, "
        f"sha256 {'ab' * 8}…"
    )


def test_a_receipt_its_sender_does_not_log_fails(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    key = sorted(run.files)[2]
    i = next(n for n, b in enumerate(run.bodies(key)) if isinstance(b, PeerSent))
    run.rewrite(key, lambda bodies: bodies[:i] + bodies[i + 1 :])
    problem = run.check()
    assert problem is not None
    assert problem.endswith(f"from {key}, but {run.files[key]} does not log sending it")


def test_a_catch_up_from_an_offer_never_sent_fails(honest: Honest, tmp_path: Path) -> None:
    run = _run(honest, tmp_path)
    key, source = sorted(run.files)[:2]
    forged = PeerCaughtUp(round=5, sources=[source], sha256=["cd" * 32], model_sha256="0" * 64)
    run.rewrite(key, lambda bodies: [*bodies, forged])
    problem = run.check()
    assert problem is not None and "caught up at round 5 from" in problem
    assert problem.endswith(
        f"which {run.files[source]} does not log offering to {key} for that request"
    )


def test_a_catch_up_from_a_sent_model_its_source_never_offered_fails(
    honest: Honest, tmp_path: Path
) -> None:
    """The digest is a trained message the source did send to this member, but the source
    never journalled offering it (to this member, for this request): the catch-up is not
    backed by the source's record."""
    run = _run(honest, tmp_path)
    source = sorted(run.files)[0]
    sent = next(b for b in run.bodies(source) if isinstance(b, PeerSent) and b.exchange == 0)
    key = sent.to
    forged = PeerCaughtUp(
        round=5, sources=[source], sha256=[sent.sha256], model_sha256="0" * 64, nonce="ab" * 32
    )
    run.rewrite(key, lambda bodies: [*bodies, forged])
    problem = run.check()
    assert problem is not None and "caught up at round 5 from" in problem
    assert problem.endswith(f"does not log offering to {key} for that request")


def test_a_journal_with_an_unsigned_tail_or_an_unknown_signer_fails(
    honest: Honest, tmp_path: Path
) -> None:
    run = _run(honest, tmp_path)
    key = sorted(run.files)[0]
    path, original = run.files[key], run.files[key].read_bytes()
    lines = original.splitlines()
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n")  # its one head dropped
    assert run.check() == f"{path}: the journal holds no signed head"
    journal = PeerJournal(FED, run.ids[key])
    for body in run.bodies_of(original):
        journal.append(body)
    journal.head()
    journal.append(PeerCaughtUp(round=9, sources=[], sha256=[], model_sha256="0" * 64))
    path.write_bytes(b"".join(e.line + b"\n" for e in journal.entries))
    head = len(lines) - 1  # where the head is, in the rewrite as in the original
    tail = f"1 entries after the last head (line {head}) are not signed by the peer"
    assert run.check() == f"{path}: {tail}"
    path.write_bytes(original)
    stranger = SigningIdentity.generate()
    result = cross_check_journals([path], {stranger.key_id: stranger.public_bytes})
    assert result.problem is not None and "signed by no key given" in result.problem


def _run(honest: Honest, tmp_path: Path) -> Run:
    files = {}
    for n, (key, data) in enumerate(sorted(honest.journals.items())):
        files[key] = tmp_path / f"peer{n}.jsonl"
        files[key].write_bytes(data)
    return Run(honest.ids, files)
