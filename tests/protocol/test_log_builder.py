"""The in-memory log builder (fedsec.protocol.log_builder): what it builds is a log
every reader accepts, and a re-signed rewrite is one only an outside head tells apart."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest

from fedsec.audit.log import read_log
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError
from fedsec.protocol.log import LogEntry, verify_head
from fedsec.protocol.log_builder import START_TIME, LogBuilder, resign
from fedsec.protocol.log_entries import HeadEntry, RoundAbortedEntry, RoundOpenEntry

FED = "fed"


def _round(builder: LogBuilder) -> None:
    builder.append(RoundOpenEntry(round=1, attempt=0))
    builder.accept(1, 0, "masked_input", "alice", b"alice's vector")
    builder.accept(1, 0, "masked_input", "bob", b"bob's vector")
    builder.head()
    builder.append(RoundAbortedEntry(round=1, attempt=0, detail="too few members"))
    builder.head()


def _heads_verify(entries: list[LogEntry], key: bytes) -> None:
    for before, entry in itertools.pairwise(entries):
        body = entry.decode()
        if isinstance(body, HeadEntry):
            verify_head(body, key, before)


def test_a_built_log_reads_back_chained_with_every_head_valid(tmp_path: Path) -> None:
    aggregator = SigningIdentity.generate()
    builder = LogBuilder(FED, aggregator)
    _round(builder)
    path = tmp_path / "log.jsonl"
    path.write_bytes(builder.lines())
    read = list(read_log(path))
    assert [e.line for e in read] == [e.line for e in builder.entries]
    assert [e.time for e in read] == [START_TIME + i for i in range(len(read))]
    _heads_verify(read, aggregator.public_bytes)
    digest = hashlib.sha256(b"bob's vector").hexdigest()
    assert builder.archive[digest] == b"bob's vector"
    assert read[2].body["sha256"] == digest and read[2].body["bytes"] == 12


def test_the_same_bodies_give_the_same_bytes() -> None:
    key = SigningIdentity.generate()
    first, second = LogBuilder(FED, key), LogBuilder(FED, key)
    _round(first)
    _round(second)
    assert first.lines() == second.lines()


def test_a_head_signed_by_another_key_is_refused() -> None:
    aggregator = SigningIdentity.generate()
    builder = LogBuilder(FED, aggregator)
    builder.append(RoundOpenEntry(round=1, attempt=0))
    head = builder.head(SigningIdentity.generate())
    body = head.decode()
    assert isinstance(body, HeadEntry)
    with pytest.raises(IntegrityError, match="another key signed the head"):
        verify_head(body, aggregator.public_bytes, builder.entries[0])


def test_a_rewrite_re_signed_with_the_key_chains_and_verifies_again() -> None:
    aggregator = SigningIdentity.generate()
    builder = LogBuilder(FED, aggregator)
    _round(builder)
    original = list(builder.entries)
    forged = LogBuilder(FED, aggregator)
    forged.extend(e.decode() for e in original[:2])
    forged.accept(1, 0, "masked_input", "alice", b"another vector")  # index 2 changed
    rewritten = resign([*forged.entries, *original[3:]], 3, aggregator)
    assert [e.index for e in rewritten] == list(range(len(original)))
    assert all(b.prev == a.hash for a, b in itertools.pairwise(rewritten))
    _heads_verify(rewritten, aggregator.public_bytes)
    # only an earlier copy of a head tells: its hash no longer matches
    assert rewritten[4].hash != original[4].hash
    assert [e.time for e in rewritten] == [e.time for e in original]
