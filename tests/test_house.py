"""The house's rules a contributor relies on, read from the code: the program's interface stays small, one
layout type reaches every step, and the runtime never asks which rewrites or drafters it runs."""

import ast
import inspect
from pathlib import Path

import specpass
from specpass.backends.runtime.program import DecodeProgram
from specpass.ir import layout

ROOT = Path(specpass.__file__).parent
RUNTIME = [*sorted((ROOT / "backends" / "runtime").glob("*.py")), ROOT / "backends" / "onnx" / "program.py"]


def test_the_program_interface_is_at_most_twelve_methods():
    """What a lowering implements and the loop calls: rewrites' needs go through runtime hooks instead."""
    body = ast.parse(inspect.getsource(DecodeProgram)).body[0].body
    methods = [node.name for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= 12, methods


def test_one_layout_type_reaches_every_step():
    classes = [node.name for node in ast.parse(inspect.getsource(layout)).body if isinstance(node, ast.ClassDef)]
    assert classes == ["SlotLayout"]


def _names_from(tree: ast.Module, packages: tuple[str, ...]) -> set[str]:
    """Names a module imports from `packages` (relative imports, as the package writes them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_the_runtime_and_the_ort_program_never_probe_a_rewrite_or_a_drafter_by_type():
    """`isinstance(x, C)` / `type(x) is C` with C from rewrites/ or drafters/: the loop would then know which
    rewrite ran, where a rewrite's runtime half (passes.runtime.RuntimeHook) or the drafting contract should
    answer. Probing anything else (an int, a tensor) is fine."""
    probes = []
    for path in RUNTIME:
        tree = ast.parse(path.read_text(), str(path))
        foreign = _names_from(tree, ("rewrites", "drafters"))
        for node in ast.walk(tree):
            checked = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                checked = [node.args[1]]
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq)) for op in node.ops):
                if isinstance(node.left, ast.Call) and getattr(node.left.func, "id", None) == "type":
                    checked = node.comparators
            names = {n.id for c in checked for n in ast.walk(c) if isinstance(n, ast.Name)}
            if names & foreign:
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(names & foreign)}")
    assert probes == []
