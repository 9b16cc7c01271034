"""What operations keep in SQL: alerts (table ``alerts``), the observers' bearer
tokens (``access_tokens``) and auditors' verdicts (``audit_verdicts``)."""

from __future__ import annotations

from typing import Any

from fedsec.aggregator.storage.interfaces import AlertRow, TokenRow, VerdictRow
from fedsec.aggregator.storage.sql.db import SqlDb, count_rows

_ALERT_COLUMNS = "id, kind, subject, detail, raised_at, acked_at, acked_by, ack_sha256"


class SqlAlerts:
    """:class:`~fedsec.aggregator.storage.interfaces.AlertStore` in table ``alerts``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, kind: str, subject: str, detail: str, now: float, ack_sha256: str) -> int:
        return self._db.insert(
            "INSERT INTO alerts (kind, subject, detail, raised_at, ack_sha256) "
            "VALUES (?, ?, ?, ?, ?)",
            (kind, subject, detail, now, ack_sha256),
            "id",
        )

    def get(self, alert_id: int) -> AlertRow | None:
        row = self._db.read_one(f"SELECT {_ALERT_COLUMNS} FROM alerts WHERE id=?", (alert_id,))
        return AlertRow(*row) if row else None

    def open_of(self, kind: str, subject: str) -> AlertRow | None:
        row = self._db.read_one(
            f"SELECT {_ALERT_COLUMNS} FROM alerts WHERE kind=? AND subject=? "
            "AND acked_at IS NULL ORDER BY id DESC LIMIT 1",
            (kind, subject),
        )
        return AlertRow(*row) if row else None

    def recent(self, limit: int = 200) -> list[AlertRow]:
        rows = list(
            self._db.read(f"SELECT {_ALERT_COLUMNS} FROM alerts ORDER BY id DESC LIMIT ?", (limit,))
        )
        return [AlertRow(*r) for r in rows]

    def count_open(self) -> dict[str, int]:
        rows = list(
            self._db.read("SELECT kind, COUNT(*) FROM alerts WHERE acked_at IS NULL GROUP BY kind")
        )
        return {str(k): int(n) for k, n in rows}

    def ack(self, alert_id: int, by: str, now: float) -> bool:
        changed = self._db.write(
            "UPDATE alerts SET acked_at=?, acked_by=? WHERE id=? AND acked_at IS NULL",
            (now, by, alert_id),
        )
        return changed == 1


class SqlTokens:
    """:class:`~fedsec.aggregator.storage.interfaces.TokenStore` in table
    ``access_tokens``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, row: TokenRow) -> None:
        self._db.write(
            "INSERT INTO access_tokens VALUES (?, ?, ?, ?, ?, ?)",
            (row.sha256, row.observer, row.scope, row.issued_at, row.expires_at, row.revoked),
        )

    def get(self, sha256: str) -> TokenRow | None:
        row = self._db.read_one("SELECT * FROM access_tokens WHERE sha256=?", (sha256,))
        return _token(row) if row else None

    def all(self) -> list[TokenRow]:
        rows = list(self._db.read("SELECT * FROM access_tokens ORDER BY issued_at DESC"))
        return [_token(r) for r in rows]

    def revoke(self, sha256: str) -> bool:
        changed = self._db.write("UPDATE access_tokens SET revoked=TRUE WHERE sha256=?", (sha256,))
        return changed == 1


def _token(row: Any) -> TokenRow:
    sha, observer, scope, issued, expires, revoked = row
    return TokenRow(
        str(sha), str(observer), str(scope), float(issued), float(expires), bool(revoked)
    )


class SqlVerdicts:
    """:class:`~fedsec.aggregator.storage.interfaces.VerdictStore` in table
    ``audit_verdicts``."""

    def __init__(self, db: SqlDb) -> None:
        self._db = db

    def add(self, row: VerdictRow) -> bool:
        changed = self._db.write(
            "INSERT INTO audit_verdicts VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (
                row.round,
                row.attempt,
                row.member,
                row.auditor,
                row.passed,
                row.failed,
                row.received_at,
            ),
        )
        return changed == 1

    def by_member(self) -> dict[str, list[VerdictRow]]:
        out: dict[str, list[VerdictRow]] = {}
        rows = list(self._db.read("SELECT * FROM audit_verdicts ORDER BY round, attempt, auditor"))
        for r, a, member, auditor, passed, failed, at in rows:
            out.setdefault(member, []).append(
                VerdictRow(r, a, member, auditor, bool(passed), failed, at)
            )
        return out

    def count(self) -> int:
        return count_rows(self._db, "SELECT COUNT(*) FROM audit_verdicts")
