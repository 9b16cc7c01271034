"""Mask derivation shared by members and server.

Self mask: PRG(b_i) with b_i a member's fresh 32-byte seed.  Pairwise mask
between i and j: PRG(seed_ij) where seed_ij is derived from the X25519
agreement of their mask keys and the round digest, added by the member whose id
sorts first and subtracted by the other, so each pair cancels in the sum.
"""

from __future__ import annotations

import threading

import numpy as np

from fedsec.crypto import prg
from fedsec.crypto.envelope import shared_key
from fedsec.crypto.quantize import RingVector
from fedsec.crypto.secagg.messages import SecAggParams

_SELF = b"secagg/self-mask"
_PAIR = b"secagg/pair-mask"
SHARE_PURPOSE = "secagg-share"


def self_mask(seed: bytes, params: SecAggParams) -> RingVector:
    return prg.expand(seed, _SELF, params.vector_length, params.quant.dtype)


def pair_seed(mask_secret: bytes, peer_mask_public: bytes, params: SecAggParams) -> bytes:
    """Seed of the pairwise mask, identical for both ends of the pair."""
    return prg.derive_key(shared_key(mask_secret, peer_mask_public), b"pair/" + params.digest())


def pair_mask(seed: bytes, params: SecAggParams) -> RingVector:
    return prg.expand(seed, _PAIR, params.vector_length, params.quant.dtype)


def adds_pair_mask(member: str, peer: str) -> bool:
    """True when ``member`` adds the pair's mask (its id sorts first), False when it subtracts."""
    return member < peer


def apply(acc: RingVector, mask: RingVector, add: bool) -> None:
    """acc ± mask in place, wrapping modulo 2^(dtype bits)."""
    if add:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)


# One mask-sized buffer per thread, reused for every mask it applies: a fresh array per
# mask (what expand returns) is a fresh mapping whose pages fault in on first write, which
# at d = 1M and ~140 masks a round cost the server 10-40 % of the mask time, depending on
# the allocator's state.
_scratch = threading.local()


def _buffer(params: SecAggParams) -> RingVector:
    buf: RingVector | None = getattr(_scratch, "buf", None)
    if buf is None or buf.size != params.vector_length or buf.dtype != params.quant.dtype:
        buf = np.empty(params.vector_length, dtype=params.quant.dtype)
        _scratch.buf = buf
    return buf


def release_buffer() -> None:
    """Drop this thread's mask buffer: the server's unmasking is the last mask of its
    round, and the buffer (2 bytes a coordinate at 9 to 16 ring bits: 19 MiB at 11M)
    would otherwise stay allocated through the model's application, the round's peak."""
    _scratch.__dict__.pop("buf", None)


def apply_self_mask(acc: RingVector, seed: bytes, params: SecAggParams, add: bool) -> None:
    """acc ± :func:`self_mask` (seed) in place, drawn into a reused buffer.

    Raises:
        ValueError: ``seed`` is not 32 bytes.
    """
    buf = _buffer(params)
    prg.expand_into(seed, _SELF, buf)
    apply(acc, buf, add)


def apply_pair_mask(acc: RingVector, seed: bytes, params: SecAggParams, add: bool) -> None:
    """acc ± :func:`pair_mask` (seed) in place, drawn into a reused buffer.

    Raises:
        ValueError: ``seed`` is not 32 bytes.
    """
    buf = _buffer(params)
    prg.expand_into(seed, _PAIR, buf)
    apply(acc, buf, add)
