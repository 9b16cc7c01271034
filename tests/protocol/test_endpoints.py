"""The endpoint table is the one list of routes: the router, the OpenAPI document and
docs/api.md are generated from it, and the roles and body limits it declares are the
ones the aggregator enforces."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http import app as aggregator_app
from fedsec.aggregator.http import make_app
from fedsec.aggregator.openapi import openapi_document
from fedsec.crypto.httpsig import sign_request
from fedsec.protocol import wire
from fedsec.protocol.api_table import markdown_table
from fedsec.protocol.endpoints import BY_NAME, ENDPOINTS, Endpoint
from fedsec.protocol.limits import MAX_COUNT, MAX_ID
from tests.support.aggregator import Federation, make_federation, snapshot

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MAX_BODY = 4096
MAX_JSON = 2048
# one enrolled member per role
CALLER = {"agent": "a0", "observer": "obs", "auditor": "aud", "custodian": "kh"}
SIGNED = [ep for ep in ENDPOINTS if ep.roles]


def _id(ep: Endpoint) -> str:
    return ep.name


def _example_path(ep: Endpoint) -> str:
    """The endpoint's path with every placeholder filled in."""
    return re.sub(r"\{[a-z0-9]+\}", "1", ep.template)


def _placeholders(ep: Endpoint) -> set[str]:
    return set(re.findall(r"\{([a-z0-9]+)\}", ep.path))


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(
        tmp_path / "ws",
        agents=("a0", "a1", "a2"),
        observers=("obs",),
        auditors=("aud",),
        custodians=("kh",),
        server={"max_body_bytes": MAX_BODY, "max_json_bytes": MAX_JSON},
        validation=False,
    )


Served = tuple[TestClient, Federation, Coordinator]


@pytest_asyncio.fixture
async def served(fed: Federation, aiohttp_client: Callable[..., Awaitable[TestClient]]) -> Served:
    coord = Coordinator(fed.ws)
    return await aiohttp_client(make_app(fed.ws, coord)), fed, coord


async def _call(served: Served, who: str, ep: Endpoint, body: bytes) -> tuple[int, dict[str, str]]:
    client, fed, _ = served
    path = _example_path(ep)
    headers = sign_request(fed.identities[who], ep.method, path, {}, body)
    async with client.request(ep.method, path, data=body, headers=headers) as resp:
        raw = await resp.read()
        # a refusal is always JSON; an answer may be bytes (the model download)
        return resp.status, json.loads(raw) if resp.content_type == "application/json" else {}


# -- the table itself --------------------------------------------------------------------------


def test_the_table_lists_42_distinct_routes() -> None:
    # 21 protocol routes (SecAgg+ consistency: a signature up, a proof down; federated
    # evaluation's reports), 6 audit
    # (challenges, reveals, verdicts, quarantine), 7 operations, 8 of homomorphic
    # summation (context, commit: a commitment up, the set down; sum, decryption; the
    # log and its archive)
    assert len(ENDPOINTS) == 42
    assert len(BY_NAME) == len(ENDPOINTS)
    assert len({(ep.method, ep.template) for ep in ENDPOINTS}) == len(ENDPOINTS)
    # only the browser's and the scraper's routes live outside the API prefix
    outside = {ep.template for ep in ENDPOINTS if not ep.template.startswith(f"{wire.API_PREFIX}/")}
    assert outside == {
        "/dashboard",
        "/dashboard/assets/{name}",
        "/dashboard/api/snapshot",
        "/dashboard/api/events",
        "/metrics",
    }
    assert all(ep.prefixed == (ep.template not in outside) for ep in ENDPOINTS)


def test_every_endpoint_has_a_handler_and_every_handler_an_endpoint() -> None:
    assert set(aggregator_app._HANDLERS) == set(BY_NAME)
    # one handler per endpoint: the handler is how a request finds its endpoint
    assert len(set(aggregator_app._HANDLERS.values())) == len(ENDPOINTS)
    for name, handler in aggregator_app._HANDLERS.items():
        assert aggregator_app._ENDPOINT_OF[handler] is BY_NAME[name]


@pytest.mark.parametrize("ep", ENDPOINTS, ids=_id)
def test_path_parameters_are_the_templates_placeholders(ep: Endpoint) -> None:
    path_params = {p.name for p in ep.params if p.where == "path"}
    assert path_params == _placeholders(ep)
    assert all(p.required for p in ep.params if p.where == "path")
    assert len({(p.name, p.where) for p in ep.params}) == len(ep.params)


def test_only_health_openapi_and_the_dashboard_code_are_public() -> None:
    public = [ep.name for ep in ENDPOINTS if ep.auth == "none"]
    assert public == ["health", "openapi", "dashboard_asset"]
    # the rest without a signature take an observer's token, or the alert's capability
    tokens = {ep.name: ep.scope for ep in ENDPOINTS if ep.auth == "token"}
    assert tokens == {
        "dashboard": "dashboard",
        "dashboard_session": "dashboard",  # the token in the sign-in form's body
        "dashboard_snapshot": "dashboard",
        "dashboard_events": "dashboard",
        "metrics": "metrics",
    }
    assert [ep.name for ep in ENDPOINTS if ep.auth == "capability"] == ["ack_alert"]


