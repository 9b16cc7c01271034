"""Cryptographic pseudo-random generator for masks and stochastic rounding.

AES-256 in counter mode (``cryptography``, AES-NI where the CPU has it, several
GB/s) over a zero buffer is the keystream.  The AES key is derived from the
32-byte seed with HKDF-SHA256 whose ``info`` names the use, so the same seed
used for two purposes yields independent streams.  Because each derived key
encrypts exactly one stream, a fixed all-zero counter block is safe.

numpy's generators are never used for anything an adversary could exploit.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEED_BYTES = 32
_ZERO_COUNTER = bytes(16)
# Zero buffers are reused across calls: allocating tens of MB per mask would
# cost as much as the cipher itself.
_zero_cache: dict[int, bytes] = {}
_ZERO_CACHE_MAX_BYTES = 1 << 28


def derive_key(seed: bytes, domain: bytes) -> bytes:
    """HKDF-SHA256(seed, info = b"fedsec/v1/prg/" + domain) -> 32-byte AES key."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedsec/v1/prg/" + domain
    ).derive(seed)


def _zeros(nbytes: int) -> bytes:
    buf = _zero_cache.get(nbytes)
    if buf is None:
        buf = bytes(nbytes)
        if nbytes <= _ZERO_CACHE_MAX_BYTES:
            if sum(len(b) for b in _zero_cache.values()) + nbytes > _ZERO_CACHE_MAX_BYTES:
                _zero_cache.clear()
            _zero_cache[nbytes] = buf
    return buf


def _encryptor(seed: bytes, domain: bytes) -> CipherContext:
    """The AES-256-CTR stream of ``(seed, domain)``, from its start."""
    return Cipher(algorithms.AES(derive_key(seed, domain)), modes.CTR(_ZERO_COUNTER)).encryptor()


def keystream(seed: bytes, domain: bytes, nbytes: int) -> bytes:
    """``nbytes`` of AES-256-CTR keystream for ``(seed, domain)``."""
    if nbytes < 0:
        raise ValueError("nbytes must be non-negative")
    return _encryptor(seed, domain).update(_zeros(nbytes))


def expand(
    seed: bytes, domain: bytes, count: int, dtype: npt.DTypeLike
) -> npt.NDArray[np.unsignedinteger]:
    """``count`` uniformly random unsigned integers of ``dtype`` (read-only array).

    Values are uniform over the whole dtype; reduce mod 2^m by masking, which
    stays uniform because 2^m divides the dtype's modulus.
    """
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise ValueError(f"expand needs an unsigned dtype, got {dt}")
    raw = keystream(seed, domain, count * dt.itemsize)
    return np.frombuffer(raw, dtype=dt.newbyteorder("<"), count=count)


def expand_blocks(
    seed: bytes, domain: bytes, count: int, dtype: npt.DTypeLike, block: int
) -> Iterator[npt.NDArray[np.unsignedinteger]]:
    """The values of :func:`expand` (seed, domain, count, dtype), ``block`` at a time
    (the last block shorter): one keystream, never held whole, for a caller whose
    memory must not grow with ``count``.

    Raises:
        ValueError: ``seed`` is not 32 bytes, a signed dtype, or ``block`` below 1.
    """
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise ValueError(f"expand_blocks needs an unsigned dtype, got {dt}")
    if block < 1:
        raise ValueError(f"a block must hold at least one value, got {block}")
    encryptor = _encryptor(seed, domain)
    for start in range(0, count, block):
        n = min(block, count - start)
        raw = encryptor.update(_zeros(n * dt.itemsize))
        yield np.frombuffer(raw, dtype=dt.newbyteorder("<"), count=n)


def expand_into(seed: bytes, domain: bytes, out: npt.NDArray[np.unsignedinteger]) -> None:
    """Fill ``out`` (a contiguous little-endian unsigned array) with the values
    :func:`expand` gives for ``out.size`` of its dtype: the same keystream, written in
    place, so a caller drawing every round reuses its memory instead of faulting in
    fresh pages for each draw.

    Raises:
        ValueError: ``seed`` is not 32 bytes, or ``out`` is not such an array.
    """
    if out.dtype.kind != "u" or out.dtype.byteorder == ">" or not out.flags.c_contiguous:
        raise ValueError(
            f"expand_into needs a contiguous little-endian unsigned array, got {out.dtype}"
        )
    _fill(_encryptor(seed, domain), out.reshape(-1).view(np.uint8))


def expand_into_at(
    seed: bytes, domain: bytes, first: int, out: npt.NDArray[np.unsignedinteger]
) -> None:
    """Fill ``out`` with values ``first .. first + out.size`` of :func:`expand`
    (seed, domain, ·, ``out.dtype``), the earlier ones never computed: the counter
    starts at the AES block that holds byte ``first · itemsize`` of the stream, so
    callers can draw disjoint pieces of one stream on separate threads.

    Raises:
        ValueError: ``seed`` is not 32 bytes, ``first`` is negative, or ``out`` is not
            a contiguous little-endian unsigned array.
    """
    if out.dtype.kind != "u" or out.dtype.byteorder == ">" or not out.flags.c_contiguous:
        raise ValueError(
            f"expand_into_at needs a contiguous little-endian unsigned array, got {out.dtype}"
        )
    if first < 0:
        raise ValueError(f"the first value must be at or after the start, got {first}")
    block, skip = divmod(first * out.dtype.itemsize, 16)
    encryptor = Cipher(
        algorithms.AES(derive_key(seed, domain)), modes.CTR(block.to_bytes(16, "big"))
    ).encryptor()
    if skip:
        encryptor.update(_zeros(skip))
    _fill(encryptor, out.reshape(-1).view(np.uint8))


def _fill(encryptor: CipherContext, raw: npt.NDArray[np.uint8]) -> None:
    """Write the encryptor's next ``raw.size`` keystream bytes into ``raw``."""
    # update_into wants room for a block beyond what it writes: the last block comes
    # from update, continuing the same stream
    head = max(0, raw.size - 16)
    if head:
        encryptor.update_into(_zeros(head), raw[: head + 15].data)
    raw[head:] = np.frombuffer(encryptor.update(_zeros(raw.size - head)), dtype=np.uint8)


def uniform01(seed: bytes, domain: bytes, count: int) -> npt.NDArray[np.float32]:
    """``count`` float32 values uniform on [0, 1) with 24 bits of resolution."""
    words: npt.NDArray[np.uint32] = expand(seed, domain, count, np.uint32) >> np.uint32(8)
    out = words.astype(np.float32)  # exact: 24-bit integers fit a float32 mantissa
    out *= np.float32(1.0 / (1 << 24))
    return out
