"""The replicated implementation of :mod:`fedsec.aggregator.storage`: PostgreSQL through
psycopg 3, with versioned schema migrations (:mod:`.schema`)."""

from fedsec.aggregator.storage.postgres.schema import LATEST, MIGRATIONS, migrate, schema_version
from fedsec.aggregator.storage.postgres.store import PostgresStateStore

__all__ = ["LATEST", "MIGRATIONS", "PostgresStateStore", "migrate", "schema_version"]
