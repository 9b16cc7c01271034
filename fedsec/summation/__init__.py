"""Summation modes: how a round attempt turns its members' contributions into Σ w·Δ and
Σ w, shared by every party.

A layer between :mod:`fedsec.learning` and the roles: it imports crypto, protocol,
learning and errors, never a role (an import-linter contract).  :data:`MODES` maps each
``secure_sum`` value to its :class:`~fedsec.summation.mode.SummationMode`; the roles ask
that object (:func:`mode_of`) instead of comparing the value:

- ``secagg`` (:mod:`fedsec.summation.secagg`): SecAgg+;
- ``none`` (:mod:`fedsec.summation.plain`): a trusted aggregator, robust rules;
- ``he`` (:mod:`fedsec.summation.he`): CKKS ciphertexts, a key custodian decrypts.

:func:`replay` is the one computation of an attempt's sum from its stored messages.
"""

from __future__ import annotations

from fedsec.errors import ProtocolError
from fedsec.protocol import wire
from fedsec.summation.he import HE
from fedsec.summation.mode import (
    SessionInputs,
    StoredAttempt,
    StoredMessage,
    SummationMode,
    feed,
)
from fedsec.summation.plain import PLAIN
from fedsec.summation.secagg import SECAGG
from fedsec.summation.session import SummationResult, SummationSession

__all__ = [
    "MODES",
    "SessionInputs",
    "StoredAttempt",
    "StoredMessage",
    "SummationMode",
    "SummationResult",
    "SummationSession",
    "feed",
    "mode_named",
    "mode_of",
    "open_session",
    "replay",
]

#: Every summation mode, by its ``secure_sum`` value.
MODES: dict[str, SummationMode] = {m.name: m for m in (SECAGG, PLAIN, HE)}


def mode_named(name: str) -> SummationMode:
    """The mode called ``name`` (``round.secure_sum``).

    Raises:
        ProtocolError: no such mode.
    """
    try:
        return MODES[name]
    except KeyError:
        raise ProtocolError(f"no summation mode {name!r} (modes: {sorted(MODES)})") from None


def mode_of(spec: wire.RoundSpec) -> SummationMode:
    """The mode ``spec``'s attempt sums by.

    Raises:
        ProtocolError: the spec names no known mode.
    """
    return mode_named(spec.secure_sum)


def open_session(spec: wire.RoundSpec, inputs: SessionInputs) -> SummationSession:
    """The session of ``spec``'s attempt (:meth:`SummationMode.open_session`).

    Raises:
        ProtocolError: see :meth:`SummationMode.open_session`; an unknown mode.
    """
    return mode_of(spec).open_session(spec, inputs)


def replay(spec: wire.RoundSpec, stored: StoredAttempt) -> SummationResult:
    """``spec``'s attempt summed again from its stored messages, exactly as the
    aggregator summed them (:meth:`SummationMode.replay`): what crash resume, ``fedsec
    audit verify`` and the key custodian compute the sum with.

    Args:
        spec: the attempt's signed spec.
        stored: a :class:`StoredAttempt`: ``inputs`` (a :class:`SessionInputs`: the
            cohort's Ed25519 keys, and the custodian's for he; ``min_agents``; for he the
            public CKKS context and its SHA-256; the ``max_json_bytes`` bound;
            ``reference`` only for rule fltrust) and ``messages``: every accepted stage
            message of the attempt in log order, each a :class:`StoredMessage` (stage,
            member, raw) whose ``raw`` is the accepted body exactly as stored or archived
            (JSON bodies; the packed vector or framed ciphertexts of masked_input; the
            custodian's whole post_decryption body).

    Returns:
        The :class:`SummationResult`; its ``sum_sha256`` is the log's ``aggregate`` hash.

    Raises:
        ProtocolError: an unknown mode; a stored message that no longer verifies.
        msgspec.DecodeError: a stored JSON body that no longer decodes.
        RoundAborted, RecoveryImpossible: the messages cannot form a sum.
    """
    return mode_of(spec).replay(spec, stored)
