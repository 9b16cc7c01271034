"""The aggregator's C heap before a round's largest allocation.

Large buffers freed during a round (request bodies, SQLite's copy of a bound masked
input, the unmasking's scratch) raise glibc's mmap threshold to their size, so the
next ones of that size come from the heap, and what they leave free stays mapped:
at 11M parameters some 20 MiB when the decode begins.  Trimming the heap then lowers
the round's peak by as much; the decode's own vector is mapped apart from the heap
(:meth:`fedsec.protocol.update_codec.UpdateCodec.decode_space`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["release_free_heap"]


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (``malloc_trim(0)``: a few
    milliseconds); nothing where the C library cannot."""
    if _TRIM is not None:
        _TRIM(0)
