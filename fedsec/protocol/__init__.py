"""The shared kernel: what agent, aggregator and auditor agree on, with no I/O.

``stages`` (the round's stages and their order), ``limits`` (each bound once, with its
reason), ``wire`` (the signed message structs and their strict decoding), ``codec``
(wire bodies <-> SecAgg+ messages, both directions), ``replay`` (stored messages
-> a server session, for crash resume and ``audit verify`` alike), ``roster``
(admin-signed roster entries and their verification), ``log`` and ``log_entries`` (the
transparency-log format, chain and signed heads, and one typed struct per entry kind)
and ``endpoints`` (the one endpoint table from which the aggregator's routes, its
OpenAPI document and docs/api.md are generated).  Imports only :mod:`fedsec.crypto`
and :mod:`fedsec.errors`.
"""
