"""The digest of an installed task package: what every party checks before running it.

fedsec never ships code: each party installs the task package its IT approves, and
the federation pins it by entry point, distribution version and this digest, which
aggregator, members and auditor compute the same way from their own installation.

The digest is sha256 over ``DIGEST_DOMAIN`` then, for each file sorted by path, a line
``path NUL sha256(content) LF``. For a distribution installed from a wheel the files
are its installed files (``importlib.metadata`` ``files``, i.e. its RECORD) except
those that differ between two correct installations of the same wheel: RECORD itself,
INSTALLER, REQUESTED and direct_url.json (who installed it, from where), bytecode
(``__pycache__``, ``.pyc``: compiled per interpreter) and anything outside
site-packages (console scripts, whose first line names the interpreter).

An editable install records no source files, and a source checkout's ``*.egg-info``
lists what its last build saw; for both the files are the source tree of each
top-level package, plus the distribution's ``fedsec.tasks`` entry points as one more
"file", so a changed source file changes the digest, and the digest is the same
whichever of the two metadata directories ``sys.path`` finds first.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from importlib.metadata import Distribution, PackagePath
from pathlib import Path, PurePosixPath

from fedsec.errors import InvalidTask, TaskDigestMismatch
from fedsec.protocol.spec import TaskPin
from fedsec.task.discovery import ENTRY_POINT_GROUP as GROUP
from fedsec.task.discovery import find_task

#: Domain separation: this digest is never confused with another sha256 of the files.
DIGEST_DOMAIN = b"fedsec/v1/task-distribution-digest\n"

#: Metadata files that differ between two installs of one wheel (PEP 376, PEP 610).
_PER_INSTALL = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})


def pin_differences(expected: TaskPin, local: TaskPin) -> list[str]:
    """What differs between the federation's pin and this party's, one phrase each."""
    return [
        f"{label} expected {want!r}, installed {have!r}"
        for label, want, have in (
            ("entry point", expected.entry_point, local.entry_point),
            ("distribution", expected.distribution, local.distribution),
            ("version", expected.version, local.version),
            ("digest", expected.digest, local.digest),
        )
        if want != have
    ]


def check_pin(expected: TaskPin, local: TaskPin, who: str) -> None:
    """Refuse a task installation that is not the one the federation pinned.

    Args:
        expected: the federation's pin (from the signed round spec).
        local: the pin of what is installed here.
        who: the party or round the refusal is about, for the message.

    Raises:
        TaskDigestMismatch: naming each field that differs.
    """
    diffs = pin_differences(expected, local)
    if diffs:
        raise TaskDigestMismatch(
            f"{who}: the installed task package is not the one the federation pinned: "
            + "; ".join(diffs)
            + "; install the pinned version from your approved wheel or index"
        )


def task_pin(name: str) -> TaskPin:
    """The pin of the installed task ``name``.

    Raises:
        UnknownTask: no single installed distribution declares ``name``.
        InvalidTask: the distribution's files cannot be read (see :func:`distribution_digest`).
    """
    entry = find_task(name)
    return TaskPin(
        entry_point=name,
        distribution=entry.distribution_name,
        version=entry.version,
        digest=distribution_digest(entry.distribution),
    )


@functools.cache
def loaded_task_pin(name: str) -> TaskPin:
    """:func:`task_pin` computed once per process.

    The code a process runs is what it imported when it started; a package upgraded
    on disk afterwards is not what runs, so the first digest is the one to compare.

    Raises:
        UnknownTask, InvalidTask: see :func:`task_pin`.
    """
    return task_pin(name)


def distribution_digest(dist: Distribution) -> str:
    """sha256 hex digest of an installed distribution's files (see the module doc).

    Raises:
        InvalidTask: the distribution lists no files, or a file its RECORD lists is
            missing or unreadable: an incomplete installation is never pinned.
    """
    name = str(dist.metadata["Name"])
    h = hashlib.sha256(DIGEST_DOMAIN)
    for path, content in sorted(_digested_files(dist, name)):
        h.update(path.encode("utf-8") + b"\0" + hashlib.sha256(content).hexdigest().encode())
        h.update(b"\n")
    return h.hexdigest()


def _digested_files(dist: Distribution, name: str) -> Iterator[tuple[str, bytes]]:
    if dist.read_text("RECORD") is None or _is_editable(dist):
        yield from _source_files(dist, name)
        return
    files = dist.files
    if files is None:  # unreachable with a RECORD; kept for type narrowing
        raise InvalidTask(f"distribution {name} {dist.version} lists no files")
    for record in files:
        if not _kept(record) or record.name.startswith("__editable__"):
            continue
        try:
            content = Path(str(record.locate())).read_bytes()
        except OSError as exc:
            raise InvalidTask(
                f"distribution {name} {dist.version} is incomplete: {record} cannot be read "
                f"({exc.strerror or exc}); reinstall it"
            ) from exc
        yield str(record), content


def _kept(path: PurePosixPath | PackagePath) -> bool:
    parts = path.parts
    if ".." in parts or "__pycache__" in parts or path.suffix == ".pyc":
        return False
    in_metadata = len(parts) == 2 and parts[0].endswith((".dist-info", ".egg-info"))
    return not (in_metadata and parts[1] in _PER_INSTALL)


def _is_editable(dist: Distribution) -> bool:
    raw = dist.read_text("direct_url.json")
    if not raw:
        return False
    try:
        return bool(json.loads(raw).get("dir_info", {}).get("editable", False))
    except (ValueError, AttributeError):
        return False


def _source_files(dist: Distribution, name: str) -> Iterator[tuple[str, bytes]]:
    """Each file under the source directory of the distribution's packages, with its
    path as a wheel would record it (``package/module.py``), and its task entry points."""
    declared = sorted(f"{ep.name} = {ep.value}" for ep in dist.entry_points.select(group=GROUP))
    yield "<fedsec.tasks entry points>", "\n".join(declared).encode("utf-8")
    for top in _top_level_names(dist):
        root = _source_root(top)
        if root is None:
            raise InvalidTask(
                f"distribution {name} {dist.version}: its package {top} is not importable"
            )
        files = [(PurePosixPath(root.name), root)] if root.is_file() else _tree(top, root)
        for relative, file in files:
            try:
                yield str(relative), file.read_bytes()
            except FileNotFoundError:
                continue  # removed while the tree was walked: it is not part of the tree


def _tree(top: str, root: Path) -> list[tuple[PurePosixPath, Path]]:
    found = []
    for file in root.rglob("*"):
        relative = PurePosixPath(top, *file.relative_to(root).parts)
        hidden = any(part.startswith(".") for part in relative.parts)
        if not hidden and _kept(relative) and file.is_file():
            found.append((relative, file))
    return found


def _top_level_names(dist: Distribution) -> list[str]:
    listed = dist.read_text("top_level.txt")
    if listed:
        return sorted({line.strip() for line in listed.splitlines() if line.strip()})
    # Without top_level.txt (not every build backend writes it), the packages its
    # entry points import are the ones whose code runs.
    return sorted({ep.module.split(".")[0] for ep in dist.entry_points})


def _source_root(top: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None
