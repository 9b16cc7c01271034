"""The OpenAPI 3.1 document of the aggregator API, generated from the endpoint table
(:data:`fedsec.protocol.endpoints.ENDPOINTS`) and the wire schemas."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from fedsec.aggregator.transport import PARSER_REJECTIONS_NOTE
from fedsec.protocol import compact, wire
from fedsec.protocol.endpoints import ENDPOINTS, Endpoint, Opaque, Param, Payload, structs

_SIGNED = "RFC 9421 HTTP Message Signature (Ed25519) of a roster member"

_PUBLIC = " and ".join(ep.template for ep in ENDPOINTS if ep.auth == "none")
_TOKEN = " and ".join(ep.template for ep in ENDPOINTS if ep.auth == "token")
_DESCRIPTION = (
    f"Every request but {_PUBLIC} (public), {_TOKEN} (an observer's bearer token, or "
    "loopback where configured) and the alert acknowledgement (the alert's capability) "
    "is signed (RFC 9421, Ed25519) by an active roster key; the signature, key, role, "
    "created time, nonce and the key's rate are checked before the body is read. Errors "
    "are JSON {error, detail}. "
)
_BEARER = "a dashboard- or metrics-scope token from `fedsec aggregator dashboard-token`"

_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
# a SecAgg+ upload's compact form (fedsec.protocol.compact): the JSON struct's fields as
# a msgpack array, keys and shares as bin
_COMPACT = {"schema": {"type": "string", "format": "binary"}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors() -> dict[str, Any]:
    """The refusals any signed endpoint may answer."""
    errors: dict[str, Any] = {
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
    return errors


def _content(payload: Payload | None, alternatives: tuple[type, ...] = ()) -> dict[str, Any]:
    """The ``content`` of a body or answer; empty for none or opaque JSON."""
    if isinstance(payload, Opaque):
        return _BINARY if payload.binary else {}
    if payload is None:
        return {}
    if alternatives:
        schema = {"oneOf": [_ref(kind.__name__) for kind in (payload, *alternatives)]}
    else:
        schema = _ref(payload.__name__)
    return {"application/json": {"schema": schema}}


def _responses(ep: Endpoint) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": ep.answer_note}
    if content := _content(ep.response, ep.alternatives):
        ok["content"] = content
    # public routes refuse nothing of note; the model download has never listed its
    # refusals (kept so the document stays what clients were generated from)
    if ep.auth == "none" or ep.name == "model":
        return {"200": ok}
    if ep.auth != "signature":
        kept = ("400", "401", "403", "404") if ep.capability else ("400", "401", "403")
        errors = _errors()
        if ep.capability:
            errors["404"] = {**errors["400"], "description": "no such alert"}
        return {"200": ok, **{code: errors[code] for code in kept}}
    return {"200": ok, **_errors()}


def _parameter(param: Param) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": param.name, "in": param.where, "required": param.required}
    if param.description:
        doc["description"] = param.description
    doc["schema"] = dict(param.schema)
    return doc


def _operation(ep: Endpoint) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": ep.summary, "responses": _responses(ep)}
    if ep.params:
        op["parameters"] = [_parameter(p) for p in ep.params]
    if ep.request is not None:
        op["requestBody"] = {"required": True, "content": _content(ep.request)}
        if ep.request in compact.KINDS:
            op["requestBody"]["content"][compact.MEDIA_TYPE] = _COMPACT
    if ep.auth == "token":
        op["security"] = [{"bearer": []}, {}]
    elif ep.auth != "signature":
        op["security"] = []
    return op


@cache
def openapi_document() -> dict[str, Any]:
    """The document served at /v1/openapi.json: one operation per endpoint."""
    _, components = msgspec.json.schema_components(
        (*structs(), wire.ErrorBody), ref_template="#/components/schemas/{name}"
    )
    paths: dict[str, Any] = {}
    for ep in ENDPOINTS:
        paths.setdefault(ep.template, {})[ep.method.lower()] = _operation(ep)
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
                "httpsig": {"type": "http", "scheme": "signature", "description": _SIGNED},
                "bearer": {"type": "http", "scheme": "bearer", "description": _BEARER},
            },
        },
        "security": [{"httpsig": []}],
    }
