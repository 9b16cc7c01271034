"""A member's side of one SecAgg+ round, as a sans-I/O state machine.

Stages: ``advertise`` -> ``share_keys`` (on the key list) -> ``await_shares``
-> ``masked_input`` -> ``consistency`` (sign the survivor set) -> ``unmask`` (on
``threshold`` neighbours' signatures of the identical set) -> ``done``.  Each method consumes the
server's message for that stage and returns the member's answer; calling one
out of order raises :class:`WrongStage` and changes nothing.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

import numpy as np

from fedsec.crypto import shamir
from fedsec.crypto.envelope import EnvelopeContext, KeyAgreementKey, open_sealed, seal
from fedsec.crypto.errors import (
    BadVector,
    CryptoError,
    DuplicateMessage,
    InvalidKeyList,
    MisaddressedShare,
    ProtocolError,
    SignatureError,
    UnknownMember,
    WrongStage,
)
from fedsec.crypto.identity import PublicIdentity, SigningIdentity
from fedsec.crypto.quantize import RingVector, pack
from fedsec.crypto.secagg import masks
from fedsec.crypto.secagg.graph import (
    DEFAULT_TOLERATED_CORRUPT,
    check_threshold,
    member_x,
    prune,
    round_graph,
)
from fedsec.crypto.secagg.messages import (
    ADVERTISE_DOMAIN,
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

_PLAINTEXT_BYTES = 2 * shamir.SHARE_BYTES


class ClientStage(enum.Enum):
    ADVERTISE = "advertise"
    SHARE_KEYS = "share_keys"
    AWAIT_SHARES = "await_shares"
    MASKED_INPUT = "masked_input"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"
    DONE = "done"


def verify_advertisement(
    entry: AdvertiseKeys, params: SecAggParams, roster: Mapping[str, bytes]
) -> None:
    """Check an advertisement's signature against the member's roster key, and its graph
    nonce against the member's commitment in the round's parameters.

    Raises:
        InvalidKeyList: the member is unknown, the signature does not verify, or the
            graph nonce does not open the member's commitment.
    """
    check_graph_nonce(entry, params)
    public = roster.get(entry.member)
    if public is None:
        raise InvalidKeyList(f"keys advertised for {entry.member!r}, who is not on the roster")
    if len(entry.enc_public) != 32 or len(entry.mask_public) != 32:
        raise InvalidKeyList(f"keys of {entry.member!r} are not 32-byte X25519 keys")
    try:
        PublicIdentity(public).verify(
            ADVERTISE_DOMAIN,
            AdvertiseKeys.signed_bytes(
                params.digest(),
                entry.member,
                entry.enc_public,
                entry.mask_public,
                entry.graph_nonce,
            ),
            entry.signature,
        )
    except SignatureError:
        raise InvalidKeyList(
            f"key advertisement of {entry.member!r} does not verify against its roster key"
        ) from None


def check_graph_nonce(entry: AdvertiseKeys, params: SecAggParams) -> None:
    """The advertised graph nonce opens the member's commitment (none in a round without
    commitments): the graph seed can then only be the one the cohort fixed.

    Raises:
        InvalidKeyList: the nonce is missing, unexpected, or does not open the commitment.
    """
    if not params.graph_commitments or not params.has_member(entry.member):
        if entry.graph_nonce:
            raise InvalidKeyList(
                f"{entry.member!r} revealed a graph nonce the round did not ask for"
            )
        return
    if not params.opens_commitment(entry.member, entry.graph_nonce):
        raise InvalidKeyList(
            f"graph nonce of {entry.member!r} does not open its commitment in the round spec"
        )


class ClientSession:
    """One member in one round.

    Args:
        params: the round's parameters (from the signed round spec).
        member: this member's id; must be in the cohort.
        identity: this member's signing identity (matches its roster key).
        roster: member id -> Ed25519 public key, for checking relayed keys and
            consistency signatures.
        tolerated_corrupt: γ, the colluding neighbours this member's secrets must stay
            safe against (:func:`~fedsec.crypto.secagg.graph.check_threshold`).  None
            skips the check: only for exercising the summation with any threshold
            (tests, benchmarks); a member always passes its configured γ.
        graph_nonce: the nonce whose commitment this member sent when it joined; needed
            when the round's parameters carry graph commitments.

    Raises:
        UnknownMember: ``member`` is not in the cohort.
        ProtocolError: the round's threshold does not hold against γ colluders, or its
            parameters do not carry this member's commitment to ``graph_nonce``.
    """

    def __init__(
        self,
        params: SecAggParams,
        member: str,
        identity: SigningIdentity,
        roster: Mapping[str, bytes],
        *,
        tolerated_corrupt: int | None = DEFAULT_TOLERATED_CORRUPT,
        graph_nonce: bytes = b"",
    ) -> None:
        if member not in params.cohort:
            raise UnknownMember(f"{member!r} is not in the cohort of round {params.round}")
        if tolerated_corrupt is not None:
            check_threshold(
                len(params.cohort), params.neighbors, params.threshold, tolerated_corrupt
            )
        committed = params.commitment_of(member)
        if committed is None and graph_nonce:
            raise ProtocolError(
                "the round's parameters carry no graph commitments: the aggregator alone "
                "would choose the neighbour graph; refusing the round"
            )
        if committed is not None and not params.opens_commitment(member, graph_nonce):
            raise ProtocolError(
                f"the round's parameters do not carry {member}'s commitment to its graph "
                "nonce: the aggregator changed it, or this member did not join this attempt"
            )
        self._graph_nonce = graph_nonce if committed is not None else b""
        self.params = params
        self.member = member
        self._identity = identity
        self._roster = roster
        self.graph = round_graph(params.cohort, params.neighbors, params.seed)
        self._x = member_x(params.cohort)
        self.stage = ClientStage.ADVERTISE
        self._enc_key = KeyAgreementKey()
        self._mask_key = KeyAgreementKey()
        self._self_seed = os.urandom(32)
        self._keys: dict[str, AdvertiseKeys] = {}
        # neighbour -> pairwise envelope key, agreed once when sharing, reused to open
        self._envelope_keys: dict[str, bytes] = {}
        self._live: frozenset[str] = frozenset()
        self._participants: frozenset[str] = frozenset()
        # neighbour -> (share of its self-mask seed, share of its mask key)
        self._held: dict[str, tuple[bytes, bytes]] = {}
        self._signed: UnmaskRequest | None = None  # the one survivor set this member signs

    def _expect(self, stage: ClientStage) -> None:
        if self.stage is not stage:
            raise WrongStage(
                f"{self.member}: got a {stage.value} message while in stage {self.stage.value}"
            )

    def _context(self, sender: str, recipient: str) -> EnvelopeContext:
        return EnvelopeContext(
            masks.SHARE_PURPOSE, self.params.federation_id, self.params.round, sender, recipient
        )

    def advertise(self) -> AdvertiseKeys:
        """Stage 1: publish two fresh X25519 public keys, signed."""
        self._expect(ClientStage.ADVERTISE)
        enc, mask = self._enc_key.public_bytes, self._mask_key.public_bytes
        nonce = self._graph_nonce
        signature = self._identity.sign(
            ADVERTISE_DOMAIN,
            AdvertiseKeys.signed_bytes(self.params.digest(), self.member, enc, mask, nonce),
        )
        self.stage = ClientStage.SHARE_KEYS
        return AdvertiseKeys(self.member, enc, mask, signature, nonce)

    def share_keys(self, key_list: KeyList) -> ShareKeys:
        """Stage 2: check the relayed keys, derive the neighbour graph from the revealed
        graph nonces, Shamir-share both secrets to live neighbours.

        Every revealed nonce is checked against its commitment (the graph depends on
        all of them); only the neighbours' signatures (and our own keys) are verified:
        they are the only keys this member encrypts to or agrees masks with.

        Raises:
            InvalidKeyList: a neighbour's key is forged, ours was replaced, a graph
                nonce does not open its commitment, or the list names members outside
                the cohort or twice.
            ProtocolError: this member was excluded for having too few live neighbours.
        """
        self._expect(ClientStage.SHARE_KEYS)
        keys: dict[str, AdvertiseKeys] = {}
        for entry in key_list.entries:
            if entry.member not in self._x:
                raise InvalidKeyList(f"key list names {entry.member!r}, who is not in the cohort")
            if entry.member in keys:
                raise InvalidKeyList(f"key list names {entry.member!r} twice")
            keys[entry.member] = entry
        mine = keys.get(self.member)
        if mine is None or (mine.enc_public, mine.mask_public) != (
            self._enc_key.public_bytes,
            self._mask_key.public_bytes,
        ):
            raise InvalidKeyList(f"key list does not carry {self.member}'s own advertised keys")
        for entry in keys.values():
            check_graph_nonce(entry, self.params)
        p = self.params
        graph = round_graph(p.cohort, p.neighbors, p.graph_seed(keys.values()))
        live = prune(graph, keys, p.threshold)
        if self.member not in live:
            raise ProtocolError(
                f"{self.member} has fewer than {p.threshold} advertised neighbours: "
                "excluded from the round"
            )
        neighbours = graph.live_neighbors(self.member, live)
        for peer in neighbours:
            verify_advertisement(keys[peer], self.params, self._roster)
        seed_shares = shamir.split(
            self._self_seed, self.params.threshold, [self._x[p] for p in neighbours]
        )
        key_shares = shamir.split(
            self._mask_key.secret_bytes, self.params.threshold, [self._x[p] for p in neighbours]
        )
        out = []
        envelope_keys = {p: self._enc_key.shared_key(keys[p].enc_public) for p in neighbours}
        for peer, s_seed, s_key in zip(neighbours, seed_shares, key_shares, strict=True):
            plaintext = s_seed.to_bytes() + s_key.to_bytes()
            sealed = seal(envelope_keys[peer], plaintext, self._context(self.member, peer))
            out.append(EncryptedShare(self.member, peer, sealed))
        self.graph = graph
        self._keys = keys
        self._envelope_keys = envelope_keys
        self._live = live
        self.stage = ClientStage.AWAIT_SHARES
        return ShareKeys(self.member, tuple(out))

    def receive_shares(self, relay: ShareRelay) -> None:
        """Stage 3: keep the shares our neighbours sent us.

        Raises:
            MisaddressedShare: a share is addressed to someone else.
            ProtocolError: the participant set is inconsistent, a share is missing,
                duplicated or fails decryption.
        """
        self._expect(ClientStage.AWAIT_SHARES)
        if relay.recipient != self.member:
            raise MisaddressedShare(f"share relay for {relay.recipient!r} sent to {self.member}")
        participants = frozenset(relay.participants)
        if len(participants) != len(relay.participants):
            raise ProtocolError("participant list names a member twice")
        if not participants <= self._live or self.member not in participants:
            raise ProtocolError("participant list is not a subset of the live members including us")
        if prune(self.graph, participants, self.params.threshold) != participants:
            raise ProtocolError("participant list includes members with too few live neighbours")
        expected = set(self.graph.live_neighbors(self.member, participants))
        held: dict[str, tuple[bytes, bytes]] = {}
        for share in relay.shares:
            if share.recipient != self.member:
                raise MisaddressedShare(
                    f"share from {share.sender!r} is addressed to {share.recipient!r}, "
                    f"not {self.member}"
                )
            if share.sender not in expected:
                raise ProtocolError(f"unexpected share from {share.sender!r}")
            if share.sender in held:
                raise DuplicateMessage(f"two shares from {share.sender!r}")
            try:
                plaintext = open_sealed(
                    self._envelope_keys[share.sender],
                    share.ciphertext,
                    self._context(share.sender, self.member),
                )
                if len(plaintext) != _PLAINTEXT_BYTES:
                    raise ProtocolError(f"share from {share.sender!r} has the wrong length")
                s_seed = shamir.Share.from_bytes(plaintext[: shamir.SHARE_BYTES])
                s_key = shamir.Share.from_bytes(plaintext[shamir.SHARE_BYTES :])
            except CryptoError as exc:
                raise ProtocolError(f"share from {share.sender!r} rejected: {exc}") from None
            if s_seed.x != self._x[self.member] or s_key.x != self._x[self.member]:
                raise MisaddressedShare(f"share from {share.sender!r} is for another x-coordinate")
            held[share.sender] = (s_seed.to_bytes(), s_key.to_bytes())
        missing = expected - held.keys()
        if missing:
            raise ProtocolError(f"no share from participants {sorted(missing)}")
        self._held = held
        self._participants = participants
        self.stage = ClientStage.MASKED_INPUT

    def masked_input(self, quantized: RingVector) -> MaskedInput:
        """Stage 4: add self and pairwise masks to the quantized input and pack it.

        Raises:
            BadVector: wrong length or values outside the ring.
        """
        self._expect(ClientStage.MASKED_INPUT)
        p = self.params
        q = np.asarray(quantized)
        if q.shape != (p.vector_length,):
            raise BadVector(f"input must have {p.vector_length} elements, got shape {q.shape}")
        if q.size and int(q.max()) > p.quant.ring_mask:
            raise BadVector("input has values outside the ring")
        acc = q.astype(p.quant.dtype, copy=True)
        masks.apply_self_mask(acc, self._self_seed, p, add=True)
        for peer in self.graph.live_neighbors(self.member, self._participants):
            seed = masks.pair_seed(self._mask_key.secret_bytes, self._keys[peer].mask_public, p)
            masks.apply_pair_mask(acc, seed, p, masks.adds_pair_mask(self.member, peer))
        acc &= p.quant.dtype.type(p.quant.ring_mask)
        self.stage = ClientStage.CONSISTENCY
        return MaskedInput(self.member, pack(acc, p.quant.ring_bits))

    def sign_survivors(self, request: UnmaskRequest) -> ConsistencySignature:
        """Stage 5: sign the (survivors, dropped) sets the server announced.

        This member signs one set per attempt and later unmasks for that set only, so
        the server cannot show its neighbours different sets without it being caught.

        Raises:
            ProtocolError: the survivor/dropped sets overlap, do not cover the
                participants, omit us, or leave fewer survivors than the threshold.
        """
        self._expect(ClientStage.CONSISTENCY)
        self._check_request(request)
        signature = self._identity.sign(
            CONSISTENCY_DOMAIN, ConsistencySignature.signed_bytes(self.params.digest(), request)
        )
        self._signed = UnmaskRequest(
            tuple(sorted(request.survivors)), tuple(sorted(request.dropped))
        )
        self.stage = ClientStage.UNMASK
        return ConsistencySignature(self.member, signature)

    def _check_request(self, request: UnmaskRequest) -> None:
        survivors, dropped = frozenset(request.survivors), frozenset(request.dropped)
        if survivors & dropped:
            raise ProtocolError(
                f"unmask request lists {sorted(survivors & dropped)} as both survivor and "
                "dropped; refusing to reveal both shares"
            )
        if survivors | dropped != self._participants:
            raise ProtocolError("unmask request does not partition the round's participants")
        if self.member not in survivors:
            raise ProtocolError(f"unmask request does not list {self.member} as a survivor")
        if len(survivors) < self.params.threshold:
            raise ProtocolError(
                f"only {len(survivors)} survivors, fewer than the threshold "
                f"{self.params.threshold}; refusing to unmask"
            )
        if len(survivors) + len(dropped) != len(request.survivors) + len(request.dropped):
            raise ProtocolError("unmask request names a member twice")

    def unmask(self, proof: ConsistencyProof) -> UnmaskResponse:
        """Stage 6: reveal, per neighbour, the seed share (survivor) or key share (dropped).

        Only for the sets this member signed, and only once ``threshold`` of its
        neighbours proved, by their signatures, that they were told the identical sets.
        Never both shares for one member: the sets partition the participants, and
        this answers only once.

        Raises:
            ProtocolError: the proof is for other sets, is addressed to another member,
                or carries fewer than ``threshold`` valid neighbour signatures.
        """
        self._expect(ClientStage.UNMASK)
        signed = self._signed
        assert signed is not None  # set with the stage
        if proof.recipient != self.member:
            raise ProtocolError(f"consistency proof for {proof.recipient!r} sent to {self.member}")
        told = UnmaskRequest(
            tuple(sorted(proof.request.survivors)), tuple(sorted(proof.request.dropped))
        )
        if told != signed:
            raise ProtocolError(
                "consistency proof is for other survivor sets than the ones this member "
                "signed; the aggregator told members different things; refusing to unmask"
            )
        valid = self._valid_signers(proof.signatures, signed)
        if len(valid) < self.params.threshold:
            raise ProtocolError(
                f"only {len(valid)} of this member's neighbours signed the survivor sets it "
                f"was told, fewer than the threshold {self.params.threshold}; refusing to unmask"
            )
        survivors, dropped = frozenset(signed.survivors), frozenset(signed.dropped)
        seed_shares = tuple((m, s[0]) for m, s in sorted(self._held.items()) if m in survivors)
        key_shares = tuple((m, s[1]) for m, s in sorted(self._held.items()) if m in dropped)
        self.stage = ClientStage.DONE
        return UnmaskResponse(self.member, seed_shares, key_shares)

    def _valid_signers(
        self, signatures: tuple[ConsistencySignature, ...], signed: UnmaskRequest
    ) -> frozenset[str]:
        """Neighbours of this member whose signature on ``signed`` verifies; a forged,
        misattributed or repeated signature counts for nothing."""
        neighbours = self.graph.neighbors(self.member)
        message = ConsistencySignature.signed_bytes(self.params.digest(), signed)
        valid: set[str] = set()
        for entry in signatures:
            public = self._roster.get(entry.member)
            if entry.member not in neighbours or entry.member in valid or public is None:
                continue
            try:
                PublicIdentity(public).verify(CONSISTENCY_DOMAIN, message, entry.signature)
            except SignatureError:
                continue
            valid.add(entry.member)
        return frozenset(valid)
