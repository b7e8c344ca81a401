"""Typed, validated options of the specpass torch.compile backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from .lowering.registry import AUTO, LOWERINGS
from ..drafters import Drafter, default_drafter
from ..common.errors import InvalidParameterError
from ..ir import ArchSpec
from ..passes import Pipeline
from ..rewrites import TreeAttention



def check_budget(budget) -> None:
    if budget != "cost" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise InvalidParameterError(f"options['budget'] must be 'cost' or a positive int, got {budget!r}")


DEFAULT_TREE = 64  # nodes of the default pipeline's trees


def default_pipeline(arch: ArchSpec | None = None) -> Pipeline:
    """TreeAttention(64), or trees one node shorter than `arch`'s narrowest sliding window when that is
    64 or less (a tree as deep as the window would not be exact, and TreeAttention refuses it)."""
    window = arch.smallest_window if arch is not None else None
    return Pipeline(TreeAttention(DEFAULT_TREE if window is None else max(1, min(DEFAULT_TREE, window - 1))))


@dataclass(frozen=True)
class CompileOptions:
    """pipeline: the rewrites applied to the captured step (None: `default_pipeline` fitted to the
    model: TreeAttention(64), shorter below a sliding window of 64 or less); drafter: who proposes the trees;
    lowering: eager, onednn (float32 or bfloat16 on a CPU), gguf (the linears read the quantized blocks
    of the GGUF file the model was loaded from, on a CPU; not float32-exact: backends/lowering/gguf.py),
    gguf-compiled (the gguf step compiled whole ahead of time: backends/lowering/aot_compiled.py), inductor
    (TorchInductor; replayed in CUDA graphs on CUDA), cudagraphs (the FX step in CUDA graphs) or auto
    (inductor on CUDA; on a CPU onednn where oneDNN runs the dtype, else eager: one lowering a program);
    cache_size: static KV-cache slots (prompt + generated tokens + one tree);
    budget: "cost" (each step verifies the prefix of the drafted tree that maximises expected tokens
    per second on the measured cost curve) or an int N (always the first N nodes: a fixed budget,
    e.g. the 64 nodes a GPU verifies at the price of one, for the largest tau)."""

    pipeline: Pipeline | None = None
    drafter: Drafter = field(default_factory=default_drafter)
    lowering: str = "auto"
    cache_size: int = 2048
    budget: str | int = "cost"

    def __post_init__(self):
        check_budget(self.budget)
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise InvalidParameterError(f"options['pipeline'] must be a specpass.Pipeline, got {self.pipeline!r}")
        if not isinstance(self.drafter, Drafter):
            raise InvalidParameterError(f"options['drafter'] must be a specpass drafter, got {self.drafter!r}")
        if self.lowering != AUTO and self.lowering not in LOWERINGS:
            raise InvalidParameterError(f"options['lowering'] must be one of {(AUTO, *LOWERINGS)}, got {self.lowering!r}")
        if not isinstance(self.cache_size, int) or isinstance(self.cache_size, bool) or self.cache_size < 2:
            raise InvalidParameterError(f"options['cache_size'] must be an int >= 2, got {self.cache_size!r}")

    def pipeline_for(self, arch: ArchSpec) -> Pipeline:
        """The pipeline a model of `arch` runs: the given one, or the default fitted to it."""
        return self.pipeline if self.pipeline is not None else default_pipeline(arch)

    @classmethod
    def from_mapping(cls, options: Mapping | None) -> CompileOptions:
        if options is None:
            return cls()
        if isinstance(options, CompileOptions):
            return options
        if not isinstance(options, Mapping):
            raise InvalidParameterError(f"options must be a dict, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidParameterError(f"unknown specpass option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)
