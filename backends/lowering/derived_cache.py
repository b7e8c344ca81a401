"""Values derived from weight tensors (a packed layout, a concatenation), made once per process.

Lowerings copy weights into the form their kernels read. Every program compiled from one model
would otherwise hold its own copy; a `DerivedCache` keeps one per set of source tensors, shared by
every program of the process. An entry is made again when a source changed in place since (its
version counter moved), and dropped when a source is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class DerivedCache(Generic[T]):
    """ids of the source tensors -> (weak references to them, their versions, the derived value)."""

    def __init__(self):
        self._entries: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple[int, ...], T]] = {}

    def get(self, sources: Sequence[torch.Tensor], make: Callable[[], T]) -> T:
        """The value derived from `sources`: cached, or `make()` when there is none or a source changed."""
        key = tuple(id(t) for t in sources)
        versions = tuple(t._version for t in sources)
        entry = self._entries.get(key)
        if entry is not None and entry[1] == versions and all(r() is t for r, t in zip(entry[0], sources)):
            return entry[2]
        value = make()
        refs = tuple(weakref.ref(t, lambda _, key=key: self._entries.pop(key, None)) for t in sources)
        self._entries[key] = (refs, versions, value)
        return value
