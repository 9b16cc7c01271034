"""Sharded summation (``[round] shards = N``): one SecAgg+ session per group of the
cohort, behind the one session interface the round engine already drives.

The groups are the spec's (:mod:`fedsec.protocol.shards`: a split by the attempt's
signed seed that every member checks).  Each group's session is an ordinary
:class:`~fedsec.summation.secagg.SecAggPlusSession` whose cohort is the group: its
members advertise, share, mask and unmask among themselves only, and learn only their
group's keys, shares and survivor sets.  A message is routed by its sender to the
sender's group, and that group's session validates it as it would in a round of its own:
a share addressed across groups is a share to a non-neighbour, refused.

At the end each group unmasks its own ring sum (a dropout inside a group is that group's
unmask), and the groups' ring sums are added modulo the ring and decoded once: the
attempt's sum is bit for bit that of one session over the same members, and its hash is
the hash of that one ring sum.  Each group's ring sum is revealed to the aggregator; it
is a sum of at least ``round.min_shard_members`` updates (docs/threat-model.md), and with
distributed DP each carries the full noise on its own (docs/privacy.md).
"""

from __future__ import annotations

import hashlib
import math
from abc import abstractmethod
from collections.abc import Callable

from fedsec.crypto.secagg import RoundResult
from fedsec.errors import RoundAborted
from fedsec.protocol import wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.shards import group_index, is_group_url, split_cohort
from fedsec.summation.session import (
    GroupSum,
    StageMessage,
    SummationResult,
    SummationSession,
)
from fedsec.summation.settings import FederationSettings

#: Why a sharded round must be SecAgg+: its groups' ring sums add exactly, so the model is
#: that of one session; plain sums are float64 (their order changes the bits) and an HE
#: sum is one custodian decryption of one ciphertext sum.
SHARDED_MODES = ("secagg",)


class GroupSession(SummationSession):
    """A session that sums one group and can end in its ring sum, undecoded
    (:class:`fedsec.summation.secagg.SecAggPlusSession`)."""

    @abstractmethod
    def finalize_ring(self) -> RoundResult:
        """The group's survivors' sum in the ring.

        Raises:
            RoundAborted, RecoveryImpossible, ProtocolError: as finalize.
        """

    def start_finalize(self) -> Callable[[], RoundResult]:
        """Start :meth:`finalize_ring`; the returned call gives its result (or raises as
        it does).  A group in a worker process unmasks while the others do; here it runs
        when collected."""
        return self.finalize_ring


class ShardedSession(SummationSession):
    """The groups' SecAgg+ sessions as one (see the module docstring).

    Args:
        spec: the attempt's signed spec, whose ``groups`` are not empty.
        open_group: the session of the group of that index
            (:class:`~fedsec.summation.secagg.SecAggPlusSession` with ``group``).

    Raises:
        ProtocolError: the spec's groups are not the split its seed gives, or a group's
            parameters are invalid.
    """

    def __init__(self, spec: wire.RoundSpec, open_group: Callable[[int], GroupSession]) -> None:
        super().__init__(spec)
        self.groups = [open_group(i) for i in range(len(spec.groups))]
        self.stages = self.groups[0].stages
        self._group_of = {m: i for i, g in enumerate(spec.groups) for m in g.members}

    def group(self, member: str) -> GroupSession:
        """The session of ``member``'s group.

        Raises:
            UnknownMember: ``member`` is in no group (not in the cohort).
        """
        at = self._group_of.get(member)
        if at is None:
            at = group_index(self.spec.groups, member)  # raises, naming the member
        return self.groups[at]

    def receive(self, stage: str, message: StageMessage) -> None:
        member = getattr(message, "member", None)
        if not isinstance(member, str):
            raise ValueError(f"not a {stage} message of a SecAgg+ member: {message!r}")
        self.group(member).receive(stage, message)

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        self.group(member).replay(stage, member, raw)

    def complete(self, stage: str) -> bool:
        return all(g.complete(stage) for g in self.groups)

    def close(self, stage: str) -> None:
        """Raises: RoundAborted: a group has too few members left to go on (the attempt
        ends: its retry draws a new cohort and new groups)."""
        for index, g in enumerate(self.groups):
            try:
                g.close(stage)
            except RoundAborted as exc:
                raise RoundAborted(f"shard group {index}: {exc.detail}") from None

    def finalize(self) -> SummationResult:
        rings = []
        started = [g.start_finalize() for g in self.groups]  # workers unmask side by side
        for index, collect in enumerate(started):
            try:
                rings.append(collect())
            except RoundAborted as exc:
                raise RoundAborted(f"shard group {index}: {exc.detail}") from None
        total = rings[0].ring_sum.copy()
        for ring in rings[1:]:
            total += ring.ring_sum  # unsigned: wraps modulo 2^64, then the ring's mask
        quant = self.spec.quant_spec()
        total &= quant.dtype.type(quant.ring_mask)
        survivors = sorted(m for r in rings for m in r.survivors)
        weighted, weight, edges = codec_for(self.spec).decode_counted(total, len(survivors))
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=survivors,
            dropped=sorted(m for r in rings for m in r.dropped),
            sum_sha256=hashlib.sha256(total.data).hexdigest(),
            edge_count=edges,
            groups=tuple(
                GroupSum(r.survivors, r.dropped, hashlib.sha256(r.ring_sum.data).hexdigest())
                for r in rings
            ),
        )

    def participant_count(self) -> int:
        return sum(g.participant_count() for g in self.groups)

    # each member is relayed its own group's data only

    def key_list(self, member: str) -> wire.KeyListBody:
        return self.group(member).key_list(member)

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        return self.group(member).share_relay(member)

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        return self.group(member).unmask_request(member, state_token)

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        return self.group(member).consistency_proof(member, state_token)


