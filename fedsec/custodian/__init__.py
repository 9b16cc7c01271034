"""The key custodian: holds the federation's CKKS secret key and decrypts only aggregates.

A party the consortium names (not the aggregator's operator; for instance the auditor's
organisation) runs ``fedsec custodian init`` once to make its identity and the
federation's key pair, and ``fedsec custodian serve`` to publish the signed public
context and decrypt, round by round, the sum the aggregator offers, once the
transparency log proves it is the sum of at least ``min_agents`` distinct accepted
contributions, each once (docs/threat-model.md says what that protects and what not).

Modules, read top to bottom: :mod:`.follow` (the verified log, read incrementally),
:mod:`.check` (the decision, sans-I/O), :mod:`.store` (the custodian's directory and its
append-only decision log), :mod:`.service` (the I/O loop) and :mod:`.cli`.
"""
