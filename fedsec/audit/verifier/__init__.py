"""The checkers behind ``fedsec audit verify``, one per concern.

:class:`fedsec.audit.verify.Verifier` walks the log and routes each entry to the
checker that owns its concern: who may sign what (:mod:`.identity`), what the
archive holds and what retention deleted (:mod:`.retention`), each round attempt's
spec and accepted messages (:mod:`.attempts`), each summation mode's own entries
(:mod:`.modes`, :mod:`.homomorphic`), the aggregates re-derived from the archive
(:mod:`.aggregates`; a sum by :func:`fedsec.summation.replay`), the model versions
(:mod:`.models`), the members' privacy accounting (:mod:`.privacy`) and the task
package each spec pins (:mod:`.task_pins`).  Each
checker keeps its own state and counts; the dispatcher names the entry a checker's
problem is about.
"""

from __future__ import annotations

from fedsec.errors import IntegrityError


class EntryProblem(IntegrityError):
    """What is wrong with the log entry being checked; the dispatcher prefixes the
    entry's index and kind (``log entry 12 (aggregate): ...``)."""

    code = "verification_failed"
