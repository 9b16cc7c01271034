"""The sum of a round attempt, re-computed from its archived messages: the one place
the auditor computes a sum.

:func:`replay` re-runs an attempt's summation from its messages in log order: a
SecAgg+ round through the same server state machine the aggregator runs (fed by
:func:`fedsec.protocol.replay.feed_accepted`, the routine crash resume uses), a
trusted-mode round by adding the decoded updates or re-applying the signed spec's
robust rule (:mod:`fedsec.learning.robust`).  A homomorphic round's ciphertexts are
re-added by :func:`ciphertext_sum` and its decrypted plaintext read as a ring sum by
:func:`plaintext_sums`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsec.crypto.quantize import ring_from_integers, unpack
from fedsec.crypto.secagg import ServerSession
from fedsec.errors import BadVector, FedsecError, IntegrityError
from fedsec.learning import robust
from fedsec.protocol import wire
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.stages import SECAGG_STAGES
from fedsec.protocol.update_codec import codec_for

if TYPE_CHECKING:
    from fedsec.crypto import he

#: An attempt's accepted messages in log order: (stage, member, archive sha256).
Messages = Sequence[tuple[str, str, str]]
#: Reads an archived object by its sha256.
Read = Callable[[str], bytes]


@dataclass(frozen=True)
class Replayed:
    """An attempt's sum as its messages give it."""

    survivors: list[str]
    total: bytes  # what the aggregate's sum_sha256 hashes
    sums: tuple[Any, float]  # (Σ w·Δ, Σ w)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.total).hexdigest()


def replay(
    spec: wire.RoundSpec, messages: Messages, read: Read, keys: dict[str, bytes]
) -> Replayed:
    """The sum of the attempt of ``spec`` from its accepted ``messages``; ``keys``:
    each cohort member's roster key when the spec was signed.

    Raises:
        FedsecError, msgspec.DecodeError: an archived message is missing, altered or
            no longer verifies, or an update the aggregator must have refused.
    """
    return _REPLAYS[spec.secure_sum](spec, messages, read, keys)


def _secagg(
    spec: wire.RoundSpec, messages: Messages, read: Read, keys: dict[str, bytes]
) -> Replayed:
    # a round logged before the consistency stage existed carries no graph commitments
    # (both came in one protocol change); its unmask followed masked input directly
    legacy = not spec.graph_commitments
    session = ServerSession(spec.secagg_params(), keys, consistency=not legacy)
    order = tuple(s for s in SECAGG_STAGES if not (legacy and s == "consistency"))
    current = 0
    for stage, member, digest in messages:
        target = order.index(stage)
        while current < target:
            _close(session, order[current])
            current += 1
        feed_accepted(session, stage, member, read(digest))
    while current < len(order) - 1:
        _close(session, order[current])
        current += 1
    result = session.finalize()
    decoded = codec_for(spec).decode_sum(result.ring_sum, len(result.survivors))
    return Replayed(list(result.survivors), result.ring_sum.tobytes(), decoded)


def _close(session: ServerSession, stage: str) -> None:
    closers = {
        "advertise": session.close_advertise,
        "share_keys": session.close_share_keys,
        "masked_input": session.close_masked_input,
        "consistency": session.close_consistency,
    }
    closers[stage]()


def _trusted(
    spec: wire.RoundSpec, messages: Messages, read: Read, keys: dict[str, bytes]
) -> Replayed:
    if spec.aggregation is not None:
        return _rule(spec, spec.aggregation, messages, read)
    encoding = codec_for(spec)
    plain = np.zeros(spec.dim, dtype=np.float64)
    weights = 0.0
    members = []
    for stage, member, digest in messages:
        if stage != "masked_input":
            continue
        vector = unpack(read(digest), encoding.length, spec.ring_bits)
        update, w = encoding.decode_one(vector)
        plain += update
        weights += w
        members.append(member)
    return Replayed(members, plain.astype("<f8").tobytes(), (plain, weights))


def trusted_inputs(spec: wire.RoundSpec, messages: Messages, read: Read) -> list[tuple[str, Any]]:
    """(member, ring vector) of each archived masked input, in member order (the order
    the aggregator's session applies a rule in).

    Raises:
        IntegrityError: an update the aggregator must have refused.
    """
    encoding = codec_for(spec)
    inputs = []
    masked = sorted((m, d) for stage, m, d in messages if stage == "masked_input")
    for member, digest in masked:
        vector = unpack(read(digest), encoding.length, spec.ring_bits)
        try:
            encoding.check_input(vector)
        except BadVector as exc:
            raise IntegrityError(
                f"round {spec.round}: the archived update of {member} has {exc.detail}, "
                "which the aggregator must have refused"
            ) from None
        inputs.append((member, vector))
    return inputs


def _rule(
    spec: wire.RoundSpec, rule: wire.AggregationSpec, messages: Messages, read: Read
) -> Replayed:
    """The signed spec's rule re-applied to the archived updates, as the aggregator's
    session applies it (:func:`fedsec.learning.robust.aggregate`), bit for bit."""
    encoding = codec_for(spec)
    inputs = trusted_inputs(spec, messages, read)
    rows = [encoding.decode_one(vector) for _, vector in inputs]
    weights = np.array([w for _, w in rows])
    result = robust.aggregate(rule, np.stack([u for u, _ in rows]), weights)
    weighted, weight = robust.as_weighted_sum(result, weights)
    survivors = [inputs[i][0] for i in result.accepted]
    return Replayed(survivors, weighted.astype("<f8").tobytes(), (weighted, weight))


_REPLAYS: dict[str, Callable[[wire.RoundSpec, Messages, Read, dict[str, bytes]], Replayed]] = {
    "secagg": _secagg,
    "none": _trusted,
}


def ciphertext_sum(
    public: he.PublicContext,
    params: he.HeParams,
    values: int,
    ciphertexts: Iterable[tuple[str, bytes]],
) -> he.CiphertextSum:
    """The homomorphic sum of framed ``ciphertexts`` (whose, bytes), as the custodian
    adds them.

    Raises:
        IntegrityError: a ciphertext does not add under the context (it is named).
    """
    from fedsec.crypto import he

    total = he.CiphertextSum(public, params, values)
    for whose, raw in ciphertexts:
        try:
            total.add(he.unframe_chunks(raw, params, values))
        except FedsecError as exc:
            raise IntegrityError(
                f"the archived ciphertext of {whose} does not add under the federation's "
                f"context: {exc.detail}"
            ) from None
    return total


def plaintext_sums(spec: wire.RoundSpec, plaintext: bytes, contributors: int) -> tuple[str, Any]:
    """(sha256 of the ring sum, (Σ w·Δ, Σ w)) of a decrypted integer sum (``<i8``)."""
    ints = np.frombuffer(plaintext, dtype="<i8")
    # (ints & ring_mask) as the ring's dtype, as the aggregator turns it into a ring sum
    # (bit for bit the same for any int64, negative ones and a 64-bit ring included)
    ring = ring_from_integers(ints, spec.quant_spec())
    sums = codec_for(spec).decode_sum(ring, contributors)
    return hashlib.sha256(ring.tobytes()).hexdigest(), sums
