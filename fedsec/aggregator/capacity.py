"""How many connections and file descriptors a federation needs, sized from its roster.

A member holds one connection for its long poll and one for the request beside it, so the
connections an aggregator must hold grow with the roster, and every connection is a file
descriptor.  A fixed connection limit turns members away once the roster outgrows it, and
a process over its ``RLIMIT_NOFILE`` fails ``accept`` (aiohttp logs it, the member sees a
reset connection) in the middle of a round.  So the limit is sized from the roster when
``server.max_connections`` is 0 (the default), and the process raises its own soft
descriptor limit to fit at start-up, within the hard limit the system gives it; when even
the hard limit is too low it refuses to start, naming the numbers and the fix, rather
than fail members one by one later.
"""

from __future__ import annotations

import logging
import resource

from fedsec.errors import ConfigError

log = logging.getLogger(__name__)

# Connections one roster identity may hold at once: a member's long poll, a request beside
# it, and one more being opened while a closing keep-alive connection is not yet released.
CONNECTIONS_PER_IDENTITY = 3
# Connections beyond the roster's: dashboards and their live streams, /metrics scrapers,
# /v1/health probes, and newcomers not yet authenticated (they displace one another at the
# limit, never a member).  256 is half the old fixed limit of 512.
CONNECTION_HEADROOM = 256
# Descriptors a serving process holds besides its connections: stdio, the listening
# sockets, the event loop's epoll and self-pipe, the state database with its WAL and
# shared-memory files, the transparency log, model files being read or written, and the
# thread pool's and torch's own.  Counted at ~40 in a serving aggregator; 128 leaves room.
DESCRIPTOR_HEADROOM = 128


def connection_limit(configured: int, identities: int) -> int:
    """Connections to admit at once.

    Args:
        configured: ``server.max_connections``; 0 sizes it from the roster.
        identities: entries in the roster (members, observers, custodians, auditors).

    Returns:
        ``configured`` when set, else ``identities`` x :data:`CONNECTIONS_PER_IDENTITY`
        + :data:`CONNECTION_HEADROOM`.
    """
    if configured > 0:
        return configured
    return max(0, identities) * CONNECTIONS_PER_IDENTITY + CONNECTION_HEADROOM


def descriptors_needed(connections: int) -> int:
    """File descriptors a process holding ``connections`` sockets needs in all."""
    return connections + DESCRIPTOR_HEADROOM


def ensure_descriptors(needed: int, what: str) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to at least ``needed``, within its
    hard limit; never lower it.

    Args:
        needed: descriptors the process will hold at most.
        what: what needs them, for the error and the log (e.g. "a roster of 1000").

    Returns:
        The soft limit now in force.

    Raises:
        ConfigError: the hard limit is below ``needed``; the message names both numbers
            and how to raise it (``ulimit -n``, systemd ``LimitNOFILE=``).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(
            f"{what} needs {needed} file descriptors but this process may open at most "
            f"{hard} (hard RLIMIT_NOFILE; soft {soft}); raise it to at least {needed}: "
            f"'ulimit -n {needed}' in the shell that starts it, LimitNOFILE={needed} in "
            "its systemd unit, or nofile in /etc/security/limits.conf"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    log.info("event=descriptor_limit_raised from=%d to=%d hard=%s for=%r", soft, needed, hard, what)
    return needed
