"""Training prompts for draft heads, kept apart from every evaluation prompt.

Evaluation uses HumanEval (code) and the module docstrings of `prompts.CHAT_MODULES` (chat). Training
uses the docstrings of functions and methods of other standard-library modules (`TRAIN_MODULES`, disjoint from
CHAT_MODULES), of networkx and of sympy (`package_modules`: both dependencies of torch, so every install
has them; graph algorithms and symbolic maths, many docstrings with `>>>` examples, which is closer to
HumanEval than the standard library alone: at equal prompt count networkx raised the Hydra heads' τ on
HumanEval, README; sympy's 4600 functions make the GPU recipe's corpus several times larger). A code prompt
asks the model to implement the function from its signature and docstring, a chat prompt asks for a
summary of the docstring or an explanation of the function.
The trainer's held-out set (its accuracy table) is built the same way from a third set of modules,
`HELD_OUT_MODULES`, so no held-out function, nor its docstring in the other format, is trained on.
The model labels its own data (its greedy continuations), so nothing is downloaded. The set depends
on the Python version's standard library and on networkx's and sympy's versions; the README says which
built the shipped heads.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import textwrap
import warnings

from .prompts import encode_chat, encode_code

# Order matters: the trainer holds out the first sequences for its accuracy table, so new modules
# go at the end and the held-out prompts stay the same.
TRAIN_MODULES = (
    "abc", "ast", "bz2", "codecs", "codeop", "colorsys", "concurrent.futures", "configparser", "dis", "doctest",
    "email.utils", "filecmp", "ftplib", "getopt", "gettext", "graphlib", "gzip", "http.cookiejar",
    "importlib.util", "inspect", "ipaddress", "linecache", "locale", "lzma", "mailbox", "mimetypes",
    "multiprocessing.pool", "numbers", "operator", "os", "pkgutil", "platform", "plistlib", "posixpath", "pprint",
    "quopri", "sched", "selectors", "shlex", "smtplib", "sysconfig", "timeit", "tokenize", "traceback", "types",
    "typing", "unittest.mock", "urllib.request", "uuid", "warnings", "weakref", "wsgiref.util", "xml.dom.minidom",
    "zoneinfo", "asyncio.base_events", "asyncio.events", "asyncio.locks", "asyncio.streams", "asyncio.tasks",
    "bdb", "cmd", "code", "email.header", "email.message", "email.policy", "genericpath", "http.client",
    "http.server", "imaplib", "importlib.metadata", "importlib.resources.abc", "ntpath", "optparse", "pdb",
    "pickletools", "poplib", "pstats", "pydoc", "signal", "site", "socketserver", "ssl", "symtable", "trace",
    "tracemalloc", "unittest.case", "venv", "xml.etree.ElementTree", "xml.sax.saxutils", "xmlrpc.client",
    "xmlrpc.server", "zipimport",
)  # fmt: skip
# Modules of the held-out set: in neither of the others, none removed by PEP 594 (a missing one is skipped),
# no docstring shared with a training function (shelve's Shelf.get repeats Mapping.get's: left out).
HELD_OUT_MODULES = (
    "re", "fileinput", "ctypes", "importlib", "pty", "webbrowser", "compileall", "getpass", "modulefinder",
    "rlcompleter", "cProfile", "dbm", "profile", "pyclbr", "runpy", "zipapp",
)  # fmt: skip
CHAT_INSTRUCTIONS = (
    "Summarize the following documentation in a few sentences.",
    "Explain what this Python function does and when you would use it.",
)


def _documented(owner, module_name: str, prefix: str = ""):
    """(qualified name, signature, docstring) of the public documented functions defined in `owner`."""
    for name, function in sorted(inspect.getmembers(owner, inspect.isfunction)):
        if name.startswith("_") or getattr(function, "__module__", None) != module_name:
            continue
        if function.__qualname__ != prefix + name:  # inherited or re-exported
            continue
        doc = inspect.getdoc(function)
        if not doc or len(doc.split()) < 8:
            continue
        try:
            signature = str(inspect.signature(function))
        except (TypeError, ValueError):
            continue
        signature = re.sub(r" at 0x[0-9a-fA-F]+>", ">", signature)  # no memory address: the same prompt in every run
        yield prefix + name, signature, doc[:1200]


def package_modules(package: str) -> tuple[str, ...]:
    """A package's modules in `pkgutil.walk_packages` order (sorted within each package), without its
    tests, benchmarks and plotting code (networkx.drawing and algorithms.planar_drawing need optional
    dependencies) and without `sympy.this` (it prints a poem on import)."""
    root = importlib.import_module(package)
    walked = pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda _name: None)
    skip = (".tests", ".benchmarks", "drawing")
    return tuple(m.name for m in walked if not any(part in m.name for part in skip) and m.name != f"{package}.this")


def training_modules() -> tuple[str, ...]:
    """The training prompts' modules: TRAIN_MODULES, then networkx's, then sympy's."""
    with warnings.catch_warnings():  # walking sympy imports its deprecated subpackages
        warnings.simplefilter("ignore")
        return TRAIN_MODULES + package_modules("networkx") + package_modules("sympy")


