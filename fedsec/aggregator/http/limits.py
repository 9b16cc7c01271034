"""The HTTP layer's own limits and periods, each with the reason for its value.

The limits a federation configures (body sizes, timeouts, rates, upload slots) are in
``[server]`` of ``federation.toml`` (:class:`fedsec.config.ServerSection`); the
connection layer's are in :mod:`fedsec.aggregator.transport`; the protocol's
(long-poll cap, integer ranges) in :mod:`fedsec.protocol.limits`.
"""

from __future__ import annotations

# Deadlines are seconds long; checking 20 times a second closes a stage within 50 ms.
TICK_S = 0.05
# Roster changes made by the CLI while serving are picked up within a second.
ROSTER_RELOAD_S = 1.0
# An error detail quotes client input; past this many characters it is cut, so a
# client cannot make the answer or the log echo a megabyte back.
MAX_DETAIL_CHARS = 400
# Refusals are logged at INFO, at most this many a second (the rest are counted), so a
# client sending garbage at full speed cannot flood the operator's log.
REFUSAL_LOG_PER_S = 20
