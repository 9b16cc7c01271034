"""The aggregator's HTTP endpoints, declared once.

:data:`ENDPOINTS` is the one list of routes: the aiohttp router, the OpenAPI document
(:mod:`fedsec.aggregator.openapi`) and ``docs/api.md`` (:mod:`fedsec.protocol.api_table`)
are all generated from it, so none can drift from the others.  Each entry says who may
call the route (roster roles), what its body and answer are (a :mod:`fedsec.protocol.wire`
struct, opaque JSON or raw bytes) and which configured limit bounds its body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import msgspec

from fedsec.protocol import wire
from fedsec.protocol.limits import LONG_POLL_S, MAX_COUNT, MAX_ID
from fedsec.protocol.roster import Role

#: What a bearer token issued to an observer (``fedsec aggregator dashboard-token``)
#: opens: the dashboard's pages and data, or the metrics scrape.  Browsers and
#: Prometheus cannot sign requests, so these endpoints take a token instead.
TokenScope = Literal["dashboard", "metrics"]
#: How a caller proves it may call an endpoint: an RFC 9421 signature by an active
#: roster key of one of the endpoint's roles; a bearer token of the endpoint's scope
#: (or, where the configuration allows, a loopback request); the alert's acknowledgement
#: capability (the secret its webhook deliveries carried); or nothing (public).
Auth = Literal["signature", "token", "capability", "none"]
#: Which configured limit bounds a request body: ``server.max_json_bytes`` for control
#: messages, ``server.max_body_bytes`` for the two that carry vectors or reveals.
BodyLimit = Literal["json", "binary"]

PUBLIC: Final[tuple[Role, ...]] = ()
AGENT: Final[tuple[Role, ...]] = ("agent",)
AUDITOR: Final[tuple[Role, ...]] = ("auditor",)
# read-only federation data: every enrolled role, never the public
CUSTODIAN: Final[tuple[Role, ...]] = ("custodian",)
# the log and its archive: whoever must check what was aggregated
CHECKERS: Final[tuple[Role, ...]] = ("auditor", "custodian")
ANY_ROLE: Final[tuple[Role, ...]] = get_args(Role)

#: The server setting each body-limit kind stands for.
LIMIT_SETTINGS: Final[Mapping[BodyLimit, str]] = {
    "json": "server.max_json_bytes",
    "binary": "server.max_body_bytes",
}


@dataclass(frozen=True)
class Opaque:
    """A body or answer without a wire struct: raw bytes, or JSON documented by name."""

    label: str
    binary: bool = False


#: A request body or an answer: a wire struct, or something :class:`Opaque`.
Payload = type[msgspec.Struct] | Opaque


@dataclass(frozen=True)
class Param:
    """A path or query parameter and the JSON schema of its value."""

    name: str
    where: Literal["path", "query"]
    schema: Mapping[str, Any]
    required: bool = False
    description: str = ""


@dataclass(frozen=True)
class Endpoint:
    """One route of the aggregator's API.

    ``roles`` empty means no signature: the endpoint is public unless it names a token
    ``scope`` or takes a ``capability``; ``alternatives`` are further answer structs (the
    answer is one of ``response`` or these); ``answer_note`` describes the success
    answer; ``prefixed`` False serves the path outside the API prefix (the dashboard and
    ``/metrics``, where browsers and scrapers look for them).
    """

    name: str
    method: Literal["GET", "POST"]
    path: str
    summary: str
    roles: tuple[Role, ...]
    request: Payload | None = None
    response: Payload | None = None
    alternatives: tuple[type[msgspec.Struct], ...] = ()
    answer_note: str = "OK"
    params: tuple[Param, ...] = ()
    body_limit: BodyLimit = "json"
    scope: TokenScope | None = None
    capability: bool = False
    prefixed: bool = True

    @property
    def template(self) -> str:
        """The full path template, with the API prefix (``/v1/rounds/{round}/join``)."""
        return f"{wire.API_PREFIX}{self.path}" if self.prefixed else self.path

    @property
    def auth(self) -> Auth:
        """How a caller of this endpoint is authenticated."""
        if self.roles:
            return "signature"
        if self.scope is not None:
            return "token"
        return "capability" if self.capability else "none"


# Path and query integers: canonical ASCII decimal, bounded (wire.parse_uint).
_ID: Final = {"type": "integer", "minimum": 0, "maximum": MAX_ID}
_TOKEN: Final = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}
_SECONDS: Final = {"type": "number", "minimum": 0}

ROUND: Final = Param("round", "path", _ID, required=True)
ATTEMPT: Final = Param("attempt", "query", _ID)
VERSION: Final = Param("version", "path", _ID, required=True)
_ROUND_ATTEMPT: Final = (ROUND, ATTEMPT)


def _wait(until: str) -> Param:
    """The ``wait`` seconds of a stage request: how long its answer may be held."""
    return Param(
        "wait",
        "query",
        _SECONDS,
        description=(
            f"seconds (at most {LONG_POLL_S:g}) the aggregator may hold the answer until "
            f"{until}; 0 or absent answers at once"
        ),
    )


def _hex(name: str, digits: int) -> Param:
    return Param(name, "query", {"type": "string", "pattern": f"^[0-9a-f]{{{digits}}}$"}, True)


_ALERT: Final = Param("alert", "path", _ID, required=True)
_MODEL_BYTES: Final = Opaque("safetensors bytes", binary=True)
_VECTOR_BYTES: Final = Opaque("masked vector bytes", binary=True)
_MANIFEST: Final = Opaque("ModelManifest JSON")
_R: Final = "/rounds/{round}"

ENDPOINTS: Final[tuple[Endpoint, ...]] = (
    Endpoint(
        "health",
        "GET",
        "/health",
        "liveness",
        PUBLIC,
        response=Opaque('{"status": "ok", "role": "leader", "token": 3}'),
        answer_note=(
            "alive; role is leader, standby (replicas on PostgreSQL) or single (SQLite), "
            "token the fencing token of a leader"
        ),
    ),
    Endpoint(
        "openapi",
        "GET",
        "/openapi.json",
        "this document",
        PUBLIC,
        response=Opaque("OpenAPI 3.1 document"),
        answer_note="OpenAPI",
    ),
    Endpoint(
        "status",
        "GET",
        "/status",
        "federation status, alerts and round history",
        ANY_ROLE,
        response=wire.FederationStatus,
    ),
    Endpoint(
        "get_round",
        "GET",
        "/round",
        "current round; long-polls while the token equals ?wait",
        ANY_ROLE,
        response=wire.RoundState,
        params=(Param("wait", "query", _TOKEN), Param("timeout", "query", _SECONDS)),
    ),
    Endpoint(
        "get_roster",
        "GET",
        "/roster",
        "admin-signed roster entries",
        ANY_ROLE,
        response=Opaque("roster entries JSON"),
    ),
    Endpoint(
        "latest_manifest",
        "GET",
        "/models/latest",
        "manifest of the newest good model",
        ANY_ROLE,
        response=_MANIFEST,
    ),
    Endpoint(
        "manifest",
        "GET",
        "/models/{version}/manifest",
        "signed manifest",
        ANY_ROLE,
        response=_MANIFEST,
        params=(VERSION,),
    ),
    Endpoint(
        "model",
        "GET",
        "/models/{version}",
        "safetensors model file",
        ANY_ROLE,
        response=_MODEL_BYTES,
        answer_note="model",
        params=(VERSION,),
    ),
    Endpoint(
        "join",
        "POST",
        f"{_R}/join",
        "join the cohort",
        AGENT,
        request=wire.JoinRequest,
        response=wire.JoinResponse,
        params=_ROUND_ATTEMPT,
    ),
    Endpoint(
        "report",
        "POST",
        f"{_R}/report",
        "signed privacy report",
        AGENT,
        request=wire.PrivacyReport,
        response=Opaque('{"accepted": true}'),
        params=_ROUND_ATTEMPT,
    ),
    Endpoint(
        "evaluation",
        "POST",
        f"{_R}/evaluation",
        "signed evaluation report: a cohort member's metric sums for the model this "
        "closed attempt produced, on its own held-out records (validation.federated)",
        AGENT,
        request=wire.EvaluationReport,
        response=Opaque('{"accepted": true}'),
        params=_ROUND_ATTEMPT,
    ),
    Endpoint(
        "advertise",
        "POST",
        f"{_R}/advertise",
        "advertise ephemeral keys; with ?wait the answer is held until share_keys "
        "and carries the caller's key list (keys)",
        AGENT,
        request=wire.AdvertiseKeysBody,
        response=wire.Accepted,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches share_keys")),
    ),
    Endpoint(
        "keys",
        "GET",
        f"{_R}/keys",
        "relayed key list",
        AGENT,
        response=wire.KeyListBody,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches share_keys")),
    ),
    Endpoint(
        "post_shares",
        "POST",
        f"{_R}/shares",
        "encrypted Shamir shares, optionally with the caller's privacy report for "
        "the attempt (instead of POST report); with ?wait the answer is held until "
        "masked_input and carries the caller's share relay (relay)",
        AGENT,
        request=wire.ShareKeysBody,
        response=wire.Accepted,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches masked_input")),
    ),
    Endpoint(
        "get_shares",
        "GET",
        f"{_R}/shares",
        "shares addressed to the caller",
        AGENT,
        response=wire.ShareRelayBody,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches masked_input")),
    ),
    Endpoint(
        "post_commit",
        "POST",
        f"{_R}/commit",
        "homomorphic summation: the caller's signed commitment to the SHA-256 of the "
        "ciphertext it will upload; with ?wait the answer is held until masked_input "
        "and carries the attempt's commitment set (commitments), whose digest the "
        "caller's contribution statement binds",
        AGENT,
        request=wire.CommitBody,
        response=wire.Accepted,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches masked_input")),
    ),
    Endpoint(
        "get_commit",
        "GET",
        f"{_R}/commit",
        "the attempt's commitment set, once stage commit closed (to members that committed)",
        AGENT,
        response=wire.CommitmentSetBody,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches masked_input")),
    ),
    Endpoint(
        "masked_input",
        "POST",
        f"{_R}/masked-input",
        "masked, packed input vector; answered with the signed Receipt, or, when "
        "?wait is given, with MaskedInputAnswer (the receipt, held until the consistency "
        "stage, and the caller's unmask request: the survivor sets it signs)",
        AGENT,
        request=_VECTOR_BYTES,
        response=wire.Receipt,
        alternatives=(wire.MaskedInputAnswer,),
        answer_note="Receipt; MaskedInputAnswer when ?wait is given",
        params=(
            *_ROUND_ATTEMPT,
            _wait("the round reaches consistency"),
            # the member's signed ContributionStatement over the vector
            _hex("commitment", 64),
            _hex("signature", 128),
        ),
        body_limit="binary",
    ),
    Endpoint(
        "get_unmask",
        "GET",
        f"{_R}/unmask",
        "survivors and dropped members: the sets each survivor signs in consistency",
        AGENT,
        response=wire.UnmaskRequestBody,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches consistency")),
    ),
    Endpoint(
        "post_consistency",
        "POST",
        f"{_R}/consistency",
        "the caller's signature on the survivor sets; with ?wait the answer is held "
        "until the unmask stage and carries the caller's consistency proof (proof): "
        "its neighbours' signatures, on which alone it unmasks",
        AGENT,
        request=wire.ConsistencyBody,
        response=wire.Accepted,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches unmask")),
    ),
    Endpoint(
        "get_consistency",
        "GET",
        f"{_R}/consistency",
        "the survivor sets and the caller's neighbours' signatures on them",
        AGENT,
        response=wire.ConsistencyProofBody,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches unmask")),
    ),
    Endpoint(
        "post_unmask",
        "POST",
        f"{_R}/unmask",
        "shares for unmasking; with ?wait the answer is held until the attempt is "
        "over and carries the round state then (state). The stage closes once the "
        "answers decide the sum; a survivor's answer after that close is accepted "
        "as not needed and stores nothing",
        AGENT,
        request=wire.UnmaskResponseBody,
        response=wire.Accepted,
        params=(*_ROUND_ATTEMPT, _wait("the attempt is over")),
    ),
    Endpoint(
        "receipt",
        "GET",
        f"{_R}/receipt",
        "signed receipt of the caller's contribution",
        AGENT,
        response=wire.Receipt,
        params=_ROUND_ATTEMPT,
    ),
    Endpoint(
        "post_challenge",
        "POST",
        "/audit/challenges",
        "auditor challenges a member's round",
        AUDITOR,
        request=wire.ChallengeRequest,
        response=wire.Challenge,
    ),
    Endpoint(
        "get_challenges",
        "GET",
        "/audit/challenges",
        "open challenges addressed to the caller",
        AGENT,
        response=wire.ChallengeList,
    ),
    Endpoint(
        "post_reveal",
        "POST",
        "/audit/reveals",
        "sealed reveal answering a challenge",
        AGENT,
        request=wire.RevealBody,
        response=wire.Reveal,
        # a reveal carries the opened update: as large as a masked input
        body_limit="binary",
    ),
    Endpoint(
        "get_reveals",
        "GET",
        "/audit/reveals",
        "reveals sealed to the calling auditor",
        AUDITOR,
        response=wire.RevealList,
    ),
    Endpoint(
        "put_he_context",
        "POST",
        "/he/context",
        "the key custodian publishes the federation's public CKKS context (no secret key) "
        "with its signed statement; once per federation",
        CUSTODIAN,
        request=wire.HeContext,
        response=Opaque('{"accepted": true}'),
    ),
    Endpoint(
        "get_he_context",
        "GET",
        "/he/context",
        "the public CKKS context members encrypt under, with the custodian's statement",
        ANY_ROLE,
        response=wire.HeContext,
    ),
    Endpoint(
        "get_he_sum",
        "GET",
        f"{_R}/he-sum",
        "what the custodian is asked to decrypt: the contributors and the digest of the sum "
        "of their ciphertexts; with ?wait held until the attempt reaches decrypt",
        CUSTODIAN,
        response=wire.HeSumOffer,
        params=(*_ROUND_ATTEMPT, _wait("the round reaches decrypt")),
    ),
    Endpoint(
        "post_decryption",
        "POST",
        f"{_R}/decryption",
        "the custodian's signed decryption statement and the decrypted integer sum "
        "(u32 statement length, the statement's JSON, little-endian int64 values)",
        CUSTODIAN,
        request=Opaque("decryption bytes", binary=True),
        response=Opaque('{"accepted": true}'),
        params=_ROUND_ATTEMPT,
        body_limit="binary",
    ),
    Endpoint(
        "get_log",
        "GET",
        "/audit/log",
        "transparency-log lines from ?from on (JSON lines, at most a bounded number)",
        CHECKERS,
        response=Opaque("JSON lines", binary=True),
        params=(Param("from", "query", _TOKEN),),
    ),
    Endpoint(
        "get_archive",
        "GET",
        "/audit/archive/{sha256}",
        "an archived protocol message by its SHA-256 (what the log's accepted entries name)",
        CHECKERS,
        response=Opaque("archived bytes", binary=True),
        params=(
            Param("sha256", "path", {"type": "string", "pattern": "^[0-9a-f]{64}$"}, required=True),
        ),
    ),
    Endpoint(
        "post_verdicts",
        "POST",
        "/audit/verdicts",
        "the calling auditor's control-sample verdicts; a failed one raises an audit_failed alert",
        AUDITOR,
        request=wire.VerdictSubmission,
        response=wire.VerdictReceipt,
    ),
    Endpoint(
        "post_quarantine",
        "POST",
        "/audit/quarantine",
        "suspend a member the control-sample audit failed from future cohorts: an order "
        "signed by the admin or by the calling auditor; raises a member_quarantined alert "
        "that offers the rollback",
        AUDITOR,
        request=wire.QuarantineOrder,
        response=wire.QuarantineAnswer,
    ),
    Endpoint(
        "ack_alert",
        "POST",
        "/alerts/{alert}/ack",
        "a webhook receiver acknowledges an alert with the capability its delivery carried",
        PUBLIC,
        request=wire.AlertAck,
        response=wire.AlertView,
        params=(_ALERT,),
        capability=True,
    ),
    Endpoint(
        "dashboard",
        "GET",
        "/dashboard",
        "the operator dashboard (HTML); a browser without a session gets the sign-in form (401)",
        PUBLIC,
        response=Opaque("HTML page"),
        answer_note="the page",
        scope="dashboard",
        prefixed=False,
    ),
    Endpoint(
        "dashboard_session",
        "POST",
        "/dashboard",
        "the sign-in form: trades a dashboard token, sent form-encoded in the body "
        "(token=...), for a session cookie and redirects (303) to the dashboard; the token "
        "is never in an address",
        PUBLIC,
        request=Opaque("form: token=<dashboard token>"),
        response=Opaque("303 to /dashboard, Set-Cookie"),
        answer_note="303 to the dashboard",
        scope="dashboard",
        prefixed=False,
    ),
    Endpoint(
        "dashboard_asset",
        "GET",
        "/dashboard/assets/{name}",
        "the dashboard's script and style sheet (code only, no federation data)",
        PUBLIC,
        response=Opaque("JavaScript or CSS"),
        answer_note="the file",
        params=(Param("name", "path", {"type": "string", "maxLength": 64}, required=True),),
        prefixed=False,
    ),
    Endpoint(
        "dashboard_snapshot",
        "GET",
        "/dashboard/api/snapshot",
        "what the dashboard shows: the attempt in progress, rounds, members, alerts, "
        "model versions (aggregates only)",
        PUBLIC,
        response=wire.DashboardSnapshot,
        scope="dashboard",
        prefixed=False,
    ),
    Endpoint(
        "dashboard_events",
        "GET",
        "/dashboard/api/events",
        "server-sent events: a DashboardSnapshot whenever the federation changes, at most "
        "one per dashboard.push_interval_s",
        PUBLIC,
        response=Opaque("text/event-stream of DashboardSnapshot"),
        answer_note="event stream",
        scope="dashboard",
        prefixed=False,
    ),
    Endpoint(
        "metrics",
        "GET",
        "/metrics",
        "Prometheus metrics (text exposition format)",
        PUBLIC,
        response=Opaque("Prometheus text format"),
        answer_note="metrics",
        scope="metrics",
        prefixed=False,
    ),
)

#: Each endpoint by its name.
BY_NAME: Final[Mapping[str, Endpoint]] = {ep.name: ep for ep in ENDPOINTS}


def structs() -> tuple[type[msgspec.Struct], ...]:
    """Every wire struct an endpoint takes or answers, in table order, each once."""
    found: dict[type[msgspec.Struct], None] = {}
    for ep in ENDPOINTS:
        for payload in (ep.request, ep.response, *ep.alternatives):
            if isinstance(payload, type):
                found[payload] = None
    return tuple(found)
