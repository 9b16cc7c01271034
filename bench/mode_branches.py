"""Count the places that branch on the summation mode outside its registries.

A branch site is the test of an ``if`` statement, a conditional expression, a
``while``, an ``assert``, a comprehension's ``if`` or a ``match`` subject
whose source reads the summation mode (an expression that mentions
``secure_sum``, the spec's and the config's field, or ``summation_mode``),
and any other comparison of the mode with a value (``he = mode == "he"``
branches later on ``he``).
Code inside ``fedsec/summation/`` and the per-mode registries named in
``REGISTRIES`` is the mode's own and is not counted.

Usage: ``python bench/mode_branches.py [--json] [ROOT]`` (ROOT defaults to
the ``fedsec`` package beside this file). Prints one line per site and the
total; exits 0 always (the gate lives in the test that imports ``count``).
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MODE_FIELDS = ("secure_sum", "summation_mode")
EXEMPT_DIRS = ("summation",)
REGISTRIES = (
    "agent/steps.py",
    "bench",
)


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    kind: str
    text: str


def _mentions_mode(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in MODE_FIELDS:
            return True
        if isinstance(sub, ast.Name) and sub.id in MODE_FIELDS:
            return True
    return False


def _tests(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    out: list[tuple[str, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While)):
            out.append((type(node).__name__.lower(), node.test))
        elif isinstance(node, ast.IfExp):
            out.append(("ifexp", node.test))
        elif isinstance(node, ast.Assert):
            out.append(("assert", node.test))
        elif isinstance(node, ast.comprehension):
            out.extend(("comprehension", cond) for cond in node.ifs)
        elif isinstance(node, ast.Match):
            out.append(("match", node.subject))
    inside = {id(sub) for _, test in out for sub in ast.walk(test)}
    out.extend(
        ("compare", node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and id(node) not in inside
    )
    return out


def _exempt(rel: str) -> bool:
    parts = rel.split("/")
    if parts and parts[0] in EXEMPT_DIRS:
        return True
    return any(rel == r or rel.startswith(r + "/") for r in REGISTRIES)


def count(root: Path) -> list[Site]:
    """Every branch site on the summation mode under ``root`` (a package dir)."""
    sites: list[Site] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _exempt(rel):
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        for kind, test in _tests(tree):
            if _mentions_mode(test):
                text = ast.get_source_segment(source, test) or ""
                sites.append(Site(rel, test.lineno, kind, " ".join(text.split())))
    return sorted(sites, key=lambda s: (s.path, s.line))


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "fedsec"
    sites = count(root)
    if as_json:
        print(json.dumps({"total": len(sites), "sites": [asdict(s) for s in sites]}, indent=1))
        return 0
    for s in sites:
        print(f"{s.path}:{s.line}: {s.kind}: {s.text}")
    modules = len({s.path for s in sites})
    print(f"total: {len(sites)} branch sites in {modules} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
