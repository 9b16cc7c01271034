"""Which refusals end only this agent's attempt, and which it outlives altogether.

Temporary refusals (429 rate limited, 503 busy, 408 body timeout, 401 replayed) are
retried by the client; once its retries run out the agent still outlives them.
Round-local ones (a stage missed, a 409, a relayed key list that does not verify, a
404/410/425 of this attempt's data) drop the agent from the attempt.  Everything
else ends the agent with the error.
"""

from __future__ import annotations

from typing import Final

from fedsec.errors import (
    AggregatorRefused,
    ClockSkewError,
    FedsecError,
    NotFound,
    ProtocolError,
    ReplayError,
    RequestTimeout,
    RetryLater,
)

#: Statuses whose 4xx answers mean "not in this attempt any more", not "stop the agent".
ROUND_LOCAL_STATUSES: Final = frozenset({404, 409, 410, 425})


def is_temporary(exc: FedsecError) -> bool:
    """A refusal the agent outlives once the client's retries ran out on it: the same
    request, signed anew, may pass later (rate limit, busy, body timeout, nonce store
    full).  Clock skew is not: the client already corrected by the server's clock."""
    if isinstance(exc, ClockSkewError):
        return False
    return isinstance(exc, RetryLater | RequestTimeout | ReplayError)


def is_round_local(exc: FedsecError) -> bool:
    """A refusal that drops this agent from the attempt but not from the federation."""
    if isinstance(exc, ProtocolError | NotFound) or is_temporary(exc):
        return True
    return isinstance(exc, AggregatorRefused) and exc.http_status in ROUND_LOCAL_STATUSES
