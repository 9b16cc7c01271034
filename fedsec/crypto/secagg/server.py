"""The aggregator's side of one SecAgg+ round, as a sans-I/O state machine.

Stages: ``advertise`` -> ``share_keys`` -> ``masked_input`` -> ``consistency`` ->
``unmask`` -> ``done``.  ``receive_*`` methods validate one member's message completely
before changing any state, so a refused message leaves the session exactly as
it was.  ``close_*`` methods end a stage (on deadline or when everyone has
answered) and return what must be sent to the members for the next one.

Dropouts at every stage:
- advertise: members that did not advertise are left out before any share is
  made (and so are members left with fewer than t live neighbours);
- share keys: members that did not share are left out of the participants,
  nobody masks with them;
- masked input: a participant whose input never arrived is *dropped*; its
  neighbours reveal shares of its mask key so its pairwise masks can be removed;
- consistency: a survivor that does not sign stays a survivor (its input is in the
  sum); its neighbours may lack the signatures they need, and then unmask names
  the secrets that went short;
- unmask: fine while every needed secret still has t shares; otherwise
  :class:`RecoveryImpossible` names the members whose secrets are short and the
  holders that did not answer.  The stage need not wait for every survivor:
  :meth:`ServerSession.ready_to_finalize` says when the answers so far already
  decide the sum (t + 1 shares of every needed secret, so reconstruction still
  checks one share against the others), e.g. when a survivor died after sending
  its masked input.

The masked inputs are added into one running sum as they arrive, so memory is
O(d) whatever the cohort size.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from fedsec.crypto import shamir
from fedsec.crypto.envelope import NONCE_BYTES, TAG_BYTES, KeyAgreementKey
from fedsec.crypto.errors import (
    DuplicateMessage,
    InvalidKeyList,
    MisaddressedShare,
    ProtocolError,
    RecoveryImpossible,
    RoundAborted,
    ShamirError,
    SignatureError,
    UnknownMember,
    WrongStage,
)
from fedsec.crypto.identity import PublicIdentity
from fedsec.crypto.quantize import RingSum, RingVector
from fedsec.crypto.secagg import masks
from fedsec.crypto.secagg.client import verify_advertisement
from fedsec.crypto.secagg.graph import member_x, prune, round_graph
from fedsec.crypto.secagg.messages import (
    CONSISTENCY_DOMAIN,
    AdvertiseKeys,
    ConsistencyProof,
    ConsistencySignature,
    EncryptedShare,
    KeyList,
    MaskedInput,
    SecAggParams,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
)

SHARE_CIPHERTEXT_BYTES = NONCE_BYTES + 2 * shamir.SHARE_BYTES + TAG_BYTES


class ServerStage(enum.Enum):
    ADVERTISE = "advertise"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The unmasked sum of the survivors' encoded inputs, and who is in it.

    Only the ring sum: what its elements mean (plain quantization, a rotated and
    sparsified or a distributed-DP encoding) is the caller's to decode with the round's
    codec (:func:`~fedsec.crypto.quantize.dequantize_sum` for plain quantization)."""

    ring_sum: RingVector
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


