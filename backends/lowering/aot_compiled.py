"""Ahead-of-time lowering for CPUs: the rewritten step compiled once by AOTInductor into a package on disk,
one program for every tree size and attended length, loaded by later processes without a compiler.

Op by op, a CPU step spends more time between its ops than in its GEMMs; compiled whole, the elementwise
work is fused and no Python runs per op, and unlike `torch.compile` nothing is traced again per process
(docs/design.md, "The gguf step compiled whole"). The step (cache writes in place,
backends.lowering.inductor) is exported with T and the attended length S symbolic, compiled with its
weights inside, and loaded with the program's own KV-cache buffers as user-managed constants. The
package's name hashes the step's code, its tensors' shapes and contents (caches excepted), the torch
version and the CPU's flags; the KEPT_PACKAGES most recently used stay on disk. Every call runs the
package, so a program on it is one function: S spans [2, cache slots - 1] (`max_attended`; a one-slot
step runs at S = 2, its second slot masked).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings

import torch
import torch.fx
from torch import nn

from .eager import EagerStep
from ...common.errors import InvalidParameterError
from .inductor import dense_row_major, inplace_cache_writes, require_cpp_compiler
from ...ir.layout import SlotLayout
from ...common.user_cache import cache_dir

KEPT_PACKAGES = 4  # of one lowering, the most recently used: each holds its weights (sizes: docs/experiments.md)
PACKAGE_FORMAT = 1  # bump when what a package holds or how it is built changes
EXAMPLE_TOKENS = 5  # the export's example T: a size no other dimension of the step's inputs has


class AotCompiledStep(EagerStep):
    """`EagerStep`'s interface over the AOTInductor package of `gm` (built or loaded at the first call)."""

    def __init__(self, gm: torch.fx.GraphModule, lowering: str):
        super().__init__(inplace_cache_writes(gm), lowering=lowering)
        self.slots = self.gm.k_cache.shape[-2]  # the cache's slots a row
        self.package_path = os.path.join(cache_dir(), "compiled", f"{lowering}-{package_key(self.gm)}.pt2")
        if not os.path.exists(self.package_path):  # refused when built, not at the first call
            require_cpp_compiler(lowering)
        self.built_here: bool | None = None  # after the first call: compiled in this process (True) or loaded
        self._lengths = torch.empty(self.slots, dtype=torch.bool)  # kv_len as a tensor's length: a view of it
        self._compiled = None
        self._lock = threading.Lock()

    @property
    def max_attended(self) -> int:
        """The longest attended length the package runs (the export's range, module docstring): the
        program keeps every step within it, so no step runs another function op by op."""
        return self.slots - 1

    @torch.no_grad()
    def run_graph(self, inputs: dict):
        kv_len = inputs["kv_len"]
        if kv_len > self.max_attended:
            raise InvalidParameterError(f"lowering {self.lowering!r} attends over at most {self.max_attended} slots, "
                                        f"asked {kv_len}")  # fmt: skip
        compiled = self._compiled or self._build()
        attended = max(kv_len, 2)  # the export starts at 2; a slot past the step's own is hidden by the mask
        args = [self._lengths[:attended] if name == "kv_len" else dense_row_major(inputs[name])
                for name in self.input_names]  # fmt: skip
        return tuple(compiled(*args))

    def _build(self):
        with self._lock:
            if self._compiled is None:
                compiled = self._load_existing()
                self.built_here = compiled is None
                if self.built_here:
                    require_cpp_compiler(self.lowering)
                    compile_package(self.gm, self.input_names, self.slots, self.package_path)
                    drop_old_packages(os.path.dirname(self.package_path), self.lowering)
                    compiled = load_package(self.package_path)
                caches = {f"step.{name}": getattr(self.gm, name) for name in ("k_cache", "v_cache")}
                missing = sorted(set(caches) - set(compiled.get_constant_fqns()))
                if missing:  # the package would read and write copies of its own: refuse, never decode on them
                    raise RuntimeError(f"{self.package_path} has no constants {missing} to bind the KV caches to; "
                                       "delete it to compile it again")  # fmt: skip
                compiled.load_constants(caches, check_full_update=False, user_managed=True)
                self._compiled = compiled
        return self._compiled


    def _load_existing(self):
        """The package on disk, loaded (None: there is none). A package that does not load (cut short,
        damaged) is a cache entry: it is deleted, with a warning, and compiled again."""
        if not os.path.exists(self.package_path):
            return None
        with contextlib.suppress(OSError):  # used now, so kept; a read-only cache folder is fine
            os.utime(self.package_path)
        try:
            return load_package(self.package_path)
        except (RuntimeError, OSError, ValueError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            warnings.warn(f"{self.package_path} is damaged ({reason}); compiling it again", stacklevel=3)
            os.remove(self.package_path)
            return None


class _AttendedLengthAsShape(nn.Module):
    """The step with its `kv_len` input given as a tensor whose length it is."""

    def __init__(self, step: torch.fx.GraphModule, names: list[str]):
        super().__init__()
        self.step = step
        self.names = names

    def forward(self, *inputs):
        kwargs = dict(zip(self.names, inputs))
        kwargs["kv_len"] = kwargs["kv_len"].shape[0]
        return self.step(**kwargs)


def compile_package(gm: torch.fx.GraphModule, names: list[str], slots: int, path: str) -> None:
    """Export `gm` with T and S symbolic and compile it into the package at `path` (written whole, then
    renamed: a reader never sees half a package)."""
    from torch._inductor import config
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=slots - 1)
    attended = Dim("attended", min=2, max=slots - 1)
    example = SlotLayout.chain(16, EXAMPLE_TOKENS).step_inputs(torch.zeros(1, EXAMPLE_TOKENS, dtype=torch.long))
    example["kv_len"] = torch.empty(example["kv_len"], dtype=torch.bool)
    args = tuple(example[name] for name in names)
    shapes = tuple(
        {0: attended} if name == "kv_len" else {d: tokens for d, size in enumerate(arg.shape) if size == EXAMPLE_TOKENS}
        for name, arg in zip(names, args)
    )
    exported = torch.export.export(_AttendedLengthAsShape(gm, names), args, dynamic_shapes=(shapes,), strict=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path[:-len('.pt2')]}.{os.getpid()}.partial.pt2"
    with config.patch({"aot_inductor.package_constants_in_so": True}):
        torch._inductor.aoti_compile_and_package(exported, package_path=partial)
    os.replace(partial, path)


