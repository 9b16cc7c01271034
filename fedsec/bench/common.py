"""What every benchmark result carries (software versions, peak memory), and helpers for
benchmarks that run an aggregator as its own process."""

from __future__ import annotations

import contextlib
import platform
import resource
import socket
import sys
import urllib.request
from importlib import metadata
from typing import Any

import msgspec

from fedsec import wire


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
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    result["versions"] = versions()
    return result


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def federation_status(url: str) -> wire.FederationStatus | None:
    """``GET /status`` of the aggregator at ``url``, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}{wire.API_PREFIX}/status", timeout=2) as resp:
            return msgspec.json.decode(resp.read(), type=wire.FederationStatus)
    except (OSError, msgspec.DecodeError):
        return None
