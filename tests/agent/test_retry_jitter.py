"""Members' retries spread with full jitter: after an aggregator restart, a thousand
members that lost it together come back spread over the whole backoff window."""

from __future__ import annotations

import socket

import pytest

from fedsec.aggregator_client.transport import Route, Transport
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import AggregatorUnreachable

AGENT = SigningIdentity(bytes(range(32)))
ROUND = Route("GET", "/v1/round")
RETRIES = 200


def _closed_port() -> int:
    """A loopback port nobody listens on (connecting to it is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_backoff_draws_from_the_whole_window() -> None:
    """Old code drew from [d/2, d]: every member waited at least half the window, so a
    restart brought them all back within its second half.  Full jitter draws from
    [0, d]; 200 draws with none under d/2 would have probability 2**-200."""
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    transport = Transport(
        f"http://127.0.0.1:{_closed_port()}",
        AGENT,
        timeout_s=5.0,
        retry_max=RETRIES,
        backoff_initial_s=1.0,
        backoff_max_s=1.0,  # every retry's window is [0, 1 s]
        sleep=record,
    )
    try:
        with pytest.raises(AggregatorUnreachable):
            await transport.request(ROUND, max_bytes=1024, what="round")
    finally:
        await transport.close()
    assert len(waits) == RETRIES
    assert all(0.0 <= w <= 1.0 for w in waits)
    assert any(w < 0.5 for w in waits)  # the first half of the window is used
    assert any(w >= 0.5 for w in waits)