class ServerSession:
    """The aggregator in one round.

    Args:
        params: the round's parameters.
        roster: member id -> Ed25519 public key (to refuse forged advertisements early).
        consistency: whether the round has the consistency stage.  False only to replay
            a round logged before it existed (``fedsec audit verify`` of an old log):
            unmask then follows masked input directly.  Members enforce the check
            themselves (they unmask only on their neighbours' signatures), so this changes
            nothing a live aggregator could exploit.
    """

    def __init__(
        self, params: SecAggParams, roster: Mapping[str, bytes], *, consistency: bool = True
    ) -> None:
        self.params = params
        self._consistency = consistency
        self._roster = roster
        self.graph = round_graph(params.cohort, params.neighbors, params.seed)
        self._x = member_x(params.cohort)
        self.stage = ServerStage.ADVERTISE
        self.advertised: dict[str, AdvertiseKeys] = {}
        self._used_keys: set[bytes] = set()  # every public key advertised so far
        self.live: frozenset[str] = frozenset()  # U1: kept after advertise
        self._shares: dict[str, ShareKeys] = {}
        self.participants: frozenset[str] = frozenset()  # U2: completed share keys
        self.contributed: list[str] = []  # U3 in arrival order
        self._contributed: set[str] = set()  # the same, to look a member up in O(1)
        self._sum = RingSum(params.vector_length, params.quant.ring_bits)
        self.survivors: frozenset[str] = frozenset()
        self.dropped: frozenset[str] = frozenset()
        self._request = UnmaskRequest((), ())  # fixed when masked input closes
        # survivor -> its signature on (survivors, dropped), checked on arrival
        self.signatures: dict[str, ConsistencySignature] = {}
        self._survivors_signed = b""  # set when masked input closes
        self._responses: set[str] = set()
        # owner -> shares revealed so far, filled as unmask answers arrive
        self._seed_shares: dict[str, list[shamir.Share]] = {}
        self._key_shares: dict[str, list[shamir.Share]] = {}
        # (mask key?, owner) -> shares wanted, for every secret finalize needs, and how
        # many of them have fewer so far: set when masked input closes, the count kept as
        # answers arrive (ready_to_finalize is asked after each one: a scan was O(n))
        self._needed: dict[tuple[bool, str], int] = {}
        self._short = 0

    @property
    def shared(self) -> frozenset[str]:
        """Members whose shares were accepted in the share-keys stage (so far)."""
        return (
            frozenset(self._shares) if self.stage is ServerStage.SHARE_KEYS else self.participants
        )

    @property
    def shared_count(self) -> int:
        """``len(shared)`` without building the set: asked after every accepted message."""
        return len(self._shares) if self.stage is ServerStage.SHARE_KEYS else len(self.participants)

    @property
    def answered(self) -> frozenset[str]:
        """Survivors whose unmask answers were accepted."""
        return frozenset(self._responses)

    @property
    def answered_count(self) -> int:
        """``len(answered)`` without building the set: asked after every accepted message."""
        return len(self._responses)

    def ready_to_finalize(self) -> bool:
        """True once the unmask answers so far decide the sum: every secret
        :meth:`finalize` needs (each survivor's self-mask seed, the mask key of each
        dropped member that left pairwise masks) has t + 1 shares, or the share of every
        surviving holder when only t hold it.

        Any t consistent shares rebuild the same secret, so the sum is the one every
        survivor's answers would give; and reconstruction still checks one more share
        against the t it reads, so an inconsistent share is refused, not summed.  False
        while a needed secret has fewer than t shares: then only the remaining answers,
        or the deadline, can end the stage.
        """
        return self.stage is ServerStage.UNMASK and self._short == 0

    # -- helpers -----------------------------------------------------------------------------

    def _expect(self, stage: ServerStage, member: str) -> None:
        if self.stage is not stage:
            raise WrongStage(
                f"{stage.value} message from {member!r} refused: the round is in stage "
                f"{self.stage.value}"
            )

    def _abort_if_short(self, kept: frozenset[str], stage: str) -> None:
        if len(kept) < max(self.params.threshold, 2) + 1:
            missing = sorted(set(self.params.cohort) - kept)
            raise RoundAborted(
                f"round {self.params.round} aborted after {stage}: {len(kept)} members remain, "
                f"need at least {max(self.params.threshold, 2) + 1}; missing: {missing}"
            )

    # -- stage 1: advertise keys ---------------------------------------------------------------

    def receive_advertise(self, msg: AdvertiseKeys) -> None:
        """Accept one member's signed keys.

        Raises:
            WrongStage, UnknownMember, DuplicateMessage, InvalidKeyList.
        """
        self._expect(ServerStage.ADVERTISE, msg.member)
        if msg.member not in self._x:
            raise UnknownMember(f"{msg.member!r} is not in the cohort of round {self.params.round}")
        if msg.member in self.advertised:
            raise DuplicateMessage(f"{msg.member!r} already advertised keys")
        verify_advertisement(msg, self.params, self._roster)
        if msg.mask_public in self._used_keys or msg.enc_public in self._used_keys:
            raise InvalidKeyList(f"{msg.member!r} advertised keys already used by another member")
        self.advertised[msg.member] = msg
        self._used_keys.update((msg.mask_public, msg.enc_public))

    def close_advertise(self) -> KeyList:
        """End stage 1: fix the neighbour graph from the advertised graph nonces, keep
        members with enough live neighbours, return every advertisement (members derive
        the same graph from them, and the same live members).

        Raises:
            RoundAborted: too few members remain.
        """
        self._expect(ServerStage.ADVERTISE, "(close)")
        p = self.params
        graph = round_graph(p.cohort, p.neighbors, p.graph_seed(self.advertised.values()))
        live = prune(graph, self.advertised, p.threshold)
        self._abort_if_short(live, "advertise keys")
        self.graph = graph
        self.live = live
        self.stage = ServerStage.SHARE_KEYS
        return KeyList(tuple(self.advertised[m] for m in sorted(self.advertised)))

    # -- stage 2: share keys -----------------------------------------------------------------

    def receive_share_keys(self, msg: ShareKeys) -> None:
        """Accept one member's encrypted shares: exactly one per live neighbour.

        Raises:
            WrongStage, UnknownMember, DuplicateMessage, MisaddressedShare, ProtocolError.
        """
        self._expect(ServerStage.SHARE_KEYS, msg.member)
        if msg.member not in self.live:
            raise UnknownMember(f"{msg.member!r} is not a live member of round {self.params.round}")
        if msg.member in self._shares:
            raise DuplicateMessage(f"{msg.member!r} already sent its shares")
        expected = set(self.graph.live_neighbors(msg.member, self.live))
        seen: set[str] = set()
        for share in msg.shares:
            if share.sender != msg.member:
                raise MisaddressedShare(f"{msg.member!r} sent a share claiming {share.sender!r}")
            if share.recipient not in expected:
                raise MisaddressedShare(
                    f"{msg.member!r} addressed a share to {share.recipient!r}, not a live neighbour"
                )
            if share.recipient in seen:
                raise DuplicateMessage(f"{msg.member!r} sent two shares to {share.recipient!r}")
            if len(share.ciphertext) != SHARE_CIPHERTEXT_BYTES:
                raise ProtocolError(
                    f"share from {msg.member!r} to {share.recipient!r} is "
                    f"{len(share.ciphertext)} bytes, expected {SHARE_CIPHERTEXT_BYTES}"
                )
            seen.add(share.recipient)
        if seen != expected:
            raise ProtocolError(
                f"{msg.member!r} sent no share to live neighbours {sorted(expected - seen)}"
            )
        self._shares[msg.member] = msg

    def close_share_keys(self) -> dict[str, ShareRelay]:
        """End stage 2: fix the participants, return each one's incoming shares.

        Raises:
            RoundAborted: too few members remain.
        """
        self._expect(ServerStage.SHARE_KEYS, "(close)")
        participants = prune(self.graph, self._shares, self.params.threshold)
        self._abort_if_short(participants, "share keys")
        inbox: dict[str, list[EncryptedShare]] = {m: [] for m in participants}
        for sender in sorted(participants):
            for share in self._shares[sender].shares:
                if share.recipient in participants:
                    inbox[share.recipient].append(share)
        self.participants = participants
        self._shares = {}  # relayed: the server keeps no ciphertext it cannot use
        self.stage = ServerStage.MASKED_INPUT
        ordered = tuple(sorted(participants))
        return {m: ShareRelay(m, ordered, tuple(inbox[m])) for m in ordered}

    # -- stage 3: masked input ---------------------------------------------------------------

    def receive_masked_input(self, msg: MaskedInput) -> None:
        """Validate and add one masked input into the running sum.

        Raises:
            WrongStage, UnknownMember, DuplicateMessage, BadVector.
        """
        self._expect(ServerStage.MASKED_INPUT, msg.member)
        if msg.member not in self.participants:
            raise UnknownMember(f"{msg.member!r} is not a participant of round {self.params.round}")
        if msg.member in self._contributed:
            raise DuplicateMessage(f"{msg.member!r} already sent its masked input")
        # checked whole (length, padding) before any element is added
        self._sum.add(msg.vector)
        self.contributed.append(msg.member)
        self._contributed.add(msg.member)

    def close_masked_input(self) -> UnmaskRequest:
        """End stage 3: survivors are the members whose input arrived.

        Raises:
            RoundAborted: fewer survivors than needed.
        """
        self._expect(ServerStage.MASKED_INPUT, "(close)")
        survivors = frozenset(self.contributed)
        self._abort_if_short(survivors, "masked input")
        self.survivors = survivors
        self.dropped = self.participants - survivors
        self._request = UnmaskRequest(tuple(sorted(survivors)), tuple(sorted(self.dropped)))
        # (mask key?, owner, shares wanted) for every secret finalize needs: t + 1 when
        # that many survivors hold it, so one share can be checked, else all holders (at
        # least t: with fewer holders the secret is lost and only the deadline ends it)
        t = self.params.threshold
        needed = {}
        for key_share, owners in ((False, survivors), (True, self.dropped)):
            for owner in sorted(owners):
                holders = len(self.graph.live_neighbors(owner, survivors))
                if key_share and not holders:
                    continue  # dropped with no surviving neighbour: it left no pairwise mask
                needed[(key_share, owner)] = max(t, min(t + 1, holders))
        self._needed = needed
        self._short = len(needed)
        self.stage = ServerStage.CONSISTENCY if self._consistency else ServerStage.UNMASK
        # what every survivor signs: built once, not once per signature (O(n) each)
        self._survivors_signed = ConsistencySignature.signed_bytes(
            self.params.digest(), self.unmask_request()
        )
        return self.unmask_request()

    def unmask_request(self) -> UnmaskRequest:
        """The survivor sets every survivor is told and signs (fixed from consistency on;
        empty before)."""
        return self._request

    # -- stage 4: consistency ----------------------------------------------------------------

    def receive_consistency(self, msg: ConsistencySignature) -> None:
        """Accept one survivor's signature on the survivor sets.

        Raises:
            WrongStage, UnknownMember, DuplicateMessage, SignatureError: the signature
                is not the member's on this attempt's sets.
        """
        self._expect(ServerStage.CONSISTENCY, msg.member)
        if msg.member not in self.survivors:
            raise UnknownMember(f"{msg.member!r} is not a survivor of round {self.params.round}")
        if msg.member in self.signatures:
            raise DuplicateMessage(f"{msg.member!r} already signed the survivor sets")
        try:
            PublicIdentity(self._roster[msg.member]).verify(
                CONSISTENCY_DOMAIN, self._survivors_signed, msg.signature
            )
        except SignatureError:
            raise SignatureError(
                f"consistency signature of {msg.member!r} does not verify on the survivor "
                f"sets of round {self.params.round}"
            ) from None
        self.signatures[msg.member] = msg

    def close_consistency(self) -> dict[str, ConsistencyProof]:
        """End stage 4: each survivor's proof carries its neighbours' signatures.

        Raises:
            RoundAborted: fewer survivors signed than a threshold of shares needs.
        """
        self._expect(ServerStage.CONSISTENCY, "(close)")
        self._abort_if_short(frozenset(self.signatures), "consistency")
        self.stage = ServerStage.UNMASK
        return {m: self.consistency_proof(m) for m in sorted(self.signatures)}

    def consistency_proof(self, member: str) -> ConsistencyProof:
        """The signatures of ``member``'s neighbours on the survivor sets, for unmask."""
        return ConsistencyProof(
            member,
            self.unmask_request(),
            tuple(
                self.signatures[m]
                for m in sorted(self.graph.neighbors(member))
                if m in self.signatures
            ),
        )

    # -- stage 5: unmask ---------------------------------------------------------------------

    def receive_unmask(self, msg: UnmaskResponse) -> None:
        """Accept one survivor's shares: exactly those the request asked of it.

        Raises:
            WrongStage, UnknownMember, DuplicateMessage, ProtocolError.
        """
        self._expect(ServerStage.UNMASK, msg.member)
        if msg.member not in (self.signatures if self._consistency else self.survivors):
            raise UnknownMember(
                f"{msg.member!r} did not sign the survivor sets of round {self.params.round}"
            )
        if msg.member in self._responses:
            raise DuplicateMessage(f"{msg.member!r} already answered unmask")
        neighbours = self.graph.neighbors(msg.member)
        want_seed = {m for m in neighbours if m in self.survivors}
        want_key = {m for m in neighbours if m in self.dropped}
        got_seed = [m for m, _ in msg.seed_shares]
        got_key = [m for m, _ in msg.key_shares]
        if sorted(got_seed) != sorted(want_seed) or sorted(got_key) != sorted(want_key):
            raise ProtocolError(
                f"unmask answer of {msg.member!r} does not hold exactly the requested shares"
            )
        x = self._x[msg.member]
        parsed: list[tuple[dict[str, list[shamir.Share]], str, shamir.Share]] = []
        for store, pairs in (
            (self._seed_shares, msg.seed_shares),
            (self._key_shares, msg.key_shares),
        ):
            for owner, raw in pairs:
                try:
                    share = shamir.Share.from_bytes(raw)
                except ShamirError as exc:
                    raise ProtocolError(f"unmask answer of {msg.member!r}: {exc}") from None
                if share.x != x:
                    raise ProtocolError(
                        f"unmask answer of {msg.member!r} carries another x-coordinate"
                    )
                parsed.append((store, owner, share))
        for store, owner, share in parsed:
            shares = store.setdefault(owner, [])
            shares.append(share)
            # one share per answer, so each secret reaches its wanted count once
            if len(shares) == self._needed.get((store is self._key_shares, owner), 0):
                self._short -= 1
        self._responses.add(msg.member)

    def _recover(self, owner: str, key_share: bool) -> bytes:
        shares = (self._key_shares if key_share else self._seed_shares).get(owner, [])
        if len(shares) < self.params.threshold:
            holders = set(self.graph.neighbors(owner)) & self.survivors
            silent = tuple(sorted(holders - self._responses))
            what = "mask key" if key_share else "self-mask seed"
            raise RecoveryImpossible(
                f"cannot recover the {what} of {owner!r}: {len(shares)} of "
                f"{self.params.threshold} shares arrived; silent holders: {list(silent)}",
                missing=silent,
            )
        try:
            return shamir.reconstruct(shares, self.params.threshold)
        except ShamirError as exc:
            raise ProtocolError(f"shares of {owner!r} are inconsistent: {exc}") from None

    def finalize(self, into: RingVector | None = None) -> RoundResult:
        """Reconstruct the needed secrets and remove every mask.

        Args:
            into: a zeroed ring vector of the input length for the sum (its decoder's
                placement, :meth:`fedsec.crypto.quantize.RingSum.take`); None: a new one.

        Raises:
            WrongStage: not in the unmask stage.
            RecoveryImpossible: a needed secret has fewer than t shares.
            ProtocolError: shares are inconsistent with the advertised keys.
            ValueError: ``into`` is not a zeroed vector of the input length and dtype.
        """
        self._expect(ServerStage.UNMASK, "(finalize)")
        p = self.params
        seeds = {m: self._recover(m, key_share=False) for m in sorted(self.survivors)}
        # a dropped member with no surviving neighbour left no pairwise mask in the sum
        keys = {
            m: self._recover(m, key_share=True)
            for m in sorted(self.dropped)
            if self.graph.live_neighbors(m, self.survivors)
        }
        for member, secret in keys.items():
            if KeyAgreementKey(secret).public_bytes != self.advertised[member].mask_public:
                raise ProtocolError(
                    f"reconstructed mask key of {member!r} does not match its advertised key"
                )
        # the running sum ends here: its accumulator is not held beside the decode's
        total = self._sum.take(into)
        for seed in seeds.values():
            masks.apply_self_mask(total, seed, p, add=False)
        for member, secret in keys.items():
            for peer in self.graph.live_neighbors(member, self.survivors):
                seed = masks.pair_seed(secret, self.advertised[peer].mask_public, p)
                # the survivor added the mask if its id sorts first; undo what it did
                masks.apply_pair_mask(total, seed, p, not masks.adds_pair_mask(peer, member))
        masks.release_buffer()
        total &= p.quant.dtype.type(p.quant.ring_mask)
        self.stage = ServerStage.DONE
        return RoundResult(
            ring_sum=total,
            survivors=tuple(sorted(self.survivors)),
            dropped=tuple(sorted(self.dropped)),
        )
