"""SecAgg+ (``secure_sum = "secagg"``): the SecAgg+ server state machine of
:mod:`fedsec.crypto.secagg`, over the stages advertise, share_keys, masked_input,
consistency and unmask; the aggregator learns only the survivors' sum."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedsec.crypto.quantize import RingVector
from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ConsistencyProof,
    ConsistencySignature,
    MaskedInput,
    RoundResult,
    ServerSession,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
    default_neighbors,
)
from fedsec.crypto.secagg.graph import default_threshold, max_degree
from fedsec.errors import RoundAborted
from fedsec.protocol import codec, wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.replay import feed_accepted
from fedsec.protocol.stages import SECAGG_STAGES, Stage
from fedsec.summation.group_worker import GroupWorker
from fedsec.summation.heap import release_free_heap
from fedsec.summation.mode import (
    SessionInputs,
    StageWindow,
    StoredAttempt,
    SummationMode,
    feed,
    upload_window,
)
from fedsec.summation.served_group import ServedGroup
from fedsec.summation.session import (
    StageMessage,
    SummationResult,
    SummationSession,
    log,
)
from fedsec.summation.settings import RoundSettings
from fedsec.summation.sharded import GroupSession, ShardedSession


class SecAggPlusSession(GroupSession):
    """SecAgg+ (Bell et al. 2020): the aggregator learns only the survivors' sum.

    Args:
        spec: the attempt's signed spec.
        roster_keys: member id -> Ed25519 public key, for the cohort.
        consistency: whether survivors sign the survivor sets before unmasking (every
            spec since graph commitments; False only to replay an attempt logged before).
        group: in a sharded attempt, the group this session sums
            (:class:`fedsec.summation.sharded.ShardedSession` holds one per group); its
            members are its cohort and only their keys are its roster.
    """

    def __init__(
        self,
        spec: wire.RoundSpec,
        roster_keys: Mapping[str, bytes],
        *,
        consistency: bool = True,
        group: int | None = None,
    ) -> None:
        super().__init__(spec)
        self.stages = tuple(s for s in SECAGG_STAGES if consistency or s != "consistency")
        params = spec.secagg_params(group)
        keys = {m: roster_keys[m] for m in params.cohort if m in roster_keys}
        self.server = ServerSession(params, keys, consistency=consistency)
        self._min_survivors = spec.dp.min_survivors if is_distributed(spec) else 0
        self._relays: dict[str, ShareRelay] = {}
        self._proofs: dict[str, ConsistencyProof] = {}
        # the key list every live member fetches, built once (fixed from share_keys on)
        self._key_list: wire.KeyListBody | None = None
        # the unmask request every survivor fetches, built once per state token
        self._unmask_body: wire.UnmaskRequestBody | None = None
        # the survivor sets as the lists every unmask request and consistency proof
        # holds, built once: the HTTP layer encodes a list object once, so each proof's
        # O(n) sets are neither copied nor encoded per survivor
        self._sets: tuple[UnmaskRequest, list[str], list[str]] | None = None

    def receive(self, stage: str, message: StageMessage) -> None:
        if stage == "advertise" and isinstance(message, AdvertiseKeys):
            self.server.receive_advertise(message)
        elif stage == "share_keys" and isinstance(message, ShareKeys):
            self.server.receive_share_keys(message)
        elif stage == "masked_input" and isinstance(message, MaskedInput):
            self.server.receive_masked_input(message)
        elif stage == "consistency" and isinstance(message, ConsistencySignature):
            self.server.receive_consistency(message)
        elif stage == "unmask" and isinstance(message, UnmaskResponse):
            self.server.receive_unmask(message)
        else:
            raise ValueError(f"not a {stage} message: {type(message).__name__}")

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        feed_accepted(self.server, stage, member, raw)

    def complete(self, stage: str) -> bool:
        # asked after every accepted message, so counts only (O(1)): each stage's members
        # are a subset of those it waits for (the server refuses anyone else), so equal
        # counts are equal sets
        s = self.server
        if stage == "advertise":
            return len(s.advertised) == len(s.params.cohort)
        if stage == "share_keys":
            return s.shared_count == len(s.live)
        if stage == "masked_input":
            return len(s.contributed) == len(s.participants)
        if stage == "consistency":
            return len(s.signatures) == len(s.survivors)
        if stage == "unmask":
            # every signer answered, or the answers so far already decide the sum
            return s.answered_count == len(s.signatures) or s.ready_to_finalize()
        return False

    def close(self, stage: str) -> None:
        if stage == "advertise":
            self.server.close_advertise()
        elif stage == "share_keys":
            self._relays = self.server.close_share_keys()
        elif stage == "masked_input":
            arrived, floor = len(self.server.contributed), self._min_survivors
            if arrived < floor:  # unmasking would release a sum with too little noise
                raise RoundAborted(
                    f"round {self.spec.round}: {arrived} masked inputs arrived, fewer than "
                    f"the {floor} survivors the distributed-DP noise is sized for"
                )
            self.server.close_masked_input()
        elif stage == "consistency":
            self._proofs = self.server.close_consistency()
        else:
            raise ValueError(f"stage {stage!r} is not closed by close()")

    def finalize(self) -> SummationResult:
        encoding = codec_for(self.spec)
        release_free_heap()  # what the round's inputs left free, before its peak
        # the sum is unmasked at the end of the vector it is decoded in, which the
        # decode overwrites: it is hashed first, and not held beside that vector
        space = encoding.decode_space()
        work, into = space if space is not None else (None, None)
        result = self.finalize_ring(into)
        # the ring sum's own buffer (contiguous, little-endian): no copy of it
        sum_sha256 = hashlib.sha256(result.ring_sum.data).hexdigest()
        weighted, weight, edges = encoding.decode_counted(
            result.ring_sum, len(result.survivors), work
        )
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=list(result.survivors),
            dropped=list(result.dropped),
            sum_sha256=sum_sha256,
            edge_count=edges,
        )

    def finalize_ring(self, into: RingVector | None = None) -> RoundResult:
        """End the unmask stage: the survivors' sum in the ring, not yet decoded (a
        sharded attempt adds its groups' ring sums before decoding once).

        Args:
            into: where to unmask the sum (:meth:`UpdateCodec.decode_space`'s ring
                vector); None: a vector of its own.

        Raises:
            RecoveryImpossible: a needed secret has fewer than t shares.
            ProtocolError: the shares are inconsistent with the advertised keys.
        """
        s = self.server
        log.info(
            "event=unmask_closed round=%d attempt=%d answered=%d survivors=%d",
            self.spec.round,
            self.spec.attempt,
            len(s.answered),
            len(s.survivors),
        )
        return s.finalize(into)

    def participant_count(self) -> int:
        return len(self.server.participants)

    def key_list(self, member: str) -> wire.KeyListBody:
        s = self.server
        if member not in s.live:
            return super().key_list(member)
        if self._key_list is None:
            # every advertisement: members derive the graph from all revealed nonces
            self._key_list = codec.key_list_body(a for _, a in sorted(s.advertised.items()))
        return self._key_list

    def share_relay(self, member: str) -> wire.ShareRelayBody:
        if member not in self._relays:
            return super().share_relay(member)
        return codec.share_relay_body(self._relays[member])

    def unmask_request(self, member: str, state_token: int) -> wire.UnmaskRequestBody:
        s = self.server
        if member not in s.survivors:
            return super().unmask_request(member, state_token)
        # every survivor is told the same sets: one body per state token, not a sort of
        # the cohort per survivor (O(n log n) each, O(n^2 log n) a round)
        body = self._unmask_body
        if body is None or body.state_token != state_token:
            survivors, dropped = self._survivor_lists(s.unmask_request())
            body = wire.UnmaskRequestBody(
                survivors=survivors, dropped=dropped, state_token=state_token
            )
            self._unmask_body = body
        return body

    def consistency_proof(self, member: str, state_token: int) -> wire.ConsistencyProofBody:
        if member not in self._proofs:
            return super().consistency_proof(member, state_token)
        proof = self._proofs[member]
        return codec.consistency_proof_body(proof, state_token, self._survivor_lists(proof.request))

    def _survivor_lists(self, request: UnmaskRequest) -> tuple[list[str], list[str]]:
        """``request``'s survivor and dropped sets as lists, the same objects for as
        long as the server's request is the same (sorted once, when masked input closed;
        fixed from then on)."""
        sets = self._sets
        if sets is None or sets[0] is not request:
            sets = self._sets = (request, list(request.survivors), list(request.dropped))
        return sets[1], sets[2]


_WINDOWS: dict[str, StageWindow] = {
    "advertise": lambda r, buffered: r.advertise_s,
    "share_keys": lambda r, buffered: r.share_s,
    "masked_input": upload_window,
    # two short exchanges of signatures and shares: each gets the unmask window
    "consistency": lambda r, buffered: r.unmask_s,
    "unmask": lambda r, buffered: r.unmask_s,
}


@dataclass(frozen=True)
class SecAggMode(SummationMode):
    """SecAgg+: a sum of two lets each member subtract its own update and read the
    other's, so at least three members; the neighbour graph is the spec's k and t."""

    name: str = "secagg"
    stages: tuple[Stage, ...] = SECAGG_STAGES
    windows: Mapping[str, StageWindow] = field(default_factory=lambda: dict(_WINDOWS))
    commits_graph: bool = True
    shards: bool = True
    # the masked input's answer is the unmask request, served once consistency begins
    held_answers: Mapping[str, Stage] = field(
        default_factory=lambda: {"masked_input": "consistency"}
    )

    def graph(self, n: int, r: RoundSettings) -> tuple[int, int]:
        if n < 3:
            return 0, 0
        auto_k, auto_t = default_neighbors(n)
        k = min(r.neighbors, n - 1) if r.neighbors else auto_k
        # the least t members accept by default (2t > degree + γ): a configured or
        # derived t below it would only have every member refuse the round
        floor = min(default_threshold(max_degree(n, k)), k)
        if r.threshold:
            return k, min(max(r.threshold, floor), k)
        return k, auto_t if not r.neighbors else floor

    def _open(self, spec: wire.RoundSpec, inputs: SessionInputs) -> SummationSession:
        return _session(spec, inputs, consistency=True, workers=inputs.shard_workers)

    def replay(self, spec: wire.RoundSpec, stored: StoredAttempt) -> SummationResult:
        # an attempt logged before the consistency stage existed carries no graph
        # commitments (both came in one protocol change) and no consistency message: its
        # unmask followed masked input
        self.check_rule(spec)
        signed = any(m.stage == "consistency" for m in stored.messages)
        consistency = bool(spec.graph_commitments) or signed
        session = _session(spec, stored.inputs, consistency=consistency)
        feed(session, stored.messages)
        return session.finalize()


def _session(
    spec: wire.RoundSpec, inputs: SessionInputs, *, consistency: bool, workers: bool = False
) -> SummationSession:
    """One session over the cohort, or one per group of a sharded spec (each in a worker
    process of its own with ``workers``, rebuilt from ``inputs.stored`` if it dies; read
    from the store, :class:`ServedGroup`, where the spec names the group's server and
    ``inputs.group_hosts`` is given)."""
    keys = inputs.keys
    if not spec.groups:
        return SecAggPlusSession(spec, keys, consistency=consistency)

    def open_group(i: int) -> GroupSession:
        inner: GroupSession
        if workers:
            inner = GroupWorker(
                SecAggPlusSession,
                spec,
                keys,
                consistency=consistency,
                group=i,
                stored=inputs.stored,
            )
        else:
            inner = SecAggPlusSession(spec, keys, consistency=consistency, group=i)
        hosts = inputs.group_hosts
        if spec.groups[i].url and hosts is not None:
            return ServedGroup(inner, spec, i, hosts)
        return inner

    return ShardedSession(spec, open_group)


SECAGG = SecAggMode()
