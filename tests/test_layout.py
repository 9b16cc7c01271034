"""The shape of the code (issue 34): modules short enough to read top to bottom,
functions short enough to read at once, no import circle, and the summation mode read
in its own registries rather than branched on across the tree.

Offenders known when the gate was written sit in explicit allowlists, each with its
reason; a list may only shrink: a new offender fails, and so does an entry that no
longer offends (remove it).  The lead empties them when issue 34 closes.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedsec"
#: The packages whose shape is gated (CONVENTIONS.md: one concern per module).
GATED = ("agent", "aggregator", "protocol", "learning", "summation", "audit")
#: A module over this many lines needs a diagram to follow: split it by concern.
MAX_MODULE_LINES = 600
#: h11's longest function is 64 lines; a function over 60 is read in pieces.
MAX_FUNCTION_LINES = 60
#: Branch sites on the summation mode outside fedsec/summation/ and its registries
#: (bench/mode_branches.py): each mode's own behaviour lives in its mode object.
MAX_MODE_BRANCHES = 5

SPLITTING = "being split in issue 34"

#: Modules over MAX_MODULE_LINES (path under fedsec/ -> reason).
LONG_MODULES: dict[str, str] = {}
#: Functions over MAX_FUNCTION_LINES ("path::qualified name" -> reason).
LONG_FUNCTIONS: dict[str, str] = {}
#: Import circles (sorted members of each strongly connected set -> reason).
CIRCLES: dict[tuple[str, ...], str] = {}
#: Modules allowed mode branch sites beyond MAX_MODE_BRANCHES (path -> (sites, reason)).
MODE_BRANCHES: dict[str, tuple[int, str]] = {}


def _gated_files() -> Iterator[tuple[str, Path]]:
    for package in GATED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            yield path.relative_to(PACKAGE).as_posix(), path


def _long_modules() -> dict[str, int]:
    sizes = {rel: len(p.read_text(encoding="utf-8").splitlines()) for rel, p in _gated_files()}
    return {rel: n for rel, n in sizes.items() if n > MAX_MODULE_LINES}


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, (node.end_lineno or node.lineno) - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for rel, path in _gated_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, lines in _functions(tree):
            if lines > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = lines
    return found


def _circles() -> set[tuple[str, ...]]:
    """Every set of fedsec modules that import one another in a circle (Tarjan's strongly
    connected sets), counting imports anywhere in a module but those made for type
    checking only."""
    graph = grimp.build_graph("fedsec", exclude_type_checking_imports=True, cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(start: str) -> None:
        # iterative, so a deep import chain cannot reach the recursion limit
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                members = []
                while True:
                    member = stack.pop()
                    members.append(member)
                    if member == module:
                        break
                if len(members) > 1:
                    found.add(tuple(sorted(members)))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def _mode_branches() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mode_branches", ROOT / "bench" / "mode_branches.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _branch_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for site in _mode_branches().count(PACKAGE):
        counts[site.path] = counts.get(site.path, 0) + 1
    return counts


def test_no_module_is_too_long_to_read_top_to_bottom() -> None:
    long = _long_modules()
    new = {rel: n for rel, n in long.items() if rel not in LONG_MODULES}
    assert not new, f"modules over {MAX_MODULE_LINES} lines: split them by concern: {new}"


def test_no_function_is_too_long_to_read_at_once() -> None:
    long = _long_functions()
    new = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: {new}"


def test_no_fedsec_modules_import_one_another_in_a_circle() -> None:
    circles = _circles()
    new = sorted(circles - set(CIRCLES))
    assert not new, f"import circles (break them, or import for type checking only): {new}"


def test_the_summation_mode_is_read_in_its_registries() -> None:
    counts = _branch_counts()
    over = {p: n for p, n in counts.items() if p in MODE_BRANCHES and n > MODE_BRANCHES[p][0]}
    assert not over, f"more mode branch sites than allowed: {over}"
    rest = sum(n for p, n in counts.items() if p not in MODE_BRANCHES)
    assert rest <= MAX_MODE_BRANCHES, (
        f"{rest} branch sites on the summation mode outside its registries (at most "
        f"{MAX_MODE_BRANCHES}): move them into the mode objects; "
        f"{sorted(p for p in counts if p not in MODE_BRANCHES)}"
    )


@pytest.mark.parametrize(
    "allowlist",
    [LONG_MODULES, LONG_FUNCTIONS, CIRCLES, MODE_BRANCHES],
    ids=["modules", "functions", "circles", "mode_branches"],
)
def test_every_allowlisted_offender_says_why(allowlist: dict[object, object]) -> None:
    for key, value in allowlist.items():
        reason = value[1] if isinstance(value, tuple) else value
        assert isinstance(reason, str) and reason.strip(), key


def test_the_allowlists_hold_only_offenders() -> None:
    """An offender fixed leaves its list, so the lists only shrink."""
    counts = _branch_counts()
    stale = {
        "LONG_MODULES": sorted(set(LONG_MODULES) - set(_long_modules())),
        "LONG_FUNCTIONS": sorted(set(LONG_FUNCTIONS) - set(_long_functions())),
        "CIRCLES": sorted(set(CIRCLES) - _circles()),
        "MODE_BRANCHES": sorted(
            f"{p}: {counts.get(p, 0)} (allowed {n})"
            for p, (n, _) in MODE_BRANCHES.items()
            if counts.get(p, 0) < n
        ),
    }
    assert not any(stale.values()), f"fixed since listed: remove or lower them: {stale}"
