"""What every benchmark result carries (software versions, peak memory), and helpers for
benchmarks that run an aggregator as its own process."""

from __future__ import annotations

import contextlib
import datetime
import platform
import resource
import socket
import sys
import urllib.error
import urllib.request
from importlib import metadata
from typing import Any

import msgspec

from fedsec.crypto.httpsig import sign_request
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import AuthError, ForbiddenError
from fedsec.protocol import wire


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "machine": platform.machine()}
    for dist in ("fedsec", "numpy", "cryptography", "pynacl", "torch", "opacus", "aiohttp"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def with_environment(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its peak memory, the software versions and ``recorded_at`` (UTC,
    ISO 8601): ``fedsec bench compare`` takes the newest recorded row as its baseline."""
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    result["versions"] = versions()
    result.setdefault(
        "recorded_at", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    )
    return result


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Seconds one status request may take: the tools poll it every 0.1-0.3 s, and an
#: aggregator busy closing a round answers within well under a second.
STATUS_TIMEOUT_S = 2.0


def aggregator_alive(url: str) -> bool:
    """Whether the aggregator at ``url`` answers its public ``GET /health``."""
    try:
        with urllib.request.urlopen(
            f"{url}{wire.API_PREFIX}/health", timeout=STATUS_TIMEOUT_S
        ) as resp:
            return bool(msgspec.json.decode(resp.read()).get("status") == "ok")
    except (OSError, msgspec.DecodeError, AttributeError):
        return False


def federation_status(url: str, observer: SigningIdentity) -> wire.FederationStatus | None:
    """``GET /status`` of the aggregator at ``url``, signed by ``observer`` (an active
    roster entry of any role, :func:`fedsec.federation.load_observer`); None while it
    does not answer (not listening yet, a timeout, 5xx, 429).

    Raises:
        AuthError: the aggregator refused the signature (401) or the role (403).  The
            tools enrol their observer before the aggregator starts, so this is never
            a start-up delay: the server at ``url`` serves another roster, or the
            observer was revoked.
    """
    target = f"{url}{wire.API_PREFIX}/status"
    headers = sign_request(observer, "GET", target, {}, b"")
    try:
        with urllib.request.urlopen(
            urllib.request.Request(target, headers=headers), timeout=STATUS_TIMEOUT_S
        ) as resp:
            return msgspec.json.decode(resp.read(), type=wire.FederationStatus)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise _status_refused(url, observer, exc) from None
        return None
    except (OSError, msgspec.DecodeError):
        return None


def _status_refused(url: str, observer: SigningIdentity, exc: urllib.error.HTTPError) -> AuthError:
    try:
        detail = str(msgspec.json.decode(exc.read()).get("detail", ""))
    except (OSError, msgspec.DecodeError, AttributeError):
        detail = ""
    answer = f"HTTP {exc.code}{': ' + detail if detail else ''}"
    error = ForbiddenError if exc.code == 403 else AuthError
    return error(
        f"the aggregator at {url} refused the status request signed by observer "
        f"{observer.key_id} ({answer}); it does not serve the roster this federation's "
        "observer was enrolled in, or the observer was revoked"
    )