def test_ids_in_paths_and_queries_are_bounded_like_the_wire() -> None:
    ids = {"round", "attempt", "version"}
    for ep in ENDPOINTS:
        for p in ep.params:
            if p.name in ids:
                assert p.schema == {"type": "integer", "minimum": 0, "maximum": MAX_ID}, ep.name
    token = BY_NAME["get_round"].params[0]
    assert (token.name, token.schema["maximum"]) == ("wait", MAX_COUNT)


def test_only_masked_input_reveals_and_decryptions_take_large_bodies() -> None:
    large = {ep.name for ep in ENDPOINTS if ep.body_limit == "binary"}
    assert large == {"masked_input", "post_reveal", "post_decryption"}


# -- what is generated from it -----------------------------------------------------------------


def test_the_router_serves_exactly_the_table(fed: Federation) -> None:
    app = make_app(fed.ws, Coordinator(fed.ws))
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    assert routes == {(ep.method, ep.template) for ep in ENDPOINTS}
    app[aggregator_app.NONCES].close()


@pytest.mark.parametrize("ep", ENDPOINTS, ids=_id)
def test_each_openapi_operation_is_its_endpoint(ep: Endpoint) -> None:
    op = openapi_document()["paths"][ep.template][ep.method.lower()]
    assert op["summary"] == ep.summary
    expected_security = {"none": [], "capability": [], "token": [{"bearer": []}, {}]}
    assert op.get("security") == expected_security.get(ep.auth)
    assert ("requestBody" in op) == (ep.request is not None)
    params = [(p["name"], p["in"], p["required"], p["schema"]) for p in op.get("parameters", [])]
    assert params == [(p.name, p.where, p.required, dict(p.schema)) for p in ep.params]
    assert op["responses"]["200"]["description"] == ep.answer_note
    # every authenticated operation but the model download documents its refusals
    documents_refusals = ep.auth != "none" and ep.name != "model"
    assert ("401" in op["responses"]) == documents_refusals


def test_the_openapi_document_has_no_operation_outside_the_table() -> None:
    paths = openapi_document()["paths"]
    documented = {(path, method) for path, ops in paths.items() for method in ops}
    assert documented == {(ep.template, ep.method.lower()) for ep in ENDPOINTS}


def test_masked_input_answers_a_receipt_or_the_held_answer() -> None:
    op = openapi_document()["paths"]["/v1/rounds/{round}/masked-input"]["post"]
    schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {
        "oneOf": [
            {"$ref": "#/components/schemas/Receipt"},
            {"$ref": "#/components/schemas/MaskedInputAnswer"},
        ]
    }
    assert set(op["requestBody"]["content"]) == {"application/octet-stream"}


def test_docs_api_md_holds_exactly_the_generated_table() -> None:
    text = DOCS.read_text(encoding="utf-8")
    found = re.search(r"<!-- endpoints:begin[^>]*-->\n(.*?)<!-- endpoints:end -->", text, re.S)
    assert found, "docs/api.md lost its endpoints:begin/end markers"
    assert found.group(1) == markdown_table(), (
        "docs/api.md is stale: regenerate its table with fedsec.protocol.api_table.markdown_table()"
    )
    assert len(markdown_table().splitlines()) == 2 + len(ENDPOINTS)


def test_the_wire_docstring_points_at_the_table_instead_of_copying_it() -> None:
    assert wire.__doc__ is not None and "docs/api.md" in wire.__doc__
    assert "/rounds/" not in wire.__doc__


# -- what the aggregator enforces from it ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("ep", SIGNED, ids=_id)
async def test_roles_outside_the_table_are_refused(served: Served, ep: Endpoint) -> None:
    _, fed, coord = served
    for role, who in CALLER.items():
        before = snapshot(fed.ws, coord)
        status, body = await _call(served, who, ep, b"")
        if role in ep.roles:
            assert not (status == 403 and "has role" in body.get("detail", "")), (role, body)
        else:
            assert (status, body["error"]) == (403, "forbidden"), (role, body)
            assert f"has role {role}" in body["detail"]
            assert snapshot(fed.ws, coord) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("ep", SIGNED, ids=_id)
async def test_the_tables_body_limit_is_the_one_enforced(served: Served, ep: Endpoint) -> None:
    _, fed, coord = served
    who = CALLER[ep.roles[0]]
    limit = MAX_BODY if ep.body_limit == "binary" else MAX_JSON
    before = snapshot(fed.ws, coord)
    status, body = await _call(served, who, ep, b"x" * (limit + 1))
    assert (status, body["error"]) == (413, "payload_too_large"), body
    assert snapshot(fed.ws, coord) == before
    if ep.body_limit == "binary":
        # over the JSON limit but within the binary one: read, then judged on content
        status, body = await _call(served, who, ep, b"x" * (MAX_JSON + 1))
        assert status == 400 and body["error"] != "payload_too_large", body
