"""The data owner's records: sources, column rules, the data map and the data summary.

Used by the agent (and the ``fedsec agent inventory`` command); the aggregator needs
none of it, only the schema and summary types of :mod:`fedsec.protocol.data_schema`
and :class:`fedsec.protocol.wire.DataSummary`.  Imports errors, fsio and protocol only.
"""
