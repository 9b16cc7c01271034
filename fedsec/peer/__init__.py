"""Decentralised mode: members train together with no aggregator (docs/decentralised.md).

:mod:`~fedsec.peer.gossip` is the sans-I/O state machine of one peer's rounds;
:mod:`~fedsec.peer.messages` the one message peers exchange; :mod:`~fedsec.peer.topology`
who a peer's neighbours are; :mod:`~fedsec.peer.journal` the hash-chained record of what
a peer sent and received (its format is :mod:`fedsec.protocol.peer_journal`'s);
:mod:`~fedsec.peer.catchup` how a returning peer rejoins from its neighbours' signed
offers; :mod:`~fedsec.peer.http` the aiohttp endpoint and client that only move bytes;
:mod:`~fedsec.peer.privacy` what each round's training costs in the member's privacy
ledger (the agent's); :mod:`~fedsec.peer.runner` one peer's loop of rounds.
"""
