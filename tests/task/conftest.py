"""Fixtures for the task API: distributions written onto ``sys.path`` as an installer would.

A directory holding ``<pkg>/`` and ``<dist>-<version>.dist-info/`` (METADATA,
entry_points.txt, RECORD) is exactly what ``importlib.metadata`` reads from
site-packages, so these tests exercise discovery and digests without running pip; the
``pip install`` of a real package is tested separately (test_package_install.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

InstallDist = Callable[..., Path]


@pytest.fixture
def install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallDist]:
    """``install_dist(name, version, entry_points, modules)`` -> the site directory.

    ``entry_points`` maps task names to ``module:attr``; ``modules`` maps a package
    name to its ``__init__.py`` source. Each call makes a new site directory on
    ``sys.path``; the modules it added are unloaded afterwards.
    """
    before = set(sys.modules)
    count = 0

    def install(
        name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
    ) -> Path:
        nonlocal count
        count += 1
        site = tmp_path / f"site{count}"
        records: list[str] = []
        for package, source in modules.items():
            (site / package).mkdir(parents=True)
            (site / package / "__init__.py").write_text(source, encoding="utf-8")
            records.append(f"{package}/__init__.py,,")
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"  # as installers name it
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
        )
        lines = "".join(f"{task} = {target}\n" for task, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[fedsec.tasks]\n{lines}", encoding="utf-8")
        records += [f"{info.name}/{f},," for f in ("METADATA", "entry_points.txt", "RECORD")]
        (info / "RECORD").write_text("\n".join(records) + "\n", encoding="utf-8")
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        return site

    yield install
    for module in set(sys.modules) - before:
        del sys.modules[module]
