"""The OpenAPI 3.1 document of the aggregator API, built from the wire schemas."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from fedsec.aggregator.transport import PARSER_REJECTIONS_NOTE
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_COUNT, MAX_ID

_SCHEMAS: tuple[type, ...] = (
    wire.RoundState,
    wire.JoinRequest,
    wire.JoinResponse,
    wire.PrivacyReport,
    wire.AdvertiseKeysBody,
    wire.KeyListBody,
    wire.ShareKeysBody,
    wire.ShareRelayBody,
    wire.UnmaskRequestBody,
    wire.UnmaskResponseBody,
    wire.Accepted,
    wire.Receipt,
    wire.MaskedInputAnswer,
    wire.FederationStatus,
    wire.ErrorBody,
    wire.ChallengeRequest,
    wire.Challenge,
    wire.ChallengeList,
    wire.RevealBody,
    wire.Reveal,
    wire.RevealList,
)

_SIGNED = "RFC 9421 HTTP Message Signature (Ed25519) of a roster member"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _ok(name: str | None, description: str = "OK") -> dict[str, Any]:
    errors = {
        code: {"description": text, "content": {"application/json": {"schema": _ref("ErrorBody")}}}
        for code, text in (
            ("400", "malformed or invalid request"),
            ("401", "missing, bad or replayed signature; unknown or revoked key"),
            ("403", "role not allowed, or member not in this round"),
            ("409", "wrong round, attempt or stage; duplicate message"),
            ("408", "the body did not arrive within server.body_timeout_s"),
            ("413", "body over the configured limit"),
            ("415", "a Content-Encoding was sent; bodies travel uncompressed"),
        )
    }
    retry: dict[str, Any] = {
        "headers": {
            "Retry-After": {"description": "seconds", "schema": {"type": "integer", "minimum": 1}}
        },
        "content": {"application/json": {"schema": _ref("ErrorBody")}},
    }
    errors["429"] = {"description": "the member key is over its request rate", **retry}
    errors["503"] = {"description": "no capacity now (every upload slot busy)", **retry}
    content = {"application/json": {"schema": _ref(name)}} if name else {}
    ok: dict[str, Any] = {"description": description}
    if content:
        ok["content"] = content
    return {"200": ok, **errors}


# Path and query integers: canonical ASCII decimal, bounded (wire.parse_uint).
_ID = {"type": "integer", "minimum": 0, "maximum": MAX_ID}
_ROUND = {"name": "round", "in": "path", "required": True, "schema": _ID}
_ATTEMPT = {"name": "attempt", "in": "query", "required": False, "schema": _ID}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": _ID}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}
_SECONDS = {"type": "number", "minimum": 0}

_DESCRIPTION = (
    "Every request but /health and /openapi.json is signed (RFC 9421, Ed25519) by an "
    "active roster key; the signature, key, role, created time, nonce and the key's rate "
    "are checked before the body is read. Errors are JSON {error, detail}. "
)


def _wait(until: str) -> dict[str, Any]:
    return {
        "name": "wait",
        "in": "query",
        "required": False,
        "description": (
            f"seconds (at most 25) the aggregator may hold the answer until {until}; "
            "0 or absent answers at once"
        ),
        "schema": _SECONDS,
    }


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    op.update(extra)
    return op


@cache
def openapi_document() -> dict[str, Any]:
    """The document served at /v1/openapi.json."""
    _, components = msgspec.json.schema_components(
        _SCHEMAS, ref_template="#/components/schemas/{name}"
    )
    p = wire.API_PREFIX
    r = f"{p}/rounds/{{round}}"
    rp = [_ROUND, _ATTEMPT]
    binary = {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    }
    paths: dict[str, Any] = {
        f"{p}/health": {"get": _op("liveness", {"200": {"description": "alive"}}, security=[])},
        f"{p}/openapi.json": {
            "get": _op("this document", {"200": {"description": "OpenAPI"}}, security=[])
        },
        f"{p}/status": {
            "get": _op("federation status, alerts and round history", _ok("FederationStatus"))
        },
        f"{p}/round": {
            "get": _op(
                "current round; long-polls while the token equals ?wait",
                _ok("RoundState"),
                parameters=[
                    {"name": "wait", "in": "query", "schema": _TOKEN},
                    {"name": "timeout", "in": "query", "schema": _SECONDS},
                ],
            )
        },
        f"{p}/roster": {"get": _op("admin-signed roster entries", _ok(None))},
        f"{p}/models/latest": {"get": _op("manifest of the newest good model", _ok(None))},
        f"{p}/models/{{version}}/manifest": {
            "get": _op("signed manifest", _ok(None), parameters=[_VERSION])
        },
        f"{p}/models/{{version}}": {
            "get": _op(
                "safetensors model file",
                {"200": {"description": "model", **binary}},
                parameters=[_VERSION],
            )
        },
        f"{r}/join": {
            "post": _op(
                "join the cohort",
                _ok("JoinResponse"),
                parameters=rp,
                requestBody=_json_body("JoinRequest"),
            )
        },
        f"{r}/report": {
            "post": _op(
                "signed privacy report",
                _ok(None),
                parameters=rp,
                requestBody=_json_body("PrivacyReport"),
            )
        },
        f"{r}/advertise": {
            "post": _op(
                "advertise ephemeral keys; with ?wait the answer is held until share_keys "
                "and carries the caller's key list (keys)",
                _ok("Accepted"),
                parameters=[*rp, _wait("the round reaches share_keys")],
                requestBody=_json_body("AdvertiseKeysBody"),
            )
        },
        f"{r}/keys": {
            "get": _op(
                "relayed key list",
                _ok("KeyListBody"),
                parameters=[*rp, _wait("the round reaches share_keys")],
            )
        },
        f"{r}/shares": {
            "post": _op(
                "encrypted Shamir shares, optionally with the caller's privacy report for "
                "the attempt (instead of POST report); with ?wait the answer is held until "
                "masked_input and carries the caller's share relay (relay)",
                _ok("Accepted"),
                parameters=[*rp, _wait("the round reaches masked_input")],
                requestBody=_json_body("ShareKeysBody"),
            ),
            "get": _op(
                "shares addressed to the caller",
                _ok("ShareRelayBody"),
                parameters=[*rp, _wait("the round reaches masked_input")],
            ),
        },
        f"{r}/masked-input": {
            "post": _op(
                "masked, packed input vector; answered with the signed Receipt, or, when "
                "?wait is given, with MaskedInputAnswer (the receipt, held until the unmask "
                "stage, and the caller's unmask request)",
                {
                    **_ok(None),
                    "200": {
                        "description": "Receipt; MaskedInputAnswer when ?wait is given",
                        "content": {
                            "application/json": {
                                "schema": {"oneOf": [_ref("Receipt"), _ref("MaskedInputAnswer")]}
                            }
                        },
                    },
                },
                parameters=[
                    *rp,
                    _wait("the round reaches unmask"),
                    {
                        "name": "commitment",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                    },
                    {
                        "name": "signature",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "pattern": "^[0-9a-f]{128}$"},
                    },
                ],
                requestBody={"required": True, **binary},
            )
        },
        f"{r}/unmask": {
            "get": _op(
                "survivors and dropped members",
                _ok("UnmaskRequestBody"),
                parameters=[*rp, _wait("the round reaches unmask")],
            ),
            "post": _op(
                "shares for unmasking; with ?wait the answer is held until the attempt is "
                "over and carries the round state then (state). The stage closes once the "
                "answers decide the sum; a survivor's answer after that close is accepted "
                "as not needed and stores nothing",
                _ok("Accepted"),
                parameters=[*rp, _wait("the attempt is over")],
                requestBody=_json_body("UnmaskResponseBody"),
            ),
        },
        f"{p}/audit/challenges": {
            "post": _op(
                "auditor challenges a member's round",
                _ok("Challenge"),
                requestBody=_json_body("ChallengeRequest"),
            ),
            "get": _op("open challenges addressed to the caller", _ok("ChallengeList")),
        },
        f"{p}/audit/reveals": {
            "post": _op(
                "sealed reveal answering a challenge",
                _ok("Reveal"),
                requestBody=_json_body("RevealBody"),
            ),
            "get": _op("reveals sealed to the calling auditor", _ok("RevealList")),
        },
        f"{r}/receipt": {
            "get": _op("signed receipt of the caller's contribution", _ok("Receipt"), parameters=rp)
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "fedsec aggregator",
            "version": "1",
            "description": _DESCRIPTION + PARSER_REJECTIONS_NOTE,
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "httpsig": {"type": "http", "scheme": "signature", "description": _SIGNED}
            },
        },
        "security": [{"httpsig": []}],
    }
