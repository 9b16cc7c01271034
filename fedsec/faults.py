"""Fault injection and reproducibility switches for chaos tests and the demo.

Production code is handed a :class:`Faults` object by its constructor and calls
:meth:`Faults.crash` at its crash points and :meth:`Faults.seeded_bytes` where it
draws randomness a test wants reproducible.  Production passes :data:`NO_FAULTS`,
which does nothing; a test that injects faults in its own process passes its own
``Faults(...)``.

Crash points: a ``Faults`` with ``crash_at="ROUND:POINT"`` kills the process with
SIGKILL when it reaches that point: no clean-up, no goodbye, exactly like a machine
losing power.  Points are stage names (an agent: right after completing that stage;
the aggregator: right after durably entering it), ``STAGE:N`` (the aggregator, after
durably accepting the N-th message of the stage) and ``model_write`` (the aggregator,
after writing the new model file but before recording the round as closed) and
``archive_prune`` (the aggregator, after logging an ``archive_pruned`` entry but
before deleting the archive objects it names).

Unsafe deterministic seed: with ``seed`` set an agent derives its training and
rounding randomness from it, its id and the round instead of the OS CSPRNG, so two
runs produce bit-identical updates (the chaos tests compare model hashes with an
uninterrupted run).  Whoever knows the seed can subtract the DP noise: never set it
where privacy matters.

Child processes: the chaos bench, the demo and the crash tests start ``fedsec
aggregator serve`` / ``fedsec agent run`` with ``FEDSEC_FAULT_AGGREGATOR_CRASH_AT``
(the aggregator) or ``FEDSEC_FAULT_CRASH_AT`` (an agent) and
``FEDSEC_UNSAFE_DETERMINISTIC_SEED`` in their environment; those two CLI entry points
read it once, with :meth:`Faults.from_environment`, and hand the object in.  Nothing
else reads these variables.  Unset, as always in production, nothing happens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

AGENT_ENV = "FEDSEC_FAULT_CRASH_AT"
AGGREGATOR_ENV = "FEDSEC_FAULT_AGGREGATOR_CRASH_AT"
SEED_ENV = "FEDSEC_UNSAFE_DETERMINISTIC_SEED"

#: Which process reads its faults from the environment: each has its own crash variable.
Role = Literal["agent", "aggregator"]
_CRASH_ENV: dict[Role, str] = {"agent": AGENT_ENV, "aggregator": AGGREGATOR_ENV}
#: :meth:`Faults.seeded_bytes` as the agent's sans-I/O machines take it (they cannot crash).
SeededBytes = Callable[..., bytes | None]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Faults:
    """The faults one process injects into itself.

    Args:
        crash_at: ``ROUND:POINT`` to SIGKILL this process at, or None.
        seed: the unsafe deterministic seed, or None (randomness from the OS CSPRNG).
    """

    crash_at: str | None = None
    seed: str | None = None

    @classmethod
    def from_environment(cls, role: Role, environ: Mapping[str, str] = os.environ) -> Faults:
        """The faults a chaos test or the demo asked of this child process (see module doc).

        Args:
            role: which crash variable applies to this process.
            environ: the environment to read (default: this process's).

        Returns:
            :data:`NO_FAULTS` when none of the variables is set (or set empty).
        """
        crash_at = environ.get(_CRASH_ENV[role]) or None
        seed = environ.get(SEED_ENV) or None
        if crash_at is None and seed is None:
            return NO_FAULTS
        return cls(crash_at=crash_at, seed=seed)

    def crash(self, round_: int, point: str) -> None:
        """SIGKILL this process if ``crash_at`` names this round and point."""
        target = self.crash_at
        if target and target == f"{round_}:{point}":
            log.warning("event=fault_injected crash_at=%s", target)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def seeded_bytes(self, *parts: object) -> bytes | None:
        """32 bytes derived from the unsafe seed and ``parts``; None when no seed is set."""
        if not self.seed:
            return None
        return hashlib.sha256("\x00".join([self.seed, *map(str, parts)]).encode()).digest()


#: What production runs with: no crash, randomness from the OS CSPRNG.
NO_FAULTS = Faults()
