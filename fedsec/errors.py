"""The one exception hierarchy of fedsec.

Every error a user can cause is a :class:`FedsecError` with a stable machine code
(``code``), the HTTP status an API handler answers with (``http_status``) and a
human sentence (the exception message).  HTTP handlers turn it into
``{"error": code, "detail": message}``; CLI commands print the sentence and exit
non-zero.  Anything else escaping is a bug of ours (HTTP 500).
"""

from __future__ import annotations


class FedsecError(Exception):
    """Base of every error fedsec raises on purpose."""

    code = "fedsec_error"
    http_status = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ConfigError(FedsecError):
    """A configuration file or option is invalid."""

    code = "invalid_config"


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


class AuthError(FedsecError):
    """A request is not authenticated or not authorised."""

    code = "unauthenticated"
    http_status = 401


class ForbiddenError(AuthError):
    """The authenticated party may not do this (role, revoked, wrong federation)."""

    code = "forbidden"
    http_status = 403


class ReplayError(AuthError):
    """A nonce was seen before, or the signature's creation time is outside the window."""

    code = "replayed"


class ClockSkewError(ReplayError):
    """The signature's creation time is outside the clock-skew window (the signer's clock
    is off, or the request is old).  The answer's ``Date`` header gives the server's time."""

    code = "clock_skew"


class RetryLater(FedsecError):
    """A temporary refusal: the same request, signed anew, may succeed after
    ``retry_after`` seconds (sent as the ``Retry-After`` header)."""

    code = "retry_later"
    http_status = 503

    def __init__(self, detail: str, retry_after: float = 1.0) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class RateLimited(RetryLater):
    """A member key sent more signed requests than its rate allows."""

    code = "rate_limited"
    http_status = 429


class ServerBusy(RetryLater):
    """The aggregator has no capacity for this request now (e.g. every upload slot is taken)."""

    code = "busy"
    http_status = 503


class RequestTimeout(FedsecError):
    """The client did not send the request body within the configured time."""

    code = "request_timeout"
    http_status = 408


class PayloadError(FedsecError):
    """A request body is malformed, has unknown fields, or exceeds a limit."""

    code = "bad_request"


class UnsupportedEncoding(PayloadError):
    """A request body carries a Content-Encoding (compression) the aggregator refuses."""

    code = "unsupported_content_encoding"
    http_status = 415


class PayloadTooLarge(PayloadError):
    """A request body exceeds the configured limit."""

    code = "payload_too_large"
    http_status = 413


class NotFound(FedsecError):
    """A requested round, model version or receipt does not exist."""

    code = "not_found"
    http_status = 404


class BudgetExhausted(FedsecError):
    """Training another round would exceed the data owner's privacy budget."""

    code = "budget_exhausted"


class TaskMismatch(FedsecError):
    """The local task or data schema differs from what the round requires."""

    code = "task_mismatch"
    http_status = 409


class IntegrityError(FedsecError):
    """Stored or received content does not match its hash, manifest or signature."""

    code = "integrity_error"


class AggregatorUnreachable(FedsecError):
    """The aggregator did not answer (connection failures, timeouts, 5xx) after all retries."""

    code = "aggregator_unreachable"
    http_status = 503


class AggregatorRefused(FedsecError):
    """The aggregator refused a request with an error code this client has no class for.

    ``code`` and ``http_status`` are the server's, set per instance.
    """

    code = "aggregator_refused"

    def __init__(
        self, detail: str, code: str = "aggregator_refused", http_status: int = 400
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.http_status = http_status


class StaleUpdate(ProtocolError):
    """Buffered mode: the update was trained on a model too many versions old."""

    code = "stale"
