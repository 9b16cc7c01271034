"""Per-member request rate limit: a token bucket for each verified key (sans-I/O).

Charged only after a request's signature verified, so nobody can spend another
member's tokens, and the table holds at most one bucket per enrolled key.  The limit
protects members from each other (one key at full speed cannot crowd out the
others' requests or their replay-store rows) and the aggregator from one member.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsec.errors import RateLimited


@dataclass
class _Bucket:
    tokens: float
    at: float


class MemberRateLimit:
    """``rate_per_s`` requests a second per key, sustained, with bursts up to ``burst``.

    Args:
        rate_per_s: tokens added per second.
        burst: bucket depth (a key idle long enough may send this many at once).

    Raises:
        ValueError: a non-positive rate or burst.
    """

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s > 0) or burst < 1:
            raise ValueError(f"rate limit needs rate > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate_per_s = float(rate_per_s)
        self.burst = int(burst)
        self._buckets: dict[str, _Bucket] = {}

    def charge(self, keyid: str, now: float) -> None:
        """Take one token from ``keyid``'s bucket.

        Raises:
            RateLimited: the bucket is empty; ``retry_after`` is when one token is back.
        """
        bucket = self._buckets.get(keyid)
        if bucket is None:
            bucket = self._buckets[keyid] = _Bucket(tokens=float(self.burst), at=now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / self.rate_per_s
            raise RateLimited(
                f"rate limited: {keyid} sent more than {self.rate_per_s:g} requests/s "
                f"(burst {self.burst}); retry in {wait:.2f} s",
                retry_after=wait,
            )
        bucket.tokens -= 1.0
