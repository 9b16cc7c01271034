"""Who may call which endpoint, and what it hands out: the access matrix of
``docs/access-matrix.md``, generated from :data:`fedsec.protocol.endpoints.ENDPOINTS`.

The matrix is derived, never written by hand, for the same reason as the endpoint table
of ``docs/api.md``: the aggregator enforces exactly what an endpoint declares (its
signature roles, its token scope, its capability), so a table built from the same
declarations cannot claim an access the aggregator does not grant, or miss one it does.
"""

from __future__ import annotations

from typing import Final, get_args

from fedsec.protocol.endpoints import ENDPOINTS, Endpoint
from fedsec.protocol.roster import Role

#: A cell of a caller kind that may call the endpoint.
GRANTED: Final = "✓"
#: The roster roles that sign their requests (RFC 9421), one column each, in this order.
SIGNING_ROLES: Final[tuple[Role, ...]] = get_args(Role)
#: The matrix's columns after method and path.
CALLER_COLUMNS: Final = (*SIGNING_ROLES, "observer token", "capability", "public")


def _callers(ep: Endpoint) -> tuple[str, ...]:
    """One cell per :data:`CALLER_COLUMNS`: the mark where that kind of caller is let in.

    Each endpoint has exactly one way in (:attr:`Endpoint.auth`), so exactly one group of
    columns is marked: the signing roles it names, its token scope, its capability, or
    public.
    """
    auth = ep.auth
    roles = tuple(GRANTED if role in ep.roles else "" for role in SIGNING_ROLES)
    token = f"{GRANTED} `{ep.scope}`" if auth == "token" else ""
    capability = GRANTED if auth == "capability" else ""
    public = GRANTED if auth == "none" else ""
    return (*roles, token, capability, public)


def _cell(text: str) -> str:
    # a literal | would end the cell early in GitHub-flavoured Markdown
    return text.replace("|", "\\|")


def access_matrix_markdown() -> str:
    """The roles × endpoints × data matrix: one row per endpoint, in table order.

    Columns: method, path (:attr:`Endpoint.template`, with the API prefix where the
    endpoint has one), one per caller kind (:data:`CALLER_COLUMNS`: the roster roles
    that sign, an observer's bearer token naming its scope, the alert acknowledgement
    capability, public), and what the endpoint hands out or takes (its summary).

    Returns:
        A GitHub-flavoured Markdown table, ending in a newline.
    """
    header = ("method", "path", *CALLER_COLUMNS, "data")
    rows = [
        f"| {' | '.join(header)} |",
        f"|{'---|' * 2}{':-:|' * len(CALLER_COLUMNS)}---|",
    ]
    for ep in ENDPOINTS:
        cells = (ep.method, f"`{ep.template}`", *_callers(ep), _cell(ep.summary))
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"
