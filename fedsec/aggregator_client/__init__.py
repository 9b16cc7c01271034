"""The HTTP client for the aggregator API, shared by agents and auditors (one method per
endpoint of :mod:`fedsec.protocol.endpoints`).

Transport only: it builds URLs, signs every request (RFC 9421, also GETs, whose
body is empty), retries what may succeed on a second try, checks response sizes
before reading them and decodes answers into the typed messages of
:mod:`fedsec.protocol.wire`.  Protocol decisions belong to :mod:`fedsec.agent.runtime`.

Retry policy: connection failures, timeouts and 5xx answers are retried with
exponential backoff and jitter (``backoff_initial_s`` doubling up to
``backoff_max_s``, each delay drawn from [0, d], full jitter, so agents that
lost the aggregator together do not return together); every retry is signed afresh, with
a new nonce, because the aggregator refuses a replayed one.  Refusals that a later
try may pass are retried within the same budget of ``retry_max`` retries: 429
``rate_limited``, 503 (``busy`` or any code) and 408 ``request_timeout`` after the
answer's ``Retry-After`` seconds (capped at ``backoff_max_s``; the backoff when the
header is absent or malformed), and 401 ``replayed`` (a nonce store full or a
stale nonce) after the backoff.  When the budget runs out the last refusal is
raised as its class (:class:`~fedsec.errors.RetryLater`,
:class:`~fedsec.errors.ReplayError`, :class:`~fedsec.errors.RequestTimeout`), so
the runtime can tell it from a permanent one.  A 401 ``clock_skew`` resets the
client's clock offset from the answer's ``Date`` header and resends at once, once
per request; a second one raises :class:`~fedsec.errors.ClockSkewError`.  Any
other 4xx is the aggregator's considered answer and is raised at once as the
:class:`~fedsec.errors.FedsecError` subclass named by its ``error`` code (or
:class:`~fedsec.errors.AggregatorRefused` for a code this client does not know),
carrying the server's ``detail`` sentence; 401 ``unauthenticated`` and 403
``forbidden`` also say what the operator should do.  A retried POST that the
aggregator did process before the connection broke comes back as a 409
``duplicate``; callers decide whether that means success.  Given the URLs of a
replicated aggregator, the same budget covers moving between them (:mod:`.transport`):
on to the next when one cannot be reached, to the leader a ``503 not_leader`` names
only when that URL is one of the configured ones.

The objects the aggregator signs are checked here against its pinned key as they
arrive: receipts and model manifests (their signature; the manifest's file hash is
checked by the caller, which holds the file).  Round specs are verified by the
runtime, which words the refusal.

Modules, read top to bottom: :mod:`.limits` (sizes and timeouts), :mod:`.refusals`
(error answers into exceptions), :mod:`.transport` (signing, retries, clock offset,
size-checked reads), :mod:`.calls`, :mod:`.stages`, :mod:`.audit` and :mod:`.api`
(one method per endpoint, joined in :class:`AggregatorClient`).
"""

from __future__ import annotations

from fedsec.aggregator_client.api import AggregatorClient, RosterBody
from fedsec.aggregator_client.limits import (
    DEFAULT_MAX_MODEL_BYTES,
    MAX_ERROR_BYTES,
    MAX_JSON_BYTES,
    MAX_RECEIPT_BYTES,
)
from fedsec.aggregator_client.limits import IDLE_CONNECTION_S as IDLE_CONNECTION_S
from fedsec.aggregator_client.limits import LONG_POLL_SLACK_S as LONG_POLL_SLACK_S
from fedsec.aggregator_client.refusals import _ERROR_CLASSES as _ERROR_CLASSES
from fedsec.aggregator_client.refusals import error_from_response, parse_retry_after

__all__ = [
    "DEFAULT_MAX_MODEL_BYTES",
    "MAX_ERROR_BYTES",
    "MAX_JSON_BYTES",
    "MAX_RECEIPT_BYTES",
    "AggregatorClient",
    "RosterBody",
    "error_from_response",
    "parse_retry_after",
]
