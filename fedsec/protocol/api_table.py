"""The endpoint table of ``docs/api.md``, generated from
:data:`fedsec.protocol.endpoints.ENDPOINTS` so it cannot drift from the routes the
aggregator serves (regenerate it with :func:`markdown_table`)."""

from __future__ import annotations

import msgspec

from fedsec.protocol.endpoints import ENDPOINTS, LIMIT_SETTINGS, Endpoint, Opaque, Payload


def _label(payload: Payload | None, alternatives: tuple[type[msgspec.Struct], ...] = ()) -> str:
    if payload is None:
        return "—"
    first = payload.label if isinstance(payload, Opaque) else payload.__name__
    return " \\| ".join([f"`{first}`", *(f"`{alt.__name__}`" for alt in alternatives)])


def _who(ep: Endpoint) -> str:
    """Who may call ``ep``, in words."""
    match ep.auth:
        case "signature":
            return " or ".join(ep.roles)
        case "token":
            return f"observer's {ep.scope} token (or loopback)"
        case "capability":
            return "holder of the alert's capability"
        case _:
            return "anyone (unsigned)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The endpoint table of ``docs/api.md``: one row per endpoint, in table order.

    Returns:
        A GitHub-flavoured Markdown table, ending in a newline.
    """
    rows = [
        "| method | path | query | request → answer | roles | body limit | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for ep in ENDPOINTS:
        query = ", ".join(f"`{p.name}`" for p in ep.params if p.where == "query") or "—"
        roles = _who(ep)
        exchange = f"{_label(ep.request)} → {_label(ep.response, ep.alternatives)}"
        cells = (
            ep.method,
            f"`{ep.template}`",
            query,
            exchange,
            roles,
            f"`{LIMIT_SETTINGS[ep.body_limit]}`",
            _cell(ep.summary),
        )
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"
