"""The one exception hierarchy of fedsec.

Every error a user can cause is a :class:`FedsecError` with a stable machine code
(``code``), the HTTP status an API handler answers with (``http_status``) and a
human sentence (the exception message).  HTTP handlers turn it into
``{"error": code, "detail": message}``; CLI commands print the sentence and exit
non-zero.  Anything else escaping is a bug of ours (HTTP 500).

The root and the errors the crypto layer raises are defined in
:mod:`fedsec.crypto.errors` (``fedsec.crypto`` imports nothing of fedsec outside
itself) and re-exported here, so every class has one definition and one public name:
import errors from this module.
"""

from __future__ import annotations

from fedsec.crypto.errors import (
    AuthError,
    BadVector,
    ClockSkewError,
    CryptoError,
    DecryptionError,
    DuplicateMessage,
    FedsecError,
    IntegrityError,
    InvalidKeyList,
    KeyFileError,
    MisaddressedShare,
    PayloadError,
    ProtocolError,
    QuantizationError,
    RecoveryImpossible,
    ReplayError,
    RoundAborted,
    ShamirError,
    SignatureError,
    UnknownMember,
    WrongStage,
)

__all__ = [
    "AggregationImpossible",
    "AggregatorRefused",
    "AggregatorUnreachable",
    "AuthError",
    "BadVector",
    "BudgetExhausted",
    "ClockSkewError",
    "ConfigError",
    "CryptoError",
    "DecryptionError",
    "DpIncompatibleModel",
    "DuplicateMessage",
    "FedsecError",
    "ForbiddenError",
    "GroupServedElsewhere",
    "IntegrityError",
    "InvalidKeyList",
    "InvalidTask",
    "KeyFileError",
    "MisaddressedShare",
    "NotFound",
    "PayloadError",
    "PayloadTooLarge",
    "ProtocolError",
    "QuantizationError",
    "Quarantined",
    "RateLimited",
    "RecoveryImpossible",
    "RefusedByRule",
    "ReplayError",
    "RequestTimeout",
    "RetryLater",
    "RoundAborted",
    "ServerBusy",
    "ShamirError",
    "SignatureError",
    "StaleUpdate",
    "TaskDigestMismatch",
    "TaskMismatch",
    "UnknownMember",
    "UnknownTask",
    "UnsupportedEncoding",
    "WrongGroup",
    "WrongStage",
]


class ConfigError(FedsecError):
    """A configuration file or option is invalid."""

    code = "invalid_config"


class ForbiddenError(AuthError):
    """The authenticated party may not do this (role, revoked, wrong federation)."""

    code = "forbidden"
    http_status = 403


class RetryLater(FedsecError):
    """A temporary refusal: the same request, signed anew, may succeed after
    ``retry_after`` seconds (sent as the ``Retry-After`` header)."""

    code = "retry_later"
    http_status = 503

    def __init__(self, detail: str, retry_after: float = 1.0) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class WrongGroup(FedsecError):
    """A shard group's stage message sent to a group server that does not serve that
    group (``round.group_servers``): the detail names the URL the signed spec gives it.
    421 Misdirected Request: the request is sound, this server is the wrong one."""

    code = "wrong_group"
    http_status = 421


class GroupServedElsewhere(RetryLater):
    """A stage message reached the leader for a shard group that a group server serves
    (the member fell back from it): retried until that server answers again or the
    leader has taken its group over."""

    code = "group_served_elsewhere"


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


class UnknownTask(ConfigError):
    """No installed distribution declares this task in the ``fedsec.tasks`` entry-point
    group (or more than one does, so the name does not say whose code would run)."""

    code = "unknown_task"


class InvalidTask(FedsecError):
    """A task package breaks the ``fedsec.task`` contract: a loss that is not a scalar,
    an unknown primary metric, a distribution whose files cannot be digested."""

    code = "invalid_task"


class DpIncompatibleModel(InvalidTask):
    """The task's model has layers Opacus cannot train with DP-SGD; the detail names
    each layer and its fix."""

    code = "dp_incompatible_model"


class TaskDigestMismatch(TaskMismatch):
    """The installed task package is not the one the federation pinned (entry point,
    distribution version or digest of its files differ); the detail names which."""

    code = "task_digest_mismatch"


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


class RefusedByRule(ProtocolError):
    """Trusted mode (``secure_sum = "none"``): the federation's aggregation rule or its
    acceptance threshold kept an accepted update out of the aggregate; the detail says
    which rule and why (logged as a ``refused`` entry when the round closes)."""

    code = "refused_by_rule"


class Quarantined(ForbiddenError):
    """The member is suspended from future cohorts: the control-sample audit failed one
    of its contributions (a ``quarantine`` log entry says which round, who ordered it)."""

    code = "quarantined"
    http_status = 403


class AggregationImpossible(RoundAborted):
    """The aggregation rule cannot form an aggregate from the updates it was given (too
    few for its parameters, or no update the reference trusts): the attempt aborts."""

    code = "aggregation_impossible"
