"""The SQL repositories both backends share: each concern's store written once, in the
SQL that SQLite (3.24 or later) and PostgreSQL both accept, over a :class:`SqlDb`
that each backend provides (:mod:`fedsec.aggregator.storage.sqlite`,
:mod:`fedsec.aggregator.storage.postgres`)."""

from fedsec.aggregator.storage.sql.db import Params, Row, SqlDb

__all__ = ["Params", "Row", "SqlDb"]
