"""The auditor's side of proof-of-honest-training: draw challenges, open reveals.

1. After rounds close, :func:`draw_challenges` reads the transparency log and, for
   each closed round attempt, takes the first signed head written after it as the
   beacon; the members selected by ``challenged(survivors, round, beacon, rate)``
   are challenged.  Nobody could know the beacon before the round closed.
2. Members answer with their quantized update and salt sealed to the auditor's
   key.  :func:`open_reveal_checked` opens one and checks it against the
   commitment the member signed in its contribution statement (from the log), so
   a member cannot reveal anything but what it committed to.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from fedsec.audit.log import read_log
from fedsec.crypto.commitment import (
    CommitmentContext,
    challenged,
    open_reveal,
    verify_commitment,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import ring_dtype
from fedsec.errors import IntegrityError
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.log_entries import AcceptedEntry, AggregateEntry, HeadEntry


@dataclass(frozen=True)
class ClosedRound:
    spec: wire.RoundSpec
    survivors: list[str]
    beacon_index: int | None
    beacon: bytes | None
    parent_version: int
    commitments: dict[str, str]  # member -> commitment hex (from its signed statement)


def closed_rounds(log_path: Path) -> dict[tuple[int, int], ClosedRound]:
    """Every closed round attempt in the log, with its beacon (None until a head follows)."""
    specs: dict[tuple[int, int], wire.RoundSpec] = {}
    commitments: dict[tuple[int, int], dict[str, str]] = {}
    out: dict[tuple[int, int], ClosedRound] = {}
    waiting: list[tuple[int, int]] = []
    for entry in read_log(log_path):
        match entry.decode():
            case wire.RoundSpec() as spec:
                specs[(spec.round, spec.attempt)] = spec
            case AcceptedEntry(stage="masked_input", commitment=str(commitment)) as accepted:
                key = (accepted.round, accepted.attempt)
                commitments.setdefault(key, {})[accepted.member] = commitment
            case AggregateEntry() as aggregate:
                key = (aggregate.round, aggregate.attempt)
                out[key] = ClosedRound(
                    specs[key],
                    list(aggregate.survivors),
                    None,
                    None,
                    aggregate.parent_version,
                    commitments.get(key, {}),
                )
                waiting.append(key)
            case HeadEntry():
                beacon = hashlib.sha256(entry.line).digest()
                for key in waiting:
                    r = out[key]
                    out[key] = ClosedRound(
                        r.spec, r.survivors, entry.index, beacon, r.parent_version, r.commitments
                    )
                waiting = []
    return out


def draw_challenges(
    log_path: Path, rate: float, rounds: set[int] | None = None
) -> list[wire.ChallengeRequest]:
    """The challenges the log's beacons select at ``rate`` (optionally only some rounds).

    Distributed-DP rounds are never challenged: a revealed update carries only its
    member's share of the noise, so opening it to the auditor would spend far more of
    the member's privacy than the round's ε accounts for (docs/privacy.md)."""
    requests = []
    for (r, a), closed in sorted(closed_rounds(log_path).items()):
        if closed.beacon is None or closed.beacon_index is None:
            continue
        if is_distributed(closed.spec):
            continue
        if rounds is not None and r not in rounds:
            continue
        for member in challenged(closed.survivors, r, closed.beacon, rate):
            requests.append(wire.ChallengeRequest(r, a, member, closed.beacon_index, rate))
    return requests


@dataclass(frozen=True)
class OpenedReveal:
    round: int
    attempt: int
    member: str
    quantized: npt.NDArray[np.unsignedinteger]
    spec: wire.RoundSpec
    parent_version: int
    info: dict[str, Any]


def open_reveal_checked(
    auditor: SigningIdentity,
    reveal: wire.Reveal,
    rounds: dict[tuple[int, int], ClosedRound],
) -> OpenedReveal:
    """Open ``reveal`` and check it against the member's logged commitment.

    Raises:
        DecryptionError: not sealed to this auditor's key.
        IntegrityError: it names another member or round, or does not open the
            commitment the member signed.
    """
    sealed = bytes.fromhex(reveal.sealed)
    payload = msgspec.json.decode(
        open_reveal(auditor.x25519_secret(), sealed), type=wire.RevealPayload
    )
    if (payload.member, payload.round, payload.attempt) != (
        reveal.member,
        reveal.round,
        reveal.attempt,
    ):
        raise IntegrityError(
            f"reveal from {reveal.member} for round {reveal.round} opens to "
            f"{payload.member}'s round {payload.round}"
        )
    closed = rounds.get((reveal.round, reveal.attempt))
    if closed is None or reveal.member not in closed.commitments:
        raise IntegrityError(
            f"the log holds no contribution of {reveal.member} to round {reveal.round}"
        )
    spec = closed.spec
    quantized = np.frombuffer(bytes.fromhex(payload.update), dtype=ring_dtype(spec.ring_bits))
    verify_commitment(
        bytes.fromhex(closed.commitments[reveal.member]),
        quantized,
        bytes.fromhex(payload.salt),
        CommitmentContext(
            spec.federation_id, reveal.round, reveal.attempt, reveal.member, spec.ring_bits
        ),
    )
    length = codec_for(spec).length
    if quantized.size != length:
        raise IntegrityError(
            f"revealed update of {reveal.member} has {quantized.size} elements, "
            f"the round's codec encodes {length - 1} (+1 weight)"
        )
    return OpenedReveal(
        reveal.round, reveal.attempt, reveal.member, quantized, spec, closed.parent_version, {}
    )
