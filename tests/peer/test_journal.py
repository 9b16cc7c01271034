"""A peer's journal file: a restarted peer continues its chain, and refuses a file that
was altered while it was away."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError
from fedsec.peer.journal import PeerJournal, verify_journal
from fedsec.protocol.peer_journal import PeerSent

FED = "fed-journal"


def _sent(round_: int) -> PeerSent:
    return PeerSent(round=round_, to="ed25519:" + "0" * 32, sha256="ab" * 32)


def test_a_restarted_peer_continues_its_chain(tmp_path: Path) -> None:
    me, path = SigningIdentity.generate(), tmp_path / "journal.jsonl"
    first = PeerJournal.resume(FED, me, path)
    first.append(_sent(0))
    first.head()
    again = PeerJournal.resume(FED, me, path)
    again.append(_sent(1))
    again.head()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 4 and verify_journal(lines, me.public_bytes, FED) == 2


def test_a_journal_altered_while_the_peer_was_away_is_refused(tmp_path: Path) -> None:
    me, path = SigningIdentity.generate(), tmp_path / "journal.jsonl"
    journal = PeerJournal.resume(FED, me, path)
    journal.append(_sent(0))
    journal.head()
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"round":0', b'"round":7'))
    with pytest.raises(IntegrityError, match="journal line 1"):
        PeerJournal.resume(FED, me, path)
    path.write_bytes(original)
    with pytest.raises(IntegrityError, match="head"):
        PeerJournal.resume(FED, SigningIdentity.generate(), path)  # another key's file


def test_a_line_cut_short_by_a_crash_is_dropped_and_the_chain_continues(tmp_path: Path) -> None:
    me, path = SigningIdentity.generate(), tmp_path / "journal.jsonl"
    journal = PeerJournal.resume(FED, me, path)
    journal.append(_sent(0))
    whole = path.read_bytes()
    journal.append(_sent(1))
    path.write_bytes(path.read_bytes()[: len(whole) + 40])  # the second line half written
    again = PeerJournal.resume(FED, me, path)
    assert path.read_bytes() == whole and len(again.entries) == 1
    again.append(_sent(1))
    again.head()
    assert verify_journal(path.read_bytes().splitlines(), me.public_bytes, FED) == 1
