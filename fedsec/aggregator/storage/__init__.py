"""The aggregator's durable storage: state, model versions and the roster file.

- :mod:`.interfaces`: what the round engine needs of durable state, one protocol per
  concern (rounds, joins, messages, reports, receipts, challenges, log, named values,
  alerts, access tokens, audit verdicts),
  joined by :class:`StateStore` with its transaction. The round logic depends on these
  only, so either implementation runs under it unchanged.
- :mod:`.sqlite`: the embedded implementation (``state.db``, SQLite in WAL mode).
- :mod:`.postgres`: the replicated implementation (PostgreSQL through psycopg 3, with
  versioned migrations), chosen by ``[storage] url`` in ``federation.toml``.
- :mod:`.models`: content-addressed model files and their signed manifests.
- :mod:`.roster_file`: the admin-signed roster in ``roster.json``.
- :mod:`.audit_trail`: the transparency log and the archive, written in the same
  transaction as the state change they record.

:class:`fedsec.aggregator.workspace.Workspace` is where the concrete stores are opened.
"""

from fedsec.aggregator.storage.interfaces import (
    AlertRow,
    AlertStore,
    ChallengeStore,
    JoinStore,
    KeyValueStore,
    LogStore,
    MessageStore,
    ReceiptStore,
    ReportStore,
    RoundRow,
    RoundStore,
    StateStore,
    TokenRow,
    TokenStore,
    VerdictRow,
    VerdictStore,
)

__all__ = [
    "AlertRow",
    "AlertStore",
    "ChallengeStore",
    "JoinStore",
    "KeyValueStore",
    "LogStore",
    "MessageStore",
    "ReceiptStore",
    "ReportStore",
    "RoundRow",
    "RoundStore",
    "StateStore",
    "TokenRow",
    "TokenStore",
    "VerdictRow",
    "VerdictStore",
]