def shard_groups(cohort: list[str], seed: str, shards: int) -> list[list[str]]:
    """The groups a spec with this cohort and seed carries (:func:`split_cohort`); one
    group, i.e. no sharding, when ``shards`` is 1 or the cohort is empty.

    Raises:
        ProtocolError: more shards than members.
    """
    if shards <= 1 or not cohort:
        return []
    return split_cohort(cohort, seed, shards)


def shard_problems(cfg: FederationSettings) -> list[str]:
    """``key: expected ..., got ...`` sentences for ``[round] shards`` and
    ``min_shard_members`` settings that cannot give every group a sum of its own.

    A cohort of at least ``min_agents`` split into ``shards`` groups has groups of at
    least ⌊min_agents / shards⌋ members, so that must reach ``min_shard_members``; with
    distributed DP each group's survivors must carry the full noise on their own, so the
    noise share of each member is sized for ⌈min_survivors_fraction × group⌉ survivors,
    and at least two (a sum of one is that member's update).
    """
    r = cfg.round
    if r.shards < 1:
        return [f"round.shards: expected an integer >= 1, got {r.shards}"]
    problems = [
        f"round.group_servers: expected http(s) base URLs (no query), got {url[:80]!r}"
        for url in r.group_servers
        if not is_group_url(url)
    ]
    if r.group_servers and r.shards == 1:
        problems.append(
            f"round.group_servers: expected none with shards = 1 (a group server serves "
            f"shard groups), got {len(r.group_servers)}"
        )
    if r.shards == 1:
        return problems
    if r.secure_sum not in SHARDED_MODES:
        problems.append(
            f"round.shards: expected 1 with secure_sum = {r.secure_sum!r} (groups' sums add "
            f"exactly only in SecAgg+'s ring: secure_sum = 'secagg'), got {r.shards}"
        )
    if r.mode != "sync":
        problems.append(
            f"round.shards: expected 1 with round.mode = {r.mode!r} (a buffered aggregate "
            f"has no cohort fixed in advance to split), got {r.shards}"
        )
    least = 3  # SecAgg+: a sum of two lets each member read the other's update
    if r.min_shard_members < least:
        problems.append(
            f"round.min_shard_members: expected an integer >= {least}, got {r.min_shard_members}"
        )
    smallest = r.min_agents // r.shards
    if smallest < r.min_shard_members:
        problems.append(
            f"round.min_agents: expected >= shards × min_shard_members = "
            f"{r.shards} × {r.min_shard_members} = {r.shards * r.min_shard_members} (the "
            f"smallest cohort's groups must each hold min_shard_members), got {r.min_agents}"
        )
    dp = cfg.dp
    if dp.enabled and dp.mode == "distributed":
        survivors = group_min_survivors(dp.min_survivors_fraction, r.min_shard_members)
        if survivors < 2:
            problems.append(
                f"round.min_shard_members: each group's sum must carry the full noise on its "
                f"own; ⌈dp.min_survivors_fraction × min_shard_members⌉ = "
                f"⌈{dp.min_survivors_fraction} × {r.min_shard_members}⌉ = {survivors} "
                f"survivor(s) would size one member's share as the whole noise, expected >= 2"
            )
    return problems


def group_min_survivors(fraction: float, group: int) -> int:
    """The survivors a group's noise is sized for: ⌈fraction × group⌉, at least 1."""
    return max(1, math.ceil(fraction * group))
