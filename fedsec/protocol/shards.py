"""Sharded summation: a round's cohort split into groups, each summed by its own SecAgg+
session, whose ring sums the aggregator adds (Bonawitz et al. 2019, "Towards federated
learning at scale": groups of hundreds of devices, a master adding their sums).

The split is a function of the signed spec alone (:func:`split_cohort`: the round's
per-attempt seed and the cohort), so every member checks that the groups its spec names
are the ones the seed gives (:func:`check_groups`) and the aggregator cannot place
members by hand.  A member is told only its own group: its SecAgg+ parameters
(:meth:`fedsec.protocol.spec.RoundSpec.secagg_params` with the group's index) hold the
group as the cohort, the group's k and t, and the group's graph commitments, so its
neighbour graph, its shares and its masks never leave the group.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import msgspec

from fedsec.errors import ProtocolError, UnknownMember
from fedsec.protocol.body import Count

_SHARD_DOMAIN = b"fedsec/v1/shard"
#: A group server's base URL as a spec may carry it: scheme, host[:port], an optional
#: path prefix; no query, fragment or credentials (members sign the path they send to).
_GROUP_URL = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?")


class ShardGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One group of a sharded attempt: its members (sorted), its neighbour graph's k and
    t (the mode's choice for a cohort of the group's size) and, when a group server
    serves its stage requests (``round.group_servers``), that server's base URL: the
    signed spec is the only place a member learns it, so no unsigned redirect can send
    its messages elsewhere.  Empty: the leader serves the group (and the spec encodes
    as it did before group servers)."""

    members: list[str]
    neighbors: Count
    threshold: Count
    url: str = ""


def split_cohort(cohort: Sequence[str], seed: str, shards: int) -> list[list[str]]:
    """The groups of ``cohort`` for an attempt with ``seed``: members ordered by
    SHA-256(domain ‖ seed ‖ member) and dealt round-robin, so group sizes differ by at
    most one; each group sorted.

    Args:
        cohort: the attempt's cohort (sorted, as the spec holds it).
        seed: the spec's seed (hex, 32 bytes), fresh for every attempt.
        shards: how many groups, 1..len(cohort).

    Raises:
        ProtocolError: ``shards`` outside 1..len(cohort), or a seed that is not hex.
    """
    if not 1 <= shards <= max(len(cohort), 1):
        raise ProtocolError(f"{shards} shards for a cohort of {len(cohort)}")
    try:
        key = bytes.fromhex(seed)
    except ValueError:
        raise ProtocolError("round seed is not hex") from None
    order = sorted(cohort, key=lambda m: hashlib.sha256(_SHARD_DOMAIN + key + m.encode()).digest())
    return [sorted(order[i::shards]) for i in range(shards)]


def check_groups(cohort: Sequence[str], seed: str, groups: Sequence[ShardGroup]) -> None:
    """Raises ProtocolError: ``groups`` are not the split of ``cohort`` that ``seed``
    gives (a member moved, added or left out), or a group's k and t do not fit it."""
    expected = split_cohort(cohort, seed, len(groups))
    for index, (group, members) in enumerate(zip(groups, expected, strict=True)):
        if group.members != members:
            raise ProtocolError(
                f"shard group {index} is not the one the round's seed gives: "
                f"{len(group.members)} members named, {len(members)} expected"
            )
        if group.url and not is_group_url(group.url):
            raise ProtocolError(
                f"shard group {index}'s server URL is not an http(s) base URL: {group.url[:80]!r}"
            )
        n = len(members)
        if not (2 <= group.neighbors <= n - 1 and 1 <= group.threshold <= group.neighbors):
            raise ProtocolError(
                f"shard group {index} of {n} members has k = {group.neighbors}, "
                f"t = {group.threshold}"
            )


def is_group_url(url: str) -> bool:
    """Whether ``url`` is a group server's base URL a spec may carry."""
    return _GROUP_URL.fullmatch(url) is not None


def group_url(urls: Sequence[str], index: int) -> str:
    """The server of group ``index`` among ``urls`` (``round.group_servers``): dealt
    round-robin, so N servers serve ⌈groups / N⌉ groups at most; "" (the leader) when
    there are none."""
    return urls[index % len(urls)].rstrip("/") if urls else ""


def group_index(groups: Sequence[ShardGroup], member: str) -> int:
    """The index of the group holding ``member``.

    Raises:
        UnknownMember: no group holds it.
    """
    for index, group in enumerate(groups):
        if member in group.members:
            return index
    raise UnknownMember(f"{member} is in no shard group of this round")
