"""docs/access-matrix.md holds exactly the matrix generated from the endpoint table, so
the document an access review reads is the access the aggregator enforces."""

from __future__ import annotations

import re
from pathlib import Path

from fedsec.protocol.access import CALLER_COLUMNS, access_matrix_markdown
from fedsec.protocol.endpoints import ENDPOINTS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "access-matrix.md"
SECTION = re.compile(r"<!-- access-matrix:begin -->\n(.*?)<!-- access-matrix:end -->", re.S)


def test_docs_access_matrix_md_holds_exactly_the_generated_matrix() -> None:
    found = SECTION.search(DOCS.read_text(encoding="utf-8"))
    assert found, "docs/access-matrix.md lost its access-matrix:begin/end markers"
    assert found.group(1) == access_matrix_markdown(), (
        "docs/access-matrix.md is stale: regenerate it with "
        "fedsec.protocol.access.access_matrix_markdown()"
    )


def test_every_endpoint_has_one_row_with_exactly_one_way_in() -> None:
    rows = access_matrix_markdown().splitlines()[2:]
    assert len(rows) == len(ENDPOINTS)
    for ep, row in zip(ENDPOINTS, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[:2] == [ep.method, f"`{ep.template}`"]
        callers = dict(zip(CALLER_COLUMNS, cells[2 : 2 + len(CALLER_COLUMNS)], strict=True))
        marked = {kind for kind, cell in callers.items() if cell}
        match ep.auth:
            case "signature":
                assert marked == set(ep.roles), ep.name
            case "token":
                assert (
                    marked == {"observer token"} and f"`{ep.scope}`" in callers["observer token"]
                ), ep.name
            case "capability":
                assert marked == {"capability"}, ep.name
            case "none":
                assert marked == {"public"}, ep.name


def test_only_liveness_the_api_document_and_the_dashboard_code_are_public() -> None:
    # A new endpoint that forgot its roles, scope or capability would be public: every
    # one of these must hand out nothing of the federation's.
    public = {ep.name for ep in ENDPOINTS if ep.auth == "none"}
    assert public == {"health", "openapi", "dashboard_asset"}
