"""Messages of homomorphic summation: the key custodian's public CKKS context and its
statement, the aggregator's offer of a sum to decrypt, and the custodian's signed account
of each decryption."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from fedsec.protocol.body import Count, HexDigest, Id, MemberId, _Signed
from fedsec.protocol.limits import MAX_COHORT

HE_CONTEXT_DOMAIN = "he-context"
HE_DECRYPTION_DOMAIN = "he-decryption"


class HeContextStatement(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The key custodian's signed statement of the public CKKS context of a federation:
    its parameters and the SHA-256 of its serialisation.  Members encrypt only under a
    context whose statement verifies against the custodian's roster key."""

    DOMAIN: ClassVar[str] = HE_CONTEXT_DOMAIN

    federation_id: str
    custodian: MemberId
    poly_modulus_degree: Count
    coeff_mod_bit_sizes: Annotated[list[Count], msgspec.Meta(max_length=16)]
    scale_bits: Count
    context_sha256: HexDigest
    signature: str = ""


class HeContext(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The public context (base64 of TenSEAL's serialisation, no secret key) with the
    custodian's statement: what the custodian uploads and every member fetches."""

    statement: HeContextStatement
    context: str


class HeSumOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the aggregator asks the custodian to decrypt: the sum of the ciphertexts of
    ``contributors`` (each an accepted masked input of the attempt), by its digest
    (:func:`fedsec.crypto.he.sum_digest`).  The custodian re-adds the archived
    ciphertexts itself before it believes the digest."""

    federation_id: str
    round: Id
    attempt: Id
    contributors: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    sum_sha256: HexDigest
    log_index: Count  # the log holds every accepted entry of the attempt below this index


class DecryptionStatement(_Signed, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The custodian's signed account of one decryption: which contributions' sum (each
    once, checked against the log), and the hash of the plaintext it released (the
    integer sum of the members' quantized vectors, little-endian int64)."""

    DOMAIN: ClassVar[str] = HE_DECRYPTION_DOMAIN

    federation_id: str
    round: Id
    attempt: Id
    custodian: MemberId
    contributors: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)]
    sum_sha256: HexDigest
    plaintext_sha256: HexDigest
    # A hidden model (he.model_visible_to_aggregator = false) only; omitted otherwise,
    # so visible-model statements sign as before.  The custodian derived the new model
    # from ``parent_version`` and sealed plaintext and model to ``recipients``.
    ring_sha256: HexDigest | None = None  # the ring sum, as the aggregate entry logs it
    weight_sum: float | None = None  # Σ w, as the aggregate entry logs it
    parent_version: Id | None = None
    model_sha256: HexDigest | None = None  # the derived model file, in the clear
    sealed_sha256: HexDigest | None = None  # the sealed release, as the aggregator stores it
    recipients: Annotated[list[MemberId], msgspec.Meta(max_length=MAX_COHORT)] = msgspec.field(
        default_factory=list
    )
    signature: str = ""

    @property
    def sealed(self) -> bool:
        """Whether this decryption released a hidden model (sealed to its recipients)."""
        return self.model_sha256 is not None
