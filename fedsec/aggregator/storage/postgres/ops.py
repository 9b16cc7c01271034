"""What operations keep in PostgreSQL: alerts (table ``alerts``), the observers' bearer
tokens (``access_tokens``) and auditors' verdicts (``audit_verdicts``)."""

from __future__ import annotations

from typing import Any

from fedsec.aggregator.storage.interfaces import AlertRow, TokenRow, VerdictRow
from fedsec.aggregator.storage.postgres.connection import PostgresConnection

_ALERT_COLUMNS = "id, kind, subject, detail, raised_at, acked_at, acked_by, ack_sha256"


class PostgresAlerts:
    """:class:`~fedsec.aggregator.storage.interfaces.AlertStore` in table ``alerts``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, kind: str, subject: str, detail: str, now: float, ack_sha256: str) -> int:
        cur = self._conn.write(
            "INSERT INTO alerts (kind, subject, detail, raised_at, ack_sha256) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING id",
            (kind, subject, detail, now, ack_sha256),
        )
        row = cur.fetchone()
        assert row is not None
        return int(row[0])

    def get(self, alert_id: int) -> AlertRow | None:
        row = self._conn.read(
            f"SELECT {_ALERT_COLUMNS} FROM alerts WHERE id=%s", (alert_id,)
        ).fetchone()
        return AlertRow(*row) if row else None

    def open_of(self, kind: str, subject: str) -> AlertRow | None:
        row = self._conn.read(
            f"SELECT {_ALERT_COLUMNS} FROM alerts WHERE kind=%s AND subject=%s "
            "AND acked_at IS NULL ORDER BY id DESC LIMIT 1",
            (kind, subject),
        ).fetchone()
        return AlertRow(*row) if row else None

    def recent(self, limit: int = 200) -> list[AlertRow]:
        rows = self._conn.read(
            f"SELECT {_ALERT_COLUMNS} FROM alerts ORDER BY id DESC LIMIT %s", (limit,)
        ).fetchall()
        return [AlertRow(*r) for r in rows]

    def count_open(self) -> dict[str, int]:
        rows = self._conn.read(
            "SELECT kind, COUNT(*) FROM alerts WHERE acked_at IS NULL GROUP BY kind"
        ).fetchall()
        return {str(k): int(n) for k, n in rows}

    def ack(self, alert_id: int, by: str, now: float) -> bool:
        cur = self._conn.write(
            "UPDATE alerts SET acked_at=%s, acked_by=%s WHERE id=%s AND acked_at IS NULL",
            (now, by, alert_id),
        )
        return cur.rowcount == 1


class PostgresTokens:
    """:class:`~fedsec.aggregator.storage.interfaces.TokenStore` in table
    ``access_tokens``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, row: TokenRow) -> None:
        self._conn.write(
            "INSERT INTO access_tokens VALUES (%s, %s, %s, %s, %s, %s)",
            (row.sha256, row.observer, row.scope, row.issued_at, row.expires_at, row.revoked),
        )

    def get(self, sha256: str) -> TokenRow | None:
        row = self._conn.read("SELECT * FROM access_tokens WHERE sha256=%s", (sha256,)).fetchone()
        return _token(row) if row else None

    def all(self) -> list[TokenRow]:
        rows = self._conn.read("SELECT * FROM access_tokens ORDER BY issued_at DESC").fetchall()
        return [_token(r) for r in rows]

    def revoke(self, sha256: str) -> bool:
        cur = self._conn.write("UPDATE access_tokens SET revoked=true WHERE sha256=%s", (sha256,))
        return cur.rowcount == 1


def _token(row: Any) -> TokenRow:
    sha, observer, scope, issued, expires, revoked = row
    return TokenRow(
        str(sha), str(observer), str(scope), float(issued), float(expires), bool(revoked)
    )


class PostgresVerdicts:
    """:class:`~fedsec.aggregator.storage.interfaces.VerdictStore` in table
    ``audit_verdicts``."""

    def __init__(self, conn: PostgresConnection) -> None:
        self._conn = conn

    def add(self, row: VerdictRow) -> bool:
        cur = self._conn.write(
            "INSERT INTO audit_verdicts VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
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
        return cur.rowcount == 1

    def by_member(self) -> dict[str, list[VerdictRow]]:
        out: dict[str, list[VerdictRow]] = {}
        rows = self._conn.read(
            "SELECT * FROM audit_verdicts ORDER BY round, attempt, auditor"
        ).fetchall()
        for r, a, member, auditor, passed, failed, at in rows:
            out.setdefault(member, []).append(
                VerdictRow(r, a, member, auditor, bool(passed), failed, at)
            )
        return out

    def count(self) -> int:
        return self._conn.count("SELECT COUNT(*) FROM audit_verdicts")
