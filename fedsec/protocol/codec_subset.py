"""The shared random subset of a compressed round: which k of n coordinates every member
keeps, drawn from the round's seed so that all parties (members, aggregator, auditor)
derive the same one (:mod:`fedsec.protocol.update_codec` uses it)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from fedsec.crypto import prg

__all__ = ["SUBSET_DOMAIN", "kept_runs", "subset"]

SUBSET_DOMAIN = b"fedsec/v1/codec/subset"


@lru_cache(maxsize=8)
def subset(seed: bytes, n: int, k: int) -> npt.NDArray[np.intp]:
    """k of ``n`` coordinates, uniformly at random from ``seed``, ascending: those with
    the k smallest of n 32-bit keystream keys, ties broken by the lower index.

    Found in O(n) without sorting the keys: a histogram of their top 16 bits gives the
    bucket in which the k-th smallest lies; every key in a lower bucket is kept, and only
    that bucket's few keys (about n/2^16) are sorted to take the rest."""
    if k >= n:
        return np.arange(n)
    keys = prg.expand(seed, SUBSET_DOMAIN, n, np.uint32)
    top = (keys >> np.uint32(16)).astype(np.intp)
    below = np.cumsum(np.bincount(top, minlength=1 << 16))
    bucket = int(np.searchsorted(below, k, side="left"))  # first with ≥ k keys at or below
    kept = top < bucket
    rest = k - (int(below[bucket - 1]) if bucket else 0)
    candidates = np.flatnonzero(top == bucket)
    # a stable sort of the bucket's keys (in index order) breaks ties by index
    kept[candidates[np.argsort(keys[candidates], kind="stable")[:rest]]] = True
    chosen = np.flatnonzero(kept)
    chosen.setflags(write=False)
    return chosen


def kept_runs(
    seed: bytes | None, n: int, k: int, block: int
) -> Iterator[tuple[int, npt.NDArray[np.intp]]]:
    """:func:`subset` (seed, n, k) a block of ``n`` at a time: (start, the kept
    coordinates in [start, start + block) less start), in order, without holding the
    n keys or the k indices (64 and 80 MB at 16.8M coordinates).  Three passes over the
    keystream: the histogram of the keys' top 16 bits, the boundary bucket's keys, the
    kept coordinates; the same rule, so the same coordinates.  ``seed`` None: all."""
    if seed is None or k >= n:
        for start in range(0, n, block):
            yield start, np.arange(min(block, n - start))
        return
    below = np.zeros(1 << 16, dtype=np.int64)
    for keys in prg.expand_blocks(seed, SUBSET_DOMAIN, n, np.uint32, block):
        below += np.bincount(keys >> np.uint32(16), minlength=1 << 16)
    np.cumsum(below, out=below)
    bucket = int(np.searchsorted(below, k, side="left"))  # first with ≥ k keys at or below
    rest = k - (int(below[bucket - 1]) if bucket else 0)
    found: list[npt.NDArray[np.intp]] = []
    keyed: list[npt.NDArray[np.uint32]] = []
    for i, keys in enumerate(prg.expand_blocks(seed, SUBSET_DOMAIN, n, np.uint32, block)):
        at = np.flatnonzero((keys >> np.uint32(16)) == bucket)
        found.append(at + i * block)
        keyed.append(keys[at])
    candidates = np.concatenate(found)
    # a stable sort of the bucket's keys (in index order) breaks ties by index
    chosen = np.sort(candidates[np.argsort(np.concatenate(keyed), kind="stable")[:rest]])
    for i, keys in enumerate(prg.expand_blocks(seed, SUBSET_DOMAIN, n, np.uint32, block)):
        start = i * block
        kept = (keys >> np.uint32(16)) < bucket
        lo, hi = np.searchsorted(chosen, (start, start + keys.size))
        kept[chosen[lo:hi] - start] = True
        yield start, np.flatnonzero(kept)
