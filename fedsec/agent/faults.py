"""Fault injection for chaos tests and the demo: crash at a named point of a round.

Set ``FEDSEC_FAULT_CRASH_AT=ROUND:STAGE`` (e.g. ``4:share_keys``) and the agent
kills itself with SIGKILL right after completing STAGE of ROUND: no clean-up, no
goodbye, exactly like a machine losing power.  Unset (always, in production),
:func:`crash_point` does nothing.
"""

from __future__ import annotations

import logging
import os
import signal

ENV = "FEDSEC_FAULT_CRASH_AT"
STAGES = ("train", "advertise", "share_keys", "masked_input", "unmask")

log = logging.getLogger(__name__)


def crash_point(round_: int, stage: str) -> None:
    """SIGKILL this process if ``ENV`` names this round and stage."""
    target = os.environ.get(ENV)
    if target and target == f"{round_}:{stage}":
        log.warning("fault_injected crash_at=%s", target)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
