"""The one codec between wire bodies (:mod:`fedsec.protocol.wire`) and SecAgg+ messages
(:mod:`fedsec.crypto.secagg`), in both directions.

The agent encodes its messages with the ``*_body`` functions and decodes the
aggregator's with the ``*_message`` ones; the aggregator does the opposite; resume
and ``audit verify`` decode stored bodies with the same functions
(:mod:`fedsec.protocol.replay`).  Decoding checks every hex field's length and names
the field in the error, so a malformed body is refused before any protocol state sees
it.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedsec.crypto.secagg import (
    AdvertiseKeys,
    ConsistencyProof,
    ConsistencySignature,
    EncryptedShare,
    KeyList,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
)
from fedsec.crypto.secagg.messages import GRAPH_NONCE_BYTES
from fedsec.protocol.wire import (
    AdvertiseKeysBody,
    ConsistencyBody,
    ConsistencyProofBody,
    IncomingShare,
    KeyEntry,
    KeyListBody,
    MemberSignature,
    OutgoingShare,
    PrivacyReport,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
    unhex,
)

_KEY_BYTES = 32
_SIGNATURE_BYTES = 64


def advertise_body(msg: AdvertiseKeys) -> AdvertiseKeysBody:
    return AdvertiseKeysBody(
        msg.enc_public.hex(), msg.mask_public.hex(), msg.signature.hex(), msg.graph_nonce.hex()
    )


def _graph_nonce(raw: str, what: str) -> bytes:
    return unhex(raw, what, GRAPH_NONCE_BYTES) if raw else b""


def advertise_message(member: str, body: AdvertiseKeysBody) -> AdvertiseKeys:
    """Raises PayloadError: a field is not hex of the right length."""
    return AdvertiseKeys(
        member,
        unhex(body.enc_public, "enc_public", _KEY_BYTES),
        unhex(body.mask_public, "mask_public", _KEY_BYTES),
        unhex(body.signature, "signature", _SIGNATURE_BYTES),
        _graph_nonce(body.graph_nonce, "graph_nonce"),
    )


def key_list_body(entries: Iterable[AdvertiseKeys]) -> KeyListBody:
    return KeyListBody(
        entries=[
            KeyEntry(
                member=a.member,
                enc_public=a.enc_public.hex(),
                mask_public=a.mask_public.hex(),
                signature=a.signature.hex(),
                graph_nonce=a.graph_nonce.hex(),
            )
            for a in entries
        ]
    )


def key_list(body: KeyListBody) -> KeyList:
    """Raises PayloadError: a field is not hex of the right length."""
    return KeyList(
        tuple(
            AdvertiseKeys(
                e.member,
                unhex(e.enc_public, f"encryption key of {e.member!r}", _KEY_BYTES),
                unhex(e.mask_public, f"mask key of {e.member!r}", _KEY_BYTES),
                unhex(e.signature, f"key signature of {e.member!r}", _SIGNATURE_BYTES),
                _graph_nonce(e.graph_nonce, f"graph nonce of {e.member!r}"),
            )
            for e in body.entries
        )
    )


def share_keys_body(msg: ShareKeys, report: PrivacyReport | None = None) -> ShareKeysBody:
    return ShareKeysBody(
        [OutgoingShare(s.recipient, s.ciphertext.hex()) for s in msg.shares], report
    )


def share_keys_message(member: str, body: ShareKeysBody) -> ShareKeys:
    """Raises PayloadError: a ciphertext is not hex."""
    return ShareKeys(
        member,
        tuple(
            EncryptedShare(member, s.recipient, unhex(s.ciphertext, "share ciphertext"))
            for s in body.shares
        ),
    )


def share_relay_body(relay: ShareRelay) -> ShareRelayBody:
    return ShareRelayBody(
        participants=list(relay.participants),
        shares=[
            IncomingShare(sender=s.sender, ciphertext=s.ciphertext.hex()) for s in relay.shares
        ],
    )


def share_relay(body: ShareRelayBody, member: str) -> ShareRelay:
    """Raises PayloadError: a ciphertext is not hex."""
    return ShareRelay(
        member,
        tuple(body.participants),
        tuple(
            EncryptedShare(s.sender, member, unhex(s.ciphertext, f"share from {s.sender!r}"))
            for s in body.shares
        ),
    )


def unmask_body(msg: UnmaskResponse) -> UnmaskResponseBody:
    return UnmaskResponseBody(
        {m: s.hex() for m, s in msg.seed_shares},
        {m: s.hex() for m, s in msg.key_shares},
    )


def unmask_message(member: str, body: UnmaskResponseBody) -> UnmaskResponse:
    """Raises PayloadError: a share is not hex."""
    return UnmaskResponse(
        member,
        tuple((m, unhex(s, "seed share")) for m, s in sorted(body.seed_shares.items())),
        tuple((m, unhex(s, "key share")) for m, s in sorted(body.key_shares.items())),
    )


def consistency_body(msg: ConsistencySignature) -> ConsistencyBody:
    return ConsistencyBody(msg.signature.hex())


def consistency_message(member: str, body: ConsistencyBody) -> ConsistencySignature:
    """Raises PayloadError: the signature is not 64 bytes of hex."""
    return ConsistencySignature(member, unhex(body.signature, "signature", _SIGNATURE_BYTES))


def unmask_request(body: UnmaskRequestBody) -> UnmaskRequest:
    return UnmaskRequest(tuple(body.survivors), tuple(body.dropped))


def consistency_proof_body(
    proof: ConsistencyProof,
    state_token: int,
    sets: tuple[list[str], list[str]] | None = None,
) -> ConsistencyProofBody:
    """``sets``: the survivor and dropped lists of ``proof.request``, where the caller
    hands every survivor the same ones (built once, not once per proof)."""
    survivors, dropped = sets or (list(proof.request.survivors), list(proof.request.dropped))
    return ConsistencyProofBody(
        survivors=survivors,
        dropped=dropped,
        signatures=[MemberSignature(s.member, s.signature.hex()) for s in proof.signatures],
        state_token=state_token,
    )


def consistency_proof(body: ConsistencyProofBody, member: str) -> ConsistencyProof:
    """Raises PayloadError: a signature is not 64 bytes of hex."""
    return ConsistencyProof(
        member,
        UnmaskRequest(tuple(body.survivors), tuple(body.dropped)),
        tuple(
            ConsistencySignature(
                s.member, unhex(s.signature, f"signature of {s.member!r}", _SIGNATURE_BYTES)
            )
            for s in body.signatures
        ),
    )
