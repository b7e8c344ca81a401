"""Pipelines are values: an ordered tuple of pass objects that prints, compares and round-trips JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import torch.fx

from ..common.errors import InvalidParameterError, PassPipelineError
from .base import Pass
from .manager import PassManager, PassReport, order_passes
from .registry import known_passes

CHAIN_NODES = 16  # draft-chain length a pipeline without a tree rewrite verifies (the cost budget picks less)


@dataclasses.dataclass(frozen=True, init=False)
class Pipeline:
    passes: tuple[Pass, ...]

    def __init__(self, *passes: Pass):
        for p in passes:
            if not isinstance(p, Pass):
                raise PassPipelineError(f"Pipeline takes pass objects, got {p!r} ({type(p).__name__})")
        order_passes(passes)  # rejects duplicates and unsatisfiable requirements up front
        object.__setattr__(self, "passes", tuple(passes))

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(map(repr, self.passes))})"

    def __str__(self) -> str:
        """The pipeline, and a line per pass that changes the model's output (a lossy rewrite)."""
        return "\n".join([repr(self), *(f"  output changes: {note}" for note in self.changes_output())])

    def changes_output(self) -> tuple[str, ...]:
        """What each lossy pass changes (empty: the pipeline keeps the model's output)."""
        return tuple(p.changes_output for p in self.passes if p.changes_output is not None)

    def __iter__(self):
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def has(self, pass_type: type[Pass]) -> bool:
        return any(isinstance(p, pass_type) for p in self.passes)

    def verifies_trees(self) -> bool:
        """Whether the rewritten step verifies token trees (else draft chains only)."""
        return any(p.largest_tree() is not None for p in self.passes)

    def largest_tree(self) -> int:
        """The most tokens one verify step takes: the tree rewrite's `largest_tree`, else CHAIN_NODES."""
        sizes = [n for p in self.passes if (n := p.largest_tree()) is not None]
        return max(sizes) if sizes else CHAIN_NODES

    def run(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, PassReport]:
        return PassManager(self.passes).run(gm)

    def to_dict(self) -> dict:
        return {"passes": [{"pass": p.name, "params": p.params()} for p in self.passes]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping, pass_types: Mapping[str, type[Pass]] | None = None) -> Pipeline:
        pass_types = known_passes() if pass_types is None else pass_types
        if not isinstance(data, Mapping) or not isinstance(data.get("passes"), list):
            raise PassPipelineError('a pipeline is {"passes": [{"pass": NAME, "params": {...}}, ...]}')
        passes = []
        for entry in data["passes"]:
            name = entry.get("pass") if isinstance(entry, Mapping) else None
            if name not in pass_types:
                raise PassPipelineError(f"unknown pass {name!r}; known passes: {', '.join(sorted(pass_types))}")
            try:
                passes.append(pass_types[name](**entry.get("params", {})))
            except TypeError as exc:
                raise InvalidParameterError(f"bad parameters for {name}: {exc}") from exc
        return cls(*passes)

    @classmethod
    def from_json(cls, text: str, pass_types: Mapping[str, type[Pass]] | None = None) -> Pipeline:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PassPipelineError(f"pipeline JSON does not parse: {exc}") from exc
        return cls.from_dict(data, pass_types)
