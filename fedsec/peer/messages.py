"""The one message peers exchange: a member's round, as the model it started from and
the update its local training made (the round's first exchange), or as the model it has
mixed so far (each further exchange of the round: ``update`` is empty).

Both halves travel because models drift apart between peers: the update alone says which
way the member's training went (what a neighbour's direction filter judges), the start
says where from (what averaging pulls the neighbour towards, bounded by the receiver,
:mod:`fedsec.peer.gossip`).

The message names the federation, the round and the sender, and travels signed (RFC 9421,
:mod:`fedsec.crypto.httpsig`) over a path that names federation and round again; the
receiver checks every binding before it keeps anything.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import numpy.typing as npt

from fedsec.errors import BadVector, PayloadError
from fedsec.peer.limits import MAX_EXCHANGES, MAX_FEDERATION_ID, max_message_bytes
from fedsec.protocol import body
from fedsec.protocol.limits import MAX_COUNT, MAX_ID

Vector = npt.NDArray[np.float64]
#: The wire's float format: float32 little-endian, as model files hold parameters.
WIRE_DTYPE = np.dtype("<f4")
CONTENT_TYPE = "application/msgpack"


class PeerModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A member's round ``round``: the model it started from and the update its local
    training on ``samples`` records made (the samples are its weight in the neighbours'
    averages).  Both vectors are WIRE_DTYPE, one value per model parameter; in an
    ``exchange`` after the round's first, ``start`` is the sender's mixed model and
    ``update`` is empty."""

    federation_id: str
    round: int
    sender: str  # the sender's key id, as its signature names it
    samples: int
    start: bytes
    update: bytes
    exchange: int = 0

    def start_vector(self) -> Vector:
        return np.frombuffer(self.start, dtype=WIRE_DTYPE).astype(np.float64)

    def update_vector(self) -> Vector:
        return np.frombuffer(self.update, dtype=WIRE_DTYPE).astype(np.float64)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(encode(self)).hexdigest()


def make_model(
    federation_id: str, round_: int, sender: str, samples: int, start: Vector, update: Vector
) -> PeerModel:
    """The message carrying a round that started from ``start`` and trained ``update``.

    Raises:
        BadVector: a NaN or an infinity in either vector.
    """
    a, b = np.asarray(start, dtype=WIRE_DTYPE), np.asarray(update, dtype=WIRE_DTYPE)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise BadVector("a model holding NaN or an infinity is never sent")
    return PeerModel(federation_id, round_, sender, samples, a.tobytes(), b.tobytes())


def make_mix(
    federation_id: str, round_: int, exchange: int, sender: str, samples: int, model: Vector
) -> PeerModel:
    """The message carrying the model a sender has mixed by exchange ``exchange`` (≥ 1).

    Raises:
        BadVector: a NaN or an infinity in ``model``.
    """
    a = np.asarray(model, dtype=WIRE_DTYPE)
    if not np.all(np.isfinite(a)):
        raise BadVector("a model holding NaN or an infinity is never sent")
    return PeerModel(federation_id, round_, sender, samples, a.tobytes(), b"", exchange)


def encode(message: PeerModel) -> bytes:
    return msgspec.msgpack.encode(message)


def decode(raw: bytes, values: int) -> PeerModel:
    """A peer's message from ``raw``, for a model of ``values`` parameters: its size is
    checked before it is parsed, every field's range and both vectors' lengths and
    finiteness before it is returned.

    Raises:
        PayloadTooLarge: ``raw`` is longer than any message of ``values`` parameters.
        PayloadError: not a model message, or a field out of range.
        BadVector: a vector of the wrong length, or a NaN or an infinity in one.
    """
    message = body.decode_msgpack(
        raw, PeerModel, max_bytes=max_message_bytes(values), what="a peer model message"
    )
    if not 0 < len(message.federation_id) <= MAX_FEDERATION_ID:
        raise PayloadError(f"federation id must be 1..{MAX_FEDERATION_ID} characters")
    if not 0 <= message.round <= MAX_ID:
        raise PayloadError(f"round {message.round} is outside 0..{MAX_ID}")
    if not 1 <= message.samples <= MAX_COUNT:
        raise PayloadError(f"samples {message.samples} is outside 1..{MAX_COUNT}")
    if not 0 <= message.exchange < MAX_EXCHANGES:
        raise PayloadError(f"exchange {message.exchange} is outside 0..{MAX_EXCHANGES - 1}")
    _check_vector("start", message.start, values)
    if message.exchange == 0:
        _check_vector("update", message.update, values)
    elif message.update:
        raise BadVector("a mixing exchange carries no update")
    return message


def _check_vector(name: str, data: bytes, values: int) -> None:
    if len(data) != values * WIRE_DTYPE.itemsize:
        raise BadVector(
            f"the {name} holds {len(data) / WIRE_DTYPE.itemsize:g} values, "
            f"the federation's model {values}"
        )
    vector = np.frombuffer(data, dtype=WIRE_DTYPE)
    if not np.all(np.isfinite(vector)):
        bad = int(np.count_nonzero(~np.isfinite(vector)))
        raise BadVector(f"the {name} holds {bad} values that are NaN or infinite")
