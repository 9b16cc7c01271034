"""Which archive objects belong to the attempt in progress, so that ``GET /audit/archive``
withholds them until the attempt ends.

Why: while an attempt is open, its members' messages are the raw material of attacks on
the ones still to come.  Under ``secure_sum = "he"`` a member handed the other honest
members' ciphertexts can upload ``Enc(0) - Σ`` of them as its own, and the custodian's
sum would be one victim's vector (issue 32); an auditor colluding with a member could
otherwise fetch them from the archive.  The one reader that needs them before the end is
the key custodian, in stage ``decrypt`` (every ciphertext is in by then): it re-adds them.

The index reads the transparency log on from where it stopped (each line once) and keeps
the digests its ``accepted`` entries name for the live attempt.
"""

from __future__ import annotations

from fedsec.aggregator.storage.interfaces import StateStore
from fedsec.protocol.log import entry_from_line

__all__ = ["OpenAttemptObjects"]


class OpenAttemptObjects:
    """The digests of the messages accepted for one attempt, read from the log.

    Args:
        state: the aggregator's state store (its log).
    """

    def __init__(self, state: StateStore) -> None:
        self._state = state
        self._attempt: tuple[int, int] | None = None
        self._digests: set[str] = set()
        self._next = 0  # the first log index not read yet

    def holds(self, round_: int, attempt: int, sha256: str) -> bool:
        """True when the log accepted a message named ``sha256`` for that attempt."""
        key = (round_, attempt)
        if key != self._attempt:
            # an attempt's entries all follow its spec, which follows every entry of the
            # attempts before it: what was read before it started holds none of them
            self._attempt, self._digests = key, set()
        for index, line in self._state.log.log_lines(self._next):
            entry = entry_from_line(line)
            body = entry.body
            if entry.kind == "accepted" and (body["round"], body["attempt"]) == key:
                self._digests.add(body["sha256"])
            self._next = index + 1
        return sha256 in self._digests
