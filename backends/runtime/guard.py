"""What keeps a program exact across calls: one generation at a time, and the weights it was built from.

A program's state (the static KV cache, the cursors, the drafter's memory, CUDA-graph buffers) belongs to
the generation running on it: `ProgramGuard.in_use()` holds the program's lock for a whole generation, so
calls from several threads on one program run one after another, each exact. A lowered program keeps
copies of some weights and reads others from the model as they are now: `WeightsFingerprint` records
every parameter and buffer at build time (a weak reference, its storage address and its version counter,
which every in-place write bumps), and a program whose model no longer matches is rebuilt
(`program.program_for`) or refused (a program passed in directly), never run on a mix of weights.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import nn

from ...common.errors import StaleProgramError


class WeightsFingerprint:
    """The identity, storage and version of each of a model's tensors at one moment (module docstring)."""

    def __init__(self, model: nn.Module):
        tensors = _tensors(model)
        self._refs = [weakref.ref(t) for t in tensors]
        self._state = [(t.data_ptr(), t._version) for t in tensors]

    def changed(self, model: nn.Module) -> str | None:
        """None when `model`'s tensors are the recorded ones, unchanged; else the first that is not."""
        now = _tensors(model)
        if len(now) != len(self._refs):
            return "the model's set of parameters and buffers"
        for tensor, ref, (address, version) in zip(now, self._refs, self._state):
            if ref() is not tensor:
                return f"{_name(model, tensor)} (replaced by another tensor)"
            if tensor.data_ptr() != address:
                return f"{_name(model, tensor)} (its data moved: .data assigned, or the model moved to another dtype or device)"
            if tensor._version != version:
                return f"{_name(model, tensor)} (written in place)"
        return None


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer, module by module: faster than `named_parameters`, which builds
    names (measured: docs/experiments.md, "A program's state across calls")."""
    found, stack = [], [model]
    while stack:
        module = stack.pop()
        found.extend(t for t in chain(module._parameters.values(), module._buffers.values()) if t is not None)
        stack.extend(m for m in module._modules.values() if m is not None)
    return found


def _name(model: nn.Module, tensor: torch.Tensor) -> str:
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return next((name for name, t in named if t is tensor), "a tensor")


class ProgramGuard:
    """A program's lock, and (for programs built from a model) the model's weights at build time."""

    def __init__(self, model: nn.Module | None = None):
        self._lock = threading.RLock()
        self._model = weakref.ref(model) if model is not None else None
        self._weights = WeightsFingerprint(model) if model is not None else None

    def stale(self) -> str | None:
        """Why the program no longer matches its model's weights (None: it matches, or has no model)."""
        if self._model is None:
            return None
        model = self._model()
        if model is None:
            return "the model it was built from no longer exists"
        return self._weights.changed(model)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Held for one whole generation; refuses a program whose weights changed since it was built."""
        with self._lock:
            why = self.stale()
            if why is not None:
                raise StaleProgramError(
                    f"the model's weights changed after this program was built ({why}); its lowered copies are "
                    "stale. Build it again: specpass.compile_program(model, options), or call specpass.generate "
                    "with the model (it rebuilds its program when the weights change)"
                )
            yield


def one_generation_at_a_time(loop: Callable) -> Callable:
    """Decorates a decode loop `loop(program, ...)`: the whole loop runs inside `program.guard.in_use()`."""

    @functools.wraps(loop)
    def guarded(program, *args, **kwargs):
        with program.guard.in_use():
            return loop(program, *args, **kwargs)

    return guarded
