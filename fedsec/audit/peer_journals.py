"""Cross-check of several gossip peers' journals (``fedsec audit verify --peer-journal``).

Each journal must hold on its own: its chain, every body and every head, signed by one
member's key, with nothing after its last head (:func:`fedsec.protocol.peer_journal.read_journal`).
Then, for every two members whose journals are both given, what one logged as sent to
the other the other logged as received from it, and the other way round: the same round,
exchange and SHA-256 of the message, as many times on each side.  Every offer a member
rejoined from (``peer_caught_up``) must be one its source logged offering to that member
for that request (``peer_offer_sent``: requester, SHA-256 and nonce): the source journals
each offer before it leaves, so a catch-up its source never journalled is forged, or the
source hid the offer.
Messages to or from members whose journals are not given are counted, not checked.

A send whose answer was lost (the sender's timeout) is logged by the receiver only, and
fails the check as a receipt with no send: the auditor sees which message and can judge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedsec.errors import IntegrityError
from fedsec.protocol.peer_journal import (
    PeerCaughtUp,
    PeerOfferSent,
    PeerReceived,
    PeerSent,
    VerifiedJournal,
    read_journal,
)

#: (round, exchange, SHA-256) of one message between two members.
Message = tuple[int, int, str]


@dataclass(frozen=True)
class JournalCrossCheck:
    journals: int = 0
    entries: int = 0
    matched: int = 0  # messages logged on both sides
    outside: int = 0  # messages to or from members whose journals were not given
    catch_ups: int = 0  # catch-up sources matched with their sender's journal
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def journal_files(paths: Sequence[Path]) -> list[Path]:
    """The journal files of ``paths``: each file itself, each directory's ``*.jsonl``.

    Raises:
        IntegrityError: a path that does not exist.
    """
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(f for f in p.glob("*.jsonl") if f.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            raise IntegrityError(f"peer journal {p} does not exist")
    return files


def cross_check_journals(files: Sequence[Path], roster: Mapping[str, bytes]) -> JournalCrossCheck:
    """Check every journal in ``files`` and match them against each other; ``roster``
    maps each member's key id to its public key (each journal's owner is among them).

    Returns:
        The counts, and the first problem found (None when every check holds).
    """
    journals: dict[str, tuple[Path, VerifiedJournal]] = {}
    for path in files:
        try:
            journal = read_journal(path.read_bytes().splitlines(), roster)
        except (IntegrityError, OSError) as exc:
            return JournalCrossCheck(len(journals), problem=f"{path}: {exc}")
        if journal.owner in journals:
            other = journals[journal.owner][0]
            return JournalCrossCheck(
                len(journals), problem=f"{path} and {other} are both {journal.owner}'s journal"
            )
        first = next(iter(journals.values()), None)
        if first is not None and first[1].federation_id != journal.federation_id:
            return JournalCrossCheck(
                len(journals),
                problem=f"{path} is of federation {journal.federation_id!r}, "
                f"{first[0]} of {first[1].federation_id!r}",
            )
        journals[journal.owner] = (path, journal)
    return _match(
        {k: j for k, (_, j) in journals.items()}, {k: p for k, (p, _) in journals.items()}
    )


def _match(journals: Mapping[str, VerifiedJournal], paths: Mapping[str, Path]) -> JournalCrossCheck:
    sent: Counter[tuple[str, str, Message]] = Counter()
    received: Counter[tuple[str, str, Message]] = Counter()
    outside = 0
    for owner, journal in journals.items():
        for body in journal.bodies:
            if isinstance(body, PeerSent):
                if body.to in journals:
                    sent[owner, body.to, (body.round, body.exchange, body.sha256)] += 1
                else:
                    outside += 1
            elif isinstance(body, PeerReceived):
                if body.sender in journals:
                    received[body.sender, owner, (body.round, body.exchange, body.sha256)] += 1
                else:
                    outside += 1
    counts = JournalCrossCheck(
        journals=len(journals),
        entries=sum(j.lines for j in journals.values()),
        matched=sum((sent & received).values()),
        outside=outside,
    )
    problem = _unmatched(sent, received, paths) or _unmatched_catch_ups(journals, paths)
    if problem is not None:
        return JournalCrossCheck(**(asdict(counts) | {"problem": problem}))
    caught = sum(
        s in journals for j in journals.values() for b in _caught_ups(j) for s in b.sources
    )
    return JournalCrossCheck(**(asdict(counts) | {"catch_ups": caught}))


def _unmatched(
    sent: Counter[tuple[str, str, Message]],
    received: Counter[tuple[str, str, Message]],
    paths: Mapping[str, Path],
) -> str | None:
    for sender, to, (round_, exchange, digest) in sorted(sent - received):
        other = [
            m[2] for (s, t, m) in received if (s, t) == (sender, to) and m[:2] == (round_, exchange)
        ]
        what = f"round {round_} exchange {exchange} (sha256 {digest[:16]}…)"
        if other:
            return (
                f"{paths[sender]} logs {what} as sent to {to}, but {paths[to]} logs it "
                f"received with another digest, sha256 {other[0][:16]}…"
            )
        return f"{paths[sender]} logs {what} as sent to {to}, but {paths[to]} has no receipt of it"
    for sender, to, (round_, exchange, digest) in sorted(received - sent):
        what = f"round {round_} exchange {exchange} (sha256 {digest[:16]}…)"
        return (
            f"{paths[to]} logs {what} as received from {sender}, but {paths[sender]} does "
            "not log sending it"
        )
    return None


def _unmatched_catch_ups(
    journals: Mapping[str, VerifiedJournal], paths: Mapping[str, Path]
) -> str | None:
    offered = {
        owner: {(b.to, b.sha256, b.nonce) for b in j.bodies if isinstance(b, PeerOfferSent)}
        for owner, j in journals.items()
    }
    for owner, journal in journals.items():
        for body in _caught_ups(journal):
            if len(body.sources) != len(body.sha256):
                return f"{paths[owner]}: a catch-up at round {body.round} names unequal lists"
            for source, digest in zip(body.sources, body.sha256, strict=False):
                if source in journals and (owner, digest, body.nonce) not in offered[source]:
                    return (
                        f"{paths[owner]} caught up at round {body.round} from {source}'s "
                        f"offer (sha256 {digest[:16]}…), which {paths[source]} does not log "
                        f"offering to {owner} for that request"
                    )
    return None


def _caught_ups(journal: VerifiedJournal) -> list[PeerCaughtUp]:
    return [b for b in journal.bodies if isinstance(b, PeerCaughtUp)]
