"""The client's limits and defaults, each with the reason for its value."""

from __future__ import annotations

from typing import Final

from fedsec.protocol.limits import MAX_MODEL_BYTES

#: Largest JSON answer read (round state, key lists, share relays, roster).  A key
#: list entry is ~300 bytes and a round spec lists the cohort twice (cohort and
#: weight caps), so 16 MiB holds cohorts of tens of thousands, two orders of
#: magnitude above the aggregator's default max_agents (100), while bounding what a
#: hostile or broken server can make the agent buffer.
MAX_JSON_BYTES: Final = 16 * 1024 * 1024
#: Largest error body read: an ErrorBody is a code and one sentence; 64 KiB is
#: ample and a server cannot flood the agent through its error path.
MAX_ERROR_BYTES: Final = 64 * 1024
#: A receipt is a dozen short fields (~500 bytes); 64 KiB as for errors.
MAX_RECEIPT_BYTES: Final = 64 * 1024
#: Default cap on a model download when the caller gives none; the runtime passes a cap
#: derived from its own model's size instead.
DEFAULT_MAX_MODEL_BYTES: Final = MAX_MODEL_BYTES
#: Extra seconds a long-poll request may take beyond the wait the server was asked
#: for: the server answers at the end of the wait, and the answer still has to travel.
LONG_POLL_SLACK_S: Final = 15.0
#: Chunk size for streamed reads; 64 KiB is aiohttp's own default read buffer size.
READ_CHUNK: Final = 64 * 1024
#: Seconds an idle pooled connection is kept for reuse.  A member comes back between
#: stages (its training, the others' uploads), and a new connection is a TCP and TLS
#: handshake each time; 55 s is under the aggregator's default server.keepalive_s (75 s,
#: as nginx) and the 60 s idle timeout of common load balancers, so the client gives a
#: connection up before the server (or a proxy) closes it and never sends a request onto
#: a connection that is being closed.
IDLE_CONNECTION_S: Final = 55.0
#: Seconds a replica URL found unreachable is not followed on a standby's word: the
#: standbys name a dead leader until its lease expires (5 s), so following the name at
#: once would bounce between the standby and the dead one; 3 s later it is asked again,
#: since a replica that takes over restarts its server (a moment of refused connections).
UNREACHABLE_HOLD_S: Final = 3.0
