"""Memory to unmask and decode a ring sum in, mapped apart from the allocator's heap
(:meth:`fedsec.protocol.update_codec.UpdateCodec.decode_space`): a decode then gives
back the pages it no longer needs while views of them stay valid memory."""

from __future__ import annotations

import mmap

import numpy as np
import numpy.typing as npt

#: Shortest run of a decode in a decode space: runs of a power-of-two length of at
#: least 8 tile the power-of-two work vector, so every run but the last ends at least 8
#: coordinates (64 bytes) before its end, more than the weight's elements take (at most
#: 16 of at most 2 bytes) behind the sums not yet read.
MIN_RUN = 8


def sum_offset(padded: int, length: int, itemsize: int) -> int | None:
    """Where a ring sum of ``length`` elements of ``itemsize`` bytes lies in a decode
    space of ``padded`` float64 values, its last byte the space's; None where the
    elements are wider than 2 bytes (a run's sums could then outgrow its coordinates)
    or the sum does not fit."""
    offset = 8 * padded - itemsize * length
    return offset if itemsize <= 2 and offset >= 0 else None


def zeroed(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed memory of the process's own, mapped apart from the heap."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)


def space_of(work: npt.NDArray[np.float64]) -> mmap.mmap | None:
    """The :func:`zeroed` mapping that ``work`` is the whole of, or None."""
    view: object = work.base
    space = view.obj if isinstance(view, memoryview) else None
    if isinstance(space, mmap.mmap) and work.flags.c_contiguous and work.nbytes == len(space):
        return space
    return None


def release_after(work: npt.NDArray[np.float64], keep: int) -> npt.NDArray[np.float64]:
    """``work``'s first ``keep`` values, the whole pages after them given back to the
    system: a view of them (such as a spent ring sum) then reads zeros, never freed
    memory.

    Raises:
        ValueError: ``work`` is not the whole of a :func:`zeroed` mapping.
    """
    space = space_of(work)
    if space is None:
        raise ValueError("only a decode space's pages can be given back")
    first = -(-8 * keep // mmap.PAGESIZE) * mmap.PAGESIZE
    if first < len(space):
        space.madvise(mmap.MADV_DONTNEED, first, len(space) - first)
    return work[:keep]
