"""The one message peers exchange: a member's model after its local training of a round.

A peer sends its trained model, not its update: models drift apart between peers, so an
update is only meaningful against the model it was trained from, and the receiver forms
the neighbour's update against its own round start (:mod:`fedsec.peer.gossip`).

The message names the federation, the round and the sender, and travels signed (RFC 9421,
:mod:`fedsec.crypto.httpsig`) over a path that names federation and round again; the
receiver checks every binding before it keeps anything.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import numpy.typing as npt

from fedsec.errors import BadVector, PayloadError, PayloadTooLarge
from fedsec.peer.limits import MAX_FEDERATION_ID, max_message_bytes
from fedsec.protocol.limits import MAX_COUNT, MAX_ID

Vector = npt.NDArray[np.float64]
#: The wire's float format: float32 little-endian, as model files hold parameters.
WIRE_DTYPE = np.dtype("<f4")
CONTENT_TYPE = "application/msgpack"


class PeerModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A member's model after round ``round``'s local training, trained on ``samples``
    records (its weight in the neighbours' averages)."""

    federation_id: str
    round: int
    sender: str  # the sender's key id, as its signature names it
    samples: int
    values: bytes  # WIRE_DTYPE, one per model parameter

    def vector(self) -> Vector:
        return np.frombuffer(self.values, dtype=WIRE_DTYPE).astype(np.float64)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(encode(self)).hexdigest()


def make_model(
    federation_id: str, round_: int, sender: str, samples: int, model: Vector
) -> PeerModel:
    """The message carrying ``model``.

    Raises:
        BadVector: ``model`` holds a NaN or an infinity.
    """
    values = np.asarray(model, dtype=WIRE_DTYPE)
    if not np.all(np.isfinite(values)):
        raise BadVector("a model holding NaN or an infinity is never sent")
    return PeerModel(federation_id, round_, sender, samples, values.tobytes())


def encode(message: PeerModel) -> bytes:
    return msgspec.msgpack.encode(message)


def decode(raw: bytes, values: int) -> PeerModel:
    """A peer's message from ``raw``, for a model of ``values`` parameters: its size is
    checked before it is parsed, every field's range and the vector's length and
    finiteness before it is returned.

    Raises:
        PayloadTooLarge: ``raw`` is longer than any message of ``values`` parameters.
        PayloadError: not a model message, or a field out of range.
        BadVector: values of the wrong length, or a NaN or an infinity among them.
    """
    if len(raw) > max_message_bytes(values):
        raise PayloadTooLarge(
            f"a model message of {len(raw)} bytes is longer than any of {values} values"
        )
    try:
        message = msgspec.msgpack.decode(raw, type=PeerModel)
    except msgspec.DecodeError as exc:
        raise PayloadError(f"not a peer model message: {exc}") from None
    if not 0 < len(message.federation_id) <= MAX_FEDERATION_ID:
        raise PayloadError(f"federation id must be 1..{MAX_FEDERATION_ID} characters")
    if not 0 <= message.round <= MAX_ID:
        raise PayloadError(f"round {message.round} is outside 0..{MAX_ID}")
    if not 1 <= message.samples <= MAX_COUNT:
        raise PayloadError(f"samples {message.samples} is outside 1..{MAX_COUNT}")
    if len(message.values) != values * WIRE_DTYPE.itemsize:
        raise BadVector(
            f"the model holds {len(message.values) / WIRE_DTYPE.itemsize:g} values, "
            f"the federation's model {values}"
        )
    vector = np.frombuffer(message.values, dtype=WIRE_DTYPE)
    if not np.all(np.isfinite(vector)):
        bad = int(np.count_nonzero(~np.isfinite(vector)))
        raise BadVector(f"the model holds {bad} values that are NaN or infinite")
    return message