def load_package(path: str):
    """The package at `path`, loaded without `aoti_load_package`'s device check: that check runs
    inductor's ISA probe to compare the CPU's vector ISA with the package's, which compiles test
    programs when inductor's cache folder is empty (seconds of a warm start, and a C++ compiler) and
    runs them otherwise (measured: docs/experiments.md, "A warm start in seconds"); the package's name
    already holds the CPU's flags (`package_key`)."""
    try:
        from torch._inductor.package.package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)  # path, name, single-threaded, runners, device
    except (ImportError, AttributeError, TypeError):  # another torch's private loader: the public one
        return torch._inductor.aoti_load_package(path)
    return AOTICompiledModel(loader)


def drop_old_packages(folder: str, lowering: str, keep: int = KEPT_PACKAGES) -> list[str]:
    """Delete all but the `keep` most recently used packages of lowering `lowering` in `folder` (another
    torch, another weight file or cache size each left one behind); returns the deleted paths. A
    process still running a deleted package keeps its mapped copy."""
    used = {}
    for name in os.listdir(folder):
        if name.startswith(f"{lowering}-") and name.endswith(".pt2") and ".partial." not in name:
            with contextlib.suppress(FileNotFoundError):  # another process dropped it first
                used[os.path.join(folder, name)] = os.path.getmtime(os.path.join(folder, name))
    old = sorted(used, key=used.__getitem__, reverse=True)[keep:]
    for path in old:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return old


def cpu_features() -> str:
    """The machine and every instruction-set extension its CPU reports: inductor compiles with
    `-march=native`, so a package may use any of them. Read from /proc/cpuinfo (instant; inductor's own
    probe, `pick_vec_isa`, compiles a test program: a second in every process); elsewhere the
    processor's name."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].strip() for line in info if line.startswith(("flags", "Features"))), flags)
    except OSError:
        pass
    return f"{platform.machine()}|{' '.join(sorted(flags.split()))}"


def package_key(gm: torch.fx.GraphModule) -> str:
    """What a package depends on: the step's code, its tensors' names, shapes and dtypes, the content of
    every tensor but the KV caches, the torch version, the CPU's instruction-set extensions the generated code
    may use (a cache folder shared by machines must not hand AVX-512 or AMX code to a CPU without them)
    and PACKAGE_FORMAT."""
    digest = hashlib.sha256(f"{PACKAGE_FORMAT}|{torch.__version__}|{cpu_features()}|{gm.code}".encode())
    caches = {id(gm.k_cache), id(gm.v_cache)}
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        digest.update(f"|{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        if id(tensor) not in caches:
            digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:24]
