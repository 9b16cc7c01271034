"""Relaying audit challenges and sealed reveals between auditors and members.

The aggregator only checks and relays: a challenge must name a member that
contributed to a closed round attempt and must follow from a signed log head
written after that round closed (so it was drawn from a beacon nobody knew in
advance); a reveal must answer an open challenge.  Reveals are sealed to the
auditor's key: the aggregator stores and logs ciphertext it cannot read.
"""

from __future__ import annotations

import hashlib

import msgspec

from fedsec.aggregator.storage.audit_trail import AuditTrail
from fedsec.aggregator.workspace import Workspace
from fedsec.crypto.commitment import challenged
from fedsec.errors import DuplicateMessage, NotFound, PayloadError, PayloadTooLarge
from fedsec.protocol import wire
from fedsec.protocol.log import LogEntry, entry_from_line
from fedsec.protocol.log_entries import (
    AggregateEntry,
    ChallengeEntry,
    HeadEntry,
    RevealEntry,
    kind_of,
)

# A reveal holds one quantized update (≤ 8 bytes per parameter) plus framing, hex-encoded;
# 256 MiB bounds it for models up to ~16M parameters.
MAX_SEALED_BYTES = 256 << 20


class ChallengeDesk:
    def __init__(self, ws: Workspace, trail: AuditTrail) -> None:
        self.ws = ws
        self.trail = trail

    def _log(self) -> list[LogEntry]:
        return [entry_from_line(line) for _, line in self.ws.state.log.log_lines()]

    def challenge(self, auditor: str, req: wire.ChallengeRequest) -> wire.Challenge:
        """Record a challenge after checking it is well drawn.

        Raises:
            NotFound: the round attempt did not close, or the member did not contribute.
            PayloadError: the beacon is not a head after the round, or does not select
                this member at this rate.
            DuplicateMessage: this auditor already challenged this member and round.
        """
        entries = self._log()
        closed_at, aggregate = _closed_aggregate(entries, req)
        beacon = self._beacon(entries, req, closed_at, aggregate)
        if self.ws.state.challenges.get(req.round, req.attempt, req.member, auditor) is not None:
            raise DuplicateMessage(f"{auditor} already challenged {req.member} for this round")
        with self.ws.state.transaction():
            logged = ChallengeEntry(
                round=req.round,
                attempt=req.attempt,
                member=req.member,
                auditor=auditor,
                beacon_index=req.beacon_index,
                beacon=beacon.hex(),
                rate=req.rate,
            )
            entry = self.trail.append(logged)
            result = wire.Challenge(**msgspec.structs.asdict(logged), log_index=entry.index)
            self.ws.state.challenges.add(
                req.round, req.attempt, req.member, auditor, wire.encode(result)
            )
        return result

    def _beacon(
        self,
        entries: list[LogEntry],
        req: wire.ChallengeRequest,
        closed_at: int,
        aggregate: AggregateEntry,
    ) -> bytes:
        """The hash of the signed head the challenge draws from, checked to select the
        member.

        Raises:
            PayloadError: no such entry, not a head written after the round, or the draw
                does not select this member at this rate.
        """
        if not 0 <= req.beacon_index < len(entries):
            raise PayloadError(f"no log entry {req.beacon_index} to use as beacon")
        head = entries[req.beacon_index]
        if head.kind != kind_of(HeadEntry) or req.beacon_index <= closed_at:
            raise PayloadError(
                f"log entry {req.beacon_index} is not a signed head written after round "
                f"{req.round} closed"
            )
        beacon = hashlib.sha256(head.line).digest()
        if req.member not in challenged(aggregate.survivors, req.round, beacon, req.rate):
            raise PayloadError(
                f"the beacon of entry {req.beacon_index} does not select {req.member} for "
                f"round {req.round} at rate {req.rate}"
            )
        return beacon

    def open_for(self, member: str) -> wire.ChallengeList:
        return wire.ChallengeList(
            challenges=[
                msgspec.json.decode(b, type=wire.Challenge)
                for b in self.ws.state.challenges.open_for(member)
            ]
        )

    def reveal(self, member: str, body: wire.RevealBody) -> wire.Reveal:
        """Store and log a sealed reveal answering an open challenge.

        Raises:
            NotFound: no such challenge.  DuplicateMessage: already answered.
            PayloadTooLarge / PayloadError: oversized or not hex.
        """
        if len(body.sealed) > 2 * MAX_SEALED_BYTES:
            raise PayloadTooLarge(f"sealed reveal exceeds {MAX_SEALED_BYTES} bytes")
        sealed = wire.unhex(body.sealed, "sealed reveal")
        if self.ws.state.challenges.get(body.round, body.attempt, member, body.auditor) is None:
            raise NotFound(
                f"{body.auditor} has not challenged {member} for round {body.round} "
                f"attempt {body.attempt}"
            )
        if any(
            r.member == member and (r.round, r.attempt) == (body.round, body.attempt)
            for r in self.reveals_for(body.auditor).reveals
        ):
            raise DuplicateMessage(f"{member} already answered this challenge")
        digest = self.trail.keep(sealed)
        with self.ws.state.transaction():
            entry = self.trail.append(
                RevealEntry(
                    round=body.round,
                    attempt=body.attempt,
                    member=member,
                    auditor=body.auditor,
                    sha256=digest,
                    bytes=len(sealed),
                )
            )
            result = wire.Reveal(
                round=body.round,
                attempt=body.attempt,
                member=member,
                auditor=body.auditor,
                sealed=body.sealed,
                log_index=entry.index,
            )
            self.ws.state.challenges.add_reveal(
                body.round, body.attempt, member, body.auditor, wire.encode(result)
            )
        return result

    def reveals_for(self, auditor: str) -> wire.RevealList:
        return wire.RevealList(
            reveals=[
                msgspec.json.decode(b, type=wire.Reveal)
                for b in self.ws.state.challenges.reveals_for(auditor)
            ]
        )


def _closed_aggregate(
    entries: list[LogEntry], req: wire.ChallengeRequest
) -> tuple[int, AggregateEntry]:
    """The ``aggregate`` entry of the challenged attempt (its index and body), with the
    member among its survivors.

    Raises:
        NotFound: the attempt did not close, or the member contributed nothing to it.
    """
    kind = kind_of(AggregateEntry)
    aggregate = next(
        (
            (e.index, body)
            for e in entries
            if e.kind == kind
            and isinstance(body := e.decode(), AggregateEntry)
            and (body.round, body.attempt) == (req.round, req.attempt)
        ),
        None,
    )
    if aggregate is None:
        raise NotFound(f"round {req.round} attempt {req.attempt} has not closed")
    if req.member not in aggregate[1].survivors:
        raise NotFound(f"{req.member} contributed nothing to round {req.round}")
    return aggregate
