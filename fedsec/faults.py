"""Fault injection and reproducibility switches for chaos tests and the demo.

Crash points: set ``FEDSEC_FAULT_CRASH_AT`` (agents) or
``FEDSEC_FAULT_AGGREGATOR_CRASH_AT`` (the aggregator) to ``ROUND:POINT`` and the
process kills itself with SIGKILL when it reaches that point: no clean-up, no
goodbye, exactly like a machine losing power.  Points are stage names (an agent:
right after completing that stage; the aggregator: right after durably entering
it), ``STAGE:N`` (the aggregator, after durably accepting the N-th message of the
stage) and ``model_write`` (the aggregator, after writing the new model file but
before recording the round as closed) and ``archive_prune`` (the aggregator, after
logging an ``archive_pruned`` entry but before deleting the archive objects it
names).  Unset, as always in production, nothing
happens.

``FEDSEC_UNSAFE_DETERMINISTIC_SEED``: an agent derives its training and rounding
randomness from this seed, its id and the round instead of the OS CSPRNG, so two
runs produce bit-identical updates (the chaos tests compare model hashes with an
uninterrupted run).  Whoever knows the seed can subtract the DP noise: never set
it where privacy matters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal

AGENT_ENV = "FEDSEC_FAULT_CRASH_AT"
AGGREGATOR_ENV = "FEDSEC_FAULT_AGGREGATOR_CRASH_AT"
SEED_ENV = "FEDSEC_UNSAFE_DETERMINISTIC_SEED"

log = logging.getLogger(__name__)


def crash_point(round_: int, point: str, env: str = AGENT_ENV) -> None:
    """SIGKILL this process if ``env`` names this round and point."""
    target = os.environ.get(env)
    if target and target == f"{round_}:{point}":
        log.warning("event=fault_injected crash_at=%s", target)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def deterministic_bytes(*parts: object) -> bytes | None:
    """32 bytes derived from the unsafe seed and ``parts``; None when the seed is unset."""
    seed = os.environ.get(SEED_ENV)
    if not seed:
        return None
    return hashlib.sha256("\x00".join([seed, *map(str, parts)]).encode()).digest()
