"""The README's Use section runs as written: its ```python blocks, in order, in one namespace, on the
embedded default model. The README cannot drift from the code."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


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
