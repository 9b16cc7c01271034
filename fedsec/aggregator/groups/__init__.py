"""Group servers: shard groups whose stage requests other aggregator processes take
(``[round] group_servers``), over the leader's state store.

- :mod:`.hosts`: what leader and group servers share in the store: heartbeats, take-overs
  and the messages stored after a sequence number.
- :mod:`.desk`: a group server's intake: the attempt as the store holds it, its
  groups' sessions fed from the store, a message validated, then queued for its batch.
- :mod:`.batch`: group commit: the messages validated meanwhile archived, then stored,
  logged (and receipted) in one transaction that checks each attempt is still in the
  message's stage and the group still the server's; each answered after the commit.
- :mod:`.server`: the aiohttp application and the ``fedsec aggregator group-serve``
  process around it.

The leader's side is :class:`fedsec.summation.served_group.ServedGroup`.
"""
