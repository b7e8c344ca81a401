"""The README's Use section runs as written: its ```python blocks, in order, in one namespace, on the
embedded default model. The README cannot drift from the code."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def use_section_blocks() -> list[str]:
    text = README.read_text()
    match = re.search(r"^## Use\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, "the README has no '## Use' section followed by another section"
    return re.findall(r"^```python\n(.*?)^```", match.group(1), flags=re.S | re.M)


def test_readme_is_short_and_links_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 220  # for users: design notes in docs/design.md, measurements in docs/
    for doc in ("docs/design.md", "docs/experiments.md", "docs/benchmarks.md"):
        assert doc in text and (README.parent / doc).exists()


def test_readme_use_snippets_run_as_written():
    blocks = use_section_blocks()
    assert len(blocks) >= 3
    namespace: dict = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, f"{README.name} (Use section)", "exec"), namespace)  # asserts inside the snippets run too
    assert "model" in namespace and "tokenizer" in namespace


def _tables_script():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_tables_equal_their_json():
    """Each measured table of the README and docs/benchmarks.md is what benchmarks/tables.py renders
    from the JSON it cites (run it after a benchmark)."""
    tables = _tables_script()
    for name in tables.FILES:
        text = (ROOT / name).read_text()
        assert tables.blocks(text), f"{name} has no table rendered from a results JSON"
        assert tables.render(text, str(ROOT)) == text, f"{name} differs from its JSON: run python benchmarks/tables.py"


def test_the_claims_table_names_tests_and_runs_that_exist():
    section = (ROOT / "docs" / "design.md").read_text().split("## Claims and their proofs")[1].split("\n## ")[0]
    tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)
    runs = re.findall(r"`(benchmarks/results/[\w.-]+\.json)`", section)
    assert len(tests) >= 20 and runs
    for path, name in tests:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), flags=re.M), f"{path}::{name} does not exist"
    for path in runs:
        assert (ROOT / path).exists(), path
