"""The shared kernel: what agent, aggregator and auditor agree on, with no I/O.

``stages`` (the round's stages and their order), ``limits`` (each bound once, with its
reason), ``wire`` (the signed message structs and their strict decoding), ``codec``
(wire bodies <-> SecAgg+ messages, both directions) and ``replay`` (stored messages
-> a server session, for crash resume and ``audit verify`` alike).  Imports only
:mod:`fedsec.crypto` and :mod:`fedsec.errors`.
"""
