"""Training prompts for draft heads, kept apart from every evaluation prompt.

Evaluation uses HumanEval (code) and the module docstrings of `prompts.CHAT_MODULES` (chat). Training
uses *function* docstrings of other standard-library modules (`TRAIN_MODULES`, disjoint from
CHAT_MODULES): a code prompt asks the model to implement the function from its signature and
docstring, a chat prompt asks for a summary of the docstring or an explanation of the function.
The model labels its own data (its greedy continuations), so nothing is downloaded. The set depends
on the Python version's standard library; the shipped heads say which Python built them.
"""

from __future__ import annotations

import importlib
import inspect

from specpass.prompts import encode_chat, encode_code

TRAIN_MODULES = (
    "abc", "ast", "bz2", "codecs", "codeop", "colorsys", "concurrent.futures", "configparser", "dis", "doctest",
    "email.utils", "filecmp", "ftplib", "getopt", "gettext", "graphlib", "gzip", "http.cookiejar", "importlib.util",
    "inspect", "ipaddress", "linecache", "locale", "lzma", "mailbox", "mimetypes", "multiprocessing.pool", "numbers",
    "operator", "os", "pkgutil", "platform", "plistlib", "posixpath", "pprint", "quopri", "sched", "selectors",
    "shlex", "smtplib", "sysconfig", "timeit", "tokenize", "traceback", "types", "typing", "unittest.mock",
    "urllib.request", "uuid", "warnings", "weakref", "wsgiref.util", "xml.dom.minidom", "zoneinfo",
)  # fmt: skip
CHAT_INSTRUCTIONS = (
    "Summarize the following documentation in a few sentences.",
    "Explain what this Python function does and when you would use it.",
)


def documented_functions() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, docstring) of every public, documented Python function in TRAIN_MODULES."""
    found = []
    for module_name in TRAIN_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # missing from this Python build
            continue
        for name, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if name.startswith("_") or getattr(function, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(function)
            if not doc or len(doc.split()) < 8:
                continue
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                continue
            found.append((module_name, name, signature, doc[:1200]))
    return found


def training_prompts(tokenizer, count: int | None = None) -> list:
    """Token ids [1, P] of the training prompts, alternating code and chat; the first `count` of them."""
    out = []
    for i, (_, name, signature, doc) in enumerate(documented_functions()):
        if i % 2 == 0:
            out.append(encode_code(tokenizer, f'def {name}{signature}:\n    """{doc}\n    """\n'))
        else:
            instruction = CHAT_INSTRUCTIONS[(i // 2) % len(CHAT_INSTRUCTIONS)]
            out.append(encode_chat(tokenizer, [{"role": "user", "content": f"{instruction}\n\n{doc}"}]))
        if count is not None and len(out) >= count:
            break
    return out
