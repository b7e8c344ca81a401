"""The draft-graph protocol: a second FX graph beside a step's verify graph, and what it promises.

A rewrite that drafts with a model of its own adds its graph as the step's submodule `draft`, described
by a `DraftGraphSpec` in `gm.meta[DRAFT_META]`; the verifier, the lowerings, the exporter and the drafters
read only the spec. Invariants: adding it leaves the verify graph untouched, except for outputs the pass
declares (`add_step_output`, named in `gm.meta[STEP_OUTPUTS_META]`; the outputs before them stay bit for
bit); its inputs and outputs are exactly the spec's; weights it shares are the step's own modules. It is
called by rows (every input's first dimension is the row count N; it reads no cache) or as a step
(`shares_cache`: the step's own inputs for its tokens, writing the step's cache for its layers; a
self-draft's comes with a resume graph, RESUME_MODULE, that finishes the other layers from its hidden
state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from .roles import META_KEY, NodeInfo, Role

DRAFT_MODULE = "draft"  # the step's submodule holding the draft graph
RESUME_MODULE = "resume"  # with a cache-sharing draft graph: the step's layers after the draft's (ir.split)
OBSERVE_MODULE, EVICT_MODULE = "kv_observe", "kv_evict"  # a KV-eviction pass's graphs (rewrites.kv_eviction)
SIDE_GRAPHS = (DRAFT_MODULE, RESUME_MODULE, OBSERVE_MODULE, EVICT_MODULE)  # submodules the verify graph does not call
DRAFT_META = "specpass_draft"  # gm.meta key holding its DraftGraphSpec
STEP_OUTPUTS_META = "specpass_step_outputs"  # gm.meta key: {name: index} of the outputs draft passes added
DRAFT_STATES = "draft_states"  # a declared output the drafters read in place of the final hidden states
ROWS = "N"  # the dynamic row dimension of a draft graph's inputs and outputs
# draft-graph kinds (DraftGraphSpec.kind): which drafter drives the graph, and which rewrite adds it
HEADS_KIND = "heads"  # drafters.Heads (rewrites.DraftHeads)
HIDDEN_TRANSFER_KIND = "hidden-transfer"  # drafters.PseudoTokens (rewrites.HiddenTransfer)
FEATURE_KIND = "feature"  # drafters.Feature (rewrites.FeatureDraft)
EARLY_EXIT_KIND = "early-exit"  # drafters.SelfDraft (rewrites.EarlyExit, rewrites.LayerSkip)
_DTYPES = {"int64": torch.int64, "bool": torch.bool}


@dataclass(frozen=True)
class DraftTensor:
    """One input or output of a draft graph."""

    name: str
    shape: tuple[int | str, ...]  # ROWS ("N") for the row dimension, ints for fixed sizes, other names for
    # sizes set per call ("T", "S"; "S+T" is their sum)
    dtype: str  # "model": the model's float dtype; or "int64", "bool"; "step": one of the verify step's own inputs
    bound: int | None = None  # int64 inputs: valid values are [0, bound)

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.dtype == "model" else _DTYPES[self.dtype]

    def concrete_shape(self, rows: int, sizes: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """The shape for `rows` rows and `sizes` of the other named dimensions ("S+T": their sum)."""
        sizes = {**(sizes or {}), ROWS: rows}
        return tuple(d if isinstance(d, int) else sum(sizes[part] for part in d.split("+")) for d in self.shape)

    def named_dims(self) -> dict[int, str]:
        """{axis: name} of the dimensions that are one named size (ROWS, "T"; not a sum like "S+T")."""
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str) and "+" not in d}


@dataclass(frozen=True)
class DraftGraphSpec:
    """What a draft graph takes and returns (see the module docstring)."""

    kind: str  # which drafters drive it ("heads", ...)
    source: str  # the name of the pass that added it (rebuilds `config` when an export is loaded)
    inputs: tuple[DraftTensor, ...]
    outputs: tuple[DraftTensor, ...]
    config: Any  # the kind's own frozen config
    shares_cache: bool = False  # called as a step, writing the verify step's KV cache (see the module docstring)

    def __post_init__(self):
        names = [t.name for t in (*self.inputs, *self.outputs)]
        if len(set(names)) != len(names):  # a graph's value names are unique (ONNX requires it)
            raise ValueError(f"a draft graph's inputs and outputs need distinct names, got {names}")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def to_dict(self) -> dict:
        """JSON form (for an export's manifest); the config as `dataclasses.asdict` gives it."""
        config = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else self.config
        return {
            "kind": self.kind,
            "source": self.source,
            "inputs": [dataclasses.asdict(t) for t in self.inputs],
            "outputs": [dataclasses.asdict(t) for t in self.outputs],
            "config": config,
            "shares_cache": self.shares_cache,
        }

    @staticmethod
    def from_dict(data: dict, config: Any) -> DraftGraphSpec:
        def tensors(entries):
            return tuple(DraftTensor(e["name"], tuple(e["shape"]), e["dtype"], e.get("bound")) for e in entries)

        return DraftGraphSpec(data["kind"], data["source"], tensors(data["inputs"]), tensors(data["outputs"]), config,
                              data.get("shares_cache", False))  # fmt: skip


def draft_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    return getattr(gm, DRAFT_MODULE, None)


def draft_spec(gm: torch.fx.GraphModule) -> DraftGraphSpec | None:
    return gm.meta.get(DRAFT_META)


def resume_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    return getattr(gm, RESUME_MODULE, None)


def add_step_output(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str) -> None:
    """Append `node` to the verify graph's outputs as the declared output `name` (module docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = tuple(output.args[0])
    output.args = (values + (node,),)
    gm.meta[STEP_OUTPUTS_META] = {**gm.meta.get(STEP_OUTPUTS_META, {}), name: len(values)}
    gm.recompile()


def step_output(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node | None:
    """The verify graph's node returned as the declared output `name`, or None."""
    index = gm.meta.get(STEP_OUTPUTS_META, {}).get(name)
    if index is None:
        return None
    values = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return values[index] if index < len(values) else None


def attach_draft(gm: torch.fx.GraphModule, draft: torch.fx.GraphModule, spec: DraftGraphSpec,
                 resume: torch.fx.GraphModule | None = None) -> None:  # fmt: skip
    """Add `draft` to the step as its draft graph described by `spec` (and a cache-sharing draft's
    resume graph)."""
    if resume is not None and not spec.shares_cache:
        raise ValueError("a resume graph comes only with a draft graph that shares the cache")
    gm.add_submodule(DRAFT_MODULE, draft)
    if resume is not None:
        gm.add_submodule(RESUME_MODULE, resume)
    gm.meta[DRAFT_META] = spec


def trace_draft(module: nn.Module, roles: dict[str, Role]) -> torch.fx.GraphModule:
    """The annotated FX graph of a draft module. Nodes of the submodules named in `roles` (call_module
    targets) get that role, placeholders INPUT, the output OUTPUT, every other node DRAFT."""
    graph = torch.fx.Tracer().trace(module)
    draft = torch.fx.GraphModule(module, graph, class_name="DraftGraph")
    draft.graph.eliminate_dead_code()  # what the module computes and never reads (an input a design ignores)
    draft.recompile()
    for node in draft.graph.nodes:
        role = Role.DRAFT
        if node.op == "placeholder":
            role = Role.INPUT
        elif node.op == "output":
            role = Role.OUTPUT
        elif node.op == "call_module" and node.target in roles:
            role = roles[node.target]
        node.meta[META_KEY] = NodeInfo(role)
    return draft


def named_sizes(spec: DraftGraphSpec, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The sizes of the spec's named dimensions (ROWS, "T", "S", ...) in actual inputs, by name."""
    return {name: inputs[t.name].shape[axis] for t in spec.inputs for axis, name in t.named_dims().items()}


def sample_inputs(spec: DraftGraphSpec, model_dtype: torch.dtype, rows: int, seed: int = 1,
                  sizes: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random inputs of `rows` rows within the spec's bounds (for export and the ORT check); `sizes` of
    the other named dimensions (default: 2, 3, 4, ... in order of appearance, none equal to another).
    A bool input (a mask) has its last entry along the last axis set, so no query attends to nothing."""
    names = [d for t in spec.inputs for d in t.named_dims().values() if d != ROWS]
    sizes = sizes or {name: rows + 1 + i for i, name in enumerate(dict.fromkeys(names))}
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for t in spec.inputs:
        shape, dtype = t.concrete_shape(rows, sizes), t.torch_dtype(model_dtype)
        if dtype.is_floating_point:
            inputs[t.name] = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            inputs[t.name] = torch.rand(shape, generator=gen) < 0.5
            inputs[t.name][..., -1] = True
        else:
            inputs[t.name] = torch.randint(0, t.bound or 2, shape, generator=gen, dtype=dtype)
    return inputs
