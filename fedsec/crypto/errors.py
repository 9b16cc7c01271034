"""The root of fedsec's one exception hierarchy, and the errors the crypto layer raises.

:mod:`fedsec.crypto` imports nothing of fedsec outside itself, yet its errors must
be the same classes the rest of fedsec catches and maps to HTTP answers.  So the
root :class:`FedsecError` and every error a crypto module raises are defined here,
and :mod:`fedsec.errors` re-exports them beside the errors of the other layers:
``from fedsec.errors import SignatureError`` names this very class.  Import them
from :mod:`fedsec.errors` outside ``fedsec.crypto``.

Every error a user can cause is a :class:`FedsecError` with a stable machine code
(``code``), the HTTP status an API handler answers with (``http_status``) and a
human sentence (the exception message).
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BadVector",
    "ClockSkewError",
    "CryptoError",
    "DecryptionError",
    "DuplicateMessage",
    "FedsecError",
    "IntegrityError",
    "InvalidKeyList",
    "KeyFileError",
    "MisaddressedShare",
    "PayloadError",
    "ProtocolError",
    "QuantizationError",
    "RecoveryImpossible",
    "ReplayError",
    "RoundAborted",
    "ShamirError",
    "SignatureError",
    "UnknownMember",
    "WrongStage",
]


class FedsecError(Exception):
    """Base of every error fedsec raises on purpose."""

    code = "fedsec_error"
    http_status = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class CryptoError(FedsecError):
    """A cryptographic check failed."""

    code = "crypto_error"


class SignatureError(CryptoError):
    """A signature does not verify, or was made by a key we do not accept."""

    code = "bad_signature"
    http_status = 401


class DecryptionError(CryptoError):
    """A ciphertext failed authentication: tampered, misaddressed or replayed."""

    code = "decryption_failed"


class KeyFileError(CryptoError):
    """A key file is missing, malformed or has unsafe permissions."""

    code = "bad_key_file"


class ShamirError(CryptoError):
    """Shares are malformed, duplicated, inconsistent or too few."""

    code = "bad_shares"


class QuantizationError(FedsecError):
    """A vector cannot be quantized or dequantized with the given parameters."""

    code = "bad_quantization"


class IntegrityError(FedsecError):
    """Stored or received content does not match its hash, manifest or signature."""

    code = "integrity_error"


# -- SecAgg+ protocol rules (crypto/secagg) -----------------------------------------------------


class ProtocolError(FedsecError):
    """A SecAgg+ message broke a rule of the protocol."""

    code = "protocol_error"
    http_status = 409


class WrongStage(ProtocolError):
    """The message belongs to a stage other than the current one."""

    code = "wrong_stage"


class DuplicateMessage(ProtocolError):
    """The member already sent this message for this stage."""

    code = "duplicate"


class UnknownMember(ProtocolError):
    """The sender or a referenced member is not part of this round."""

    code = "unknown_member"
    http_status = 403


class InvalidKeyList(ProtocolError):
    """A relayed key list does not verify against the roster."""

    code = "invalid_key_list"


class MisaddressedShare(ProtocolError):
    """An encrypted share was addressed to a different member."""

    code = "misaddressed_share"


class BadVector(ProtocolError):
    """A masked vector has the wrong length or values outside the ring."""

    code = "bad_vector"
    http_status = 400


class RecoveryImpossible(ProtocolError):
    """Too few members remain to reconstruct the secrets needed to unmask."""

    code = "recovery_impossible"

    def __init__(self, detail: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(detail)
        self.missing = missing


class RoundAborted(ProtocolError):
    """Fewer than the threshold of members remain; the round cannot finish."""

    code = "round_aborted"


# -- request authentication (crypto/httpsig) ----------------------------------------------------


class AuthError(FedsecError):
    """A request is not authenticated or not authorised."""

    code = "unauthenticated"
    http_status = 401


class ReplayError(AuthError):
    """A nonce was seen before, or the signature's creation time is outside the window."""

    code = "replayed"


class ClockSkewError(ReplayError):
    """The signature's creation time is outside the clock-skew window (the signer's clock
    is off, or the request is old).  The answer's ``Date`` header gives the server's time."""

    code = "clock_skew"


class PayloadError(FedsecError):
    """A request body is malformed, has unknown fields, or exceeds a limit."""

    code = "bad_request"
