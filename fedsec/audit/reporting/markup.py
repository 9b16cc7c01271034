"""HTML pieces every part of the audit report uses: escaping, numbers, times, keys."""

from __future__ import annotations

import html
import time
from collections.abc import Iterable
from typing import Any

from fedsec.errors import FedsecError


def escape(value: Any) -> str:
    """HTML-escape anything for text or attribute context."""
    return html.escape(str(value), quote=True)


_e = escape


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def when(t: float | None) -> str:
    if t is None:
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def key_cell(hex_key: Any) -> str:
    """A public key as its key id above the hex (a malformed key as it stands)."""
    from fedsec.crypto.identity import key_id

    try:
        kid = key_id(bytes.fromhex(str(hex_key)))
    except (ValueError, FedsecError):  # a malformed key is shown as it stands
        return f'<span class="mono">{_e(hex_key)}</span>'
    return f'{_e(kid)}<br><span class="mono">{_e(hex_key)}</span>'


def kv(rows: Iterable[tuple[str, str]]) -> str:
    """A two-column table of (label, HTML) rows."""
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'
