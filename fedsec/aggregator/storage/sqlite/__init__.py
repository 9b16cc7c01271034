"""The embedded implementation of :mod:`fedsec.aggregator.storage`: SQLite in WAL mode."""

from fedsec.aggregator.storage.sqlite.connection import SCHEMA
from fedsec.aggregator.storage.sqlite.store import SqliteStateStore

__all__ = ["SCHEMA", "SqliteStateStore"]
