"""The package's import graph: the layers import downwards only, no module imports itself back, and every
import inside the package is relative, so that the folder it reaches is written in it.

Every import statement of every specpass module counts, at module level or inside a function (a lazy
import only hides a cycle). `from P import name` is an edge to P.name when that is a module, else to P.
"""

import ast
import importlib
import pkgutil
import subprocess
import sys

import networkx as nx

import specpass

RESEARCH = "specpass.research"  # the benchmark harness, evaluations, prompt sets, trainers: never the runtime's
FRONT = ("specpass.api", "specpass.cli", "specpass.hf_hook", "specpass.models")  # the top layer
ABOVE_COMMON = ("specpass.ir", "specpass.passes", "specpass.heads", "specpass.drafters", "specpass.rewrites",
                "specpass.backends", RESEARCH, *FRONT)  # fmt: skip
LOWER_LAYERS = {  # package -> packages it must not import
    "specpass.common": ABOVE_COMMON,
    "specpass.ir": ("specpass.passes", "specpass.rewrites", "specpass.backends", "specpass.drafters", "specpass.heads",
                    RESEARCH, *FRONT),
    "specpass.passes": ("specpass.rewrites", "specpass.backends", "specpass.drafters", "specpass.heads", RESEARCH,
                        *FRONT),
    "specpass.drafters": ("specpass.passes", "specpass.rewrites", "specpass.backends", RESEARCH, *FRONT),
    "specpass.heads": ("specpass.passes", "specpass.rewrites", "specpass.backends", "specpass.drafters", RESEARCH,
                       *FRONT),
    "specpass.rewrites": ("specpass.backends", RESEARCH, *FRONT),
    "specpass.backends": (RESEARCH, *FRONT),
}


def _modules() -> dict[str, str]:
    names = {"specpass": specpass.__file__}
    for info in pkgutil.walk_packages(specpass.__path__, "specpass."):
        names[info.name] = importlib.util.find_spec(info.name).origin
    return names


def _imports(name: str, path: str) -> list[ast.Import | ast.ImportFrom]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _package(name: str, path: str) -> str:
    return name if path.endswith("__init__.py") else name.rpartition(".")[0]


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for node in _imports(name, path):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), _package(name, path))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"specpass.ir.verify", "specpass.passes.manager", "specpass.backends.runtime.decode"} <= set(graph)
    assert graph.has_edge("specpass.passes.manager", "specpass.ir.verify")
    assert graph.has_edge("specpass.ir.verify", "specpass.ir.query")  # `from . import query`
    assert graph.has_edge("specpass.backends.lowering.eager", "specpass.ir.layout")  # `from ...ir.layout import`
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


def test_the_package_imports_itself_by_relative_imports_only():
    """An absolute `specpass.` import inside the package hides from a reader (and from any tool that resolves
    imports by path) which folder it reaches: the root is the package, so `..ir` is the folder `ir/`."""
    absolute = [
        f"{path}:{node.lineno}"
        for name, path in _modules().items()
        for node in _imports(name, path)
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "specpass" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "specpass")
    ]
    assert absolute == []


def test_import_specpass_loads_nothing_until_a_name_is_used():
    """`import specpass` is cheap (no torch, no transformers); each public name imports its module on first use."""
    script = (
        "import sys, specpass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported eagerly'\n"
        "assert set(specpass.__all__) <= set(dir(specpass))\n"
        "missing = [n for n in specpass.__all__ if getattr(specpass, n, None) is None]\n"
        "assert missing == [], missing\n"
        "assert specpass.generate.__module__ == 'specpass.api' and 'torch' in sys.modules\n"
        "try:\n"
        "    specpass.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown name must raise AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
