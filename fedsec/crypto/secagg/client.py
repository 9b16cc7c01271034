"""A member's side of one SecAgg+ round, as a sans-I/O state machine.

Stages: ``advertise`` -> ``share_keys`` (on the key list) -> ``await_shares``
-> ``masked_input`` -> ``unmask`` -> ``done``.  Each method consumes the
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
from fedsec.crypto.secagg.graph import member_x, prune, round_graph
from fedsec.crypto.secagg.messages import (
    ADVERTISE_DOMAIN,
    AdvertiseKeys,
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
    UNMASK = "unmask"
    DONE = "done"


def verify_advertisement(
    entry: AdvertiseKeys, params: SecAggParams, roster: Mapping[str, bytes]
) -> None:
    """Check an advertisement's signature against the member's roster key.

    Raises:
        InvalidKeyList: the member is unknown or the signature does not verify.
    """
    public = roster.get(entry.member)
    if public is None:
        raise InvalidKeyList(f"keys advertised for {entry.member!r}, who is not on the roster")
    if len(entry.enc_public) != 32 or len(entry.mask_public) != 32:
        raise InvalidKeyList(f"keys of {entry.member!r} are not 32-byte X25519 keys")
    try:
        PublicIdentity(public).verify(
            ADVERTISE_DOMAIN,
            AdvertiseKeys.signed_bytes(
                params.digest(), entry.member, entry.enc_public, entry.mask_public
            ),
            entry.signature,
        )
    except SignatureError:
        raise InvalidKeyList(
            f"key advertisement of {entry.member!r} does not verify against its roster key"
        ) from None


class ClientSession:
    """One member in one round.

    Args:
        params: the round's parameters (from the signed round spec).
        member: this member's id; must be in the cohort.
        identity: this member's signing identity (matches its roster key).
        roster: member id -> Ed25519 public key, for checking relayed keys.
    """

    def __init__(
        self,
        params: SecAggParams,
        member: str,
        identity: SigningIdentity,
        roster: Mapping[str, bytes],
    ) -> None:
        if member not in params.cohort:
            raise UnknownMember(f"{member!r} is not in the cohort of round {params.round}")
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
        signature = self._identity.sign(
            ADVERTISE_DOMAIN,
            AdvertiseKeys.signed_bytes(self.params.digest(), self.member, enc, mask),
        )
        self.stage = ClientStage.SHARE_KEYS
        return AdvertiseKeys(self.member, enc, mask, signature)

    def share_keys(self, key_list: KeyList) -> ShareKeys:
        """Stage 2: check the relayed keys, Shamir-share both secrets to live neighbours.

        Only the neighbours' advertisements (and our own) are verified: they are
        the only keys this member encrypts to or agrees masks with.

        Raises:
            InvalidKeyList: a neighbour's key is forged, ours was replaced, or the
                list names members outside the cohort or twice.
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
        live = prune(self.graph, keys, self.params.threshold)
        if live != frozenset(keys):
            raise InvalidKeyList("key list includes members with too few live neighbours")
        neighbours = self.graph.live_neighbors(self.member, live)
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
        self.stage = ClientStage.UNMASK
        return MaskedInput(self.member, pack(acc, p.quant.ring_bits))

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 5: reveal, per neighbour, the seed share (survivor) or key share (dropped).

        Never both for one member: the request must partition the participants,
        and this answers only once.

        Raises:
            ProtocolError: the survivor/dropped sets overlap, do not cover the
                participants, omit us, or leave fewer survivors than the threshold.
        """
        self._expect(ClientStage.UNMASK)
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
        seed_shares = tuple((m, s[0]) for m, s in sorted(self._held.items()) if m in survivors)
        key_shares = tuple((m, s[1]) for m, s in sorted(self._held.items()) if m in dropped)
        self.stage = ClientStage.DONE
        return UnmaskResponse(self.member, seed_shares, key_shares)
