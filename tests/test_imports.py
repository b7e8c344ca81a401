"""The package's import graph: the layers import downwards only, and no module imports itself back.

Every import statement of every specpass module counts, at module level or inside a function (a lazy
import only hides a cycle). `from P import name` is an edge to P.name when that is a module, else to P.
"""

import ast
import importlib
import pkgutil

import networkx as nx

import specpass

RESEARCH = "specpass.research"  # the benchmark harness, evaluations, prompt sets, tiny models: never the runtime's
LOWER_LAYERS = {  # package -> packages it must not import
    "specpass.ir": ("specpass.passes", "specpass.rewrites", "specpass.backends", "specpass.drafters", "specpass.heads",
                    RESEARCH),
    "specpass.passes": ("specpass.rewrites", "specpass.backends", RESEARCH),
    "specpass.rewrites": ("specpass.backends", RESEARCH),
    "specpass.backends": (RESEARCH,),
    "specpass.drafters": ("specpass.passes", "specpass.rewrites", "specpass.backends", RESEARCH),
    "specpass.heads": ("specpass.passes", "specpass.rewrites", "specpass.backends", RESEARCH),
}


PACKAGES = ("specpass", "specpass.ir", "specpass.passes", "specpass.rewrites", "specpass.backends",
            "specpass.drafters", "specpass.heads", RESEARCH)  # fmt: skip  (ir, passes, rewrites, backends live outside src/)


def _modules() -> dict[str, str]:
    names = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        names[package] = module.__file__
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            names[info.name] = importlib.util.find_spec(info.name).origin
    return names


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"specpass.ir.verify", "specpass.passes.manager", "specpass.backends.runtime.decode"} <= set(graph)
    assert graph.has_edge("specpass.passes.manager", "specpass.ir.verify")
    assert graph.has_edge("specpass.ir.verify", "specpass.ir.query")  # `from specpass.ir import query`
    cyclic = graph.copy()
    cyclic.add_edge("specpass.ir.verify", "specpass.passes.manager")  # what the cycle test must catch
    assert list(nx.simple_cycles(cyclic))


def test_lower_layers_import_nothing_from_upper_ones():
    graph = import_graph()
    bad = [
        f"{src} -> {dst}"
        for src, dst in graph.edges
        for package, forbidden in LOWER_LAYERS.items()
        if (src == package or src.startswith(package + ".")) and dst.startswith(forbidden)
    ]
    assert bad == []


def test_no_import_cycles_between_modules():
    """Package __init__ modules count as modules: a submodule importing its own package's __init__,
    which imports the submodule back, is a cycle too."""
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles: {cycles[:5]}"
