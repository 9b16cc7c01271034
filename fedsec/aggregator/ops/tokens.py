"""Bearer tokens for observers: what opens the dashboard in a browser, or ``/metrics``
to a scraper, neither of which can sign RFC 9421 requests.

A token is 256 random bits from the OS CSPRNG, shown once when issued
(``fedsec aggregator dashboard-token``) and stored only as its SHA-256 (a hash suffices
for a secret of that entropy: nothing to brute-force).  Each is bound to one observer of
the roster and one scope, and expires; it stops working the moment it is revoked, it
expires, or its observer is revoked from the roster.  Lookup is by hash, so the
comparison is of digests and leaks nothing about the token through timing.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Final

from fedsec.aggregator.storage.interfaces import TokenRow, TokenStore
from fedsec.aggregator.storage.roster_file import Roster
from fedsec.errors import AuthError, ConfigError, ForbiddenError
from fedsec.protocol.endpoints import TokenScope

#: Tokens read ``fdt_`` + 64 hex digits: the prefix lets secret scanners find leaked ones.
PREFIX: Final = "fdt_"
TOKEN_BYTES: Final = 32
TOKEN_CHARS: Final = len(PREFIX) + 2 * TOKEN_BYTES
#: The longest lifetime a token may be issued with: 30 days; longer-lived credentials
#: belong in the roster (a key), not in a browser.
MAX_TTL_S: Final = 30 * 24 * 3600.0
SCOPES: Final[tuple[TokenScope, ...]] = ("dashboard", "metrics")
#: The one spelling of a token: checked before anything else touches it, so a header
#: carrying any other byte (not ASCII, not UTF-8) is refused as malformed (401).
_SHAPE: Final = re.compile(rf"{PREFIX}[0-9a-f]{{{2 * TOKEN_BYTES}}}")


def digest(token: str) -> str:
    """The stored form of ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def issue(
    store: TokenStore,
    roster: Roster,
    observer: str,
    scope: TokenScope,
    ttl_s: float,
    now: float,
) -> tuple[str, TokenRow]:
    """Issue a token of ``scope`` to ``observer`` for ``ttl_s`` seconds.

    Returns:
        The token (shown once, never stored) and its stored row.

    Raises:
        ConfigError: ``observer`` is not an active observer of the roster, the scope is
            unknown, or ``ttl_s`` is not in (0, :data:`MAX_TTL_S`].
    """
    entry = roster.get(observer)
    if entry is None or not entry.is_active or entry.role != "observer":
        raise ConfigError(
            f"{observer} is not an active observer of the roster; enrol one with "
            "`fedsec aggregator roster add --role observer`"
        )
    if scope not in SCOPES:
        raise ConfigError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if not (0 < ttl_s <= MAX_TTL_S):
        raise ConfigError(
            f"a token's lifetime must be more than 0 s and at most {MAX_TTL_S:.0f} s "
            f"(30 days), got {ttl_s:g}"
        )
    token = PREFIX + secrets.token_hex(TOKEN_BYTES)
    row = TokenRow(digest(token), observer, scope, now, now + ttl_s, False)
    store.add(row)
    return token, row


def check(store: TokenStore, roster: Roster, token: str, scope: TokenScope, now: float) -> str:
    """The observer ``token`` speaks for, when it opens ``scope`` now.

    Raises:
        AuthError: the token is malformed, unknown, revoked or expired, or its observer
            is no longer an active observer.
        ForbiddenError: the token is valid but of another scope.
    """
    if len(token) != TOKEN_CHARS or _SHAPE.fullmatch(token) is None:
        raise AuthError("the token is not a fedsec dashboard token (fdt_ and 64 hex digits)")
    row = store.get(digest(token))
    if row is None or row.revoked:
        raise AuthError("the token is unknown or revoked")
    if now >= row.expires_at:
        raise AuthError("the token has expired; issue a new one with dashboard-token")
    entry = roster.get(row.observer)
    if entry is None or not entry.is_active or entry.role != "observer":
        raise AuthError("the token's observer is no longer in the roster")
    if row.scope != scope:
        raise ForbiddenError(f"the token opens {row.scope}, not {scope}")
    return row.observer
