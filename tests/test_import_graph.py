"""The import graph of the package has no circle, with the imports made for annotations only (``TYPE_CHECKING``) and
those inside functions counted: a circle there is still two modules that cannot be read, or tested, one without the
other (import-linter's layer contracts leave annotation imports out, so this test counts them)."""

from __future__ import annotations

import grimp
import networkx as nx


def _graph() -> nx.DiGraph:
    imports = grimp.build_graph("persia_planner", exclude_type_checking_imports=False, cache_dir=None)
    graph = nx.DiGraph()
    for module in imports.modules:
        graph.add_node(module)
        graph.add_edges_from((module, imported) for imported in imports.find_modules_directly_imported_by(module))
    return graph


def _circle(group: nx.DiGraph) -> str:
    """One circle of ``group``, as its modules in import order."""
    edges = nx.find_cycle(group)
    return " -> ".join([edges[0][0], *(imported for _, imported in edges)])


def test_no_module_imports_itself_back():
    graph = _graph()
    assert "persia_planner.modules.train.loop" in graph and graph.number_of_edges() > 500  # the runtime is read too
    # A package's __init__ re-exports its modules, which import their siblings through it: that is no circle.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if a.startswith(f"{b}.") or b.startswith(f"{a}.")])
    # Any circle, of any length: each group of modules that reach one another, with one circle of it to read.
    tangled = [group for group in nx.strongly_connected_components(graph) if len(group) > 1]
    circles = sorted(_circle(graph.subgraph(group)) for group in tangled)
    assert circles == []
