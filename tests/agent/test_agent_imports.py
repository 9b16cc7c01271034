"""The agent package's own import graph has no circle (``TYPE_CHECKING`` imports
included): a module can be read, tested and replaced after those it imports."""

from __future__ import annotations

import grimp


def test_no_module_of_the_agent_imports_itself_back() -> None:
    graph = grimp.build_graph("fedsec", include_external_packages=False)
    modules = sorted(m for m in graph.modules if m.startswith("fedsec.agent."))
    circles = [
        (module, chain)
        for module in modules
        for imported in graph.find_modules_directly_imported_by(module)
        if imported.startswith("fedsec.agent.")
        and (chain := graph.find_shortest_chain(importer=imported, imported=module))
    ]
    assert circles == []