def documented_functions(modules: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """(module, qualified name, signature, docstring) of every public, documented Python function and
    method of a public class in `modules`."""
    found = []
    with warnings.catch_warnings():  # importing and listing modules is not this run's business to warn about
        warnings.simplefilter("ignore")  # (typing.io / typing.re aliases, sympy's deprecated or optional modules)
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # missing from this Python build, or an optional dependency that fails to import
                continue
            found += [(module_name, *item) for item in _documented(module, module.__name__)]
            for class_name, cls in sorted(inspect.getmembers(module, inspect.isclass)):
                if not class_name.startswith("_") and cls.__module__ == module.__name__:
                    found += [(module_name, *item) for item in _documented(cls, module.__name__, f"{class_name}.")]
    return found


def _code(qualname: str, signature: str, doc: str) -> str:
    *owner, name = qualname.split(".")
    doc = textwrap.indent(doc, "    ").lstrip()
    body = f'def {name}{signature}:\n    """{doc}\n    """\n'
    if not owner:
        return body
    return f"class {owner[0]}:\n" + "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())


def training_prompts(tokenizer, count: int | None = None) -> list:
    """Token ids [1, P] of the training prompts (`training_modules`); the first `count` of them: every
    standard-library function once, then every networkx and every sympy function once, then the second
    passes (the CPU recipe's default 2000 are all standard-library and networkx ones)."""
    return function_prompts(tokenizer, training_modules(), count)


def held_out_prompts(tokenizer, count: int | None = None) -> list:
    """Token ids [1, P] of the trainer's held-out prompts (HELD_OUT_MODULES); the first `count` of them."""
    return function_prompts(tokenizer, HELD_OUT_MODULES, count)


def function_prompts(tokenizer, modules: tuple[str, ...], count: int | None = None) -> list:
    """Token ids [1, P] of the prompts made from the documented functions of `modules`; the first `count`.

    Every function gives two prompts, a code one and a chat one. The first pass over the functions
    alternates the two formats (code for the even ones), the second gives each function its other
    format, so any prefix covers as many different functions as it can, and the first prompts are the
    same however many are taken.
    """
    functions = documented_functions(modules)
    out = []
    for second_pass in (False, True):
        for i, (_, name, signature, doc) in enumerate(functions):
            if count is not None and len(out) >= count:
                return out
            if (i % 2 == 0) != second_pass:
                out.append(encode_code(tokenizer, _code(name, signature, doc)))
            else:
                instruction = CHAT_INSTRUCTIONS[(i // 2) % len(CHAT_INSTRUCTIONS)]
                out.append(encode_chat(tokenizer, [{"role": "user", "content": f"{instruction}\n\n{doc}"}]))
    return out
