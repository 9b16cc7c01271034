"""What every benchmark result carries: software versions and peak memory."""

from __future__ import annotations

import contextlib
import platform
import resource
import sys
from importlib import metadata
from typing import Any


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
