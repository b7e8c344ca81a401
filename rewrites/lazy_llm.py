"""LazyLLM: prompt tokens pruned layer by layer during the prefill (time to first token on long prompts).

Paper: LazyLLM (Fu et al., 2024). At each pruning layer the prefill keeps the tokens its last token
attended to most in the layer below (that layer's softmax over the visible slots, averaged over query
heads; the last token is always kept) and runs the layers above on them alone: progressive pruning,
`keep[i]` being the share of a prompt piece's tokens left above `layers[i]`. A pruned token keeps the
keys and values it has below its pruning layer; its hidden state there stands for it in the step's
outputs (the paper's aux cache), so the outputs keep their [B, T, ...] shapes.

Two halves. The decode step (`LazyLLM.rewrite`): each layer at or above a pruning layer reads its mask
through `ir.ops.pruned_visibility`, which hides the slots its stage pruned (state `lazy_pruned`
[stages, B, S], bool). The prefill (`LazyPrefill`, the runtime half): a copy of the rewritten step in
which each pruning layer chooses its tokens (`keep_tokens`) and gathers every per-token value the layers
above read (the residual stream, rotary tables, write slots, the mask), lowered like the step's side
graphs; the prompt runs through it (`RuntimeHook.prefill_forward`), which records the pruned slots.
Decode steps, trees included, prune nothing, so speculation under LazyLLM gives what one token a step
under LazyLLM gives.

Differences from the paper, on purpose: a pruned token is not revived in later steps (a revived token's
upper layers would attend to whatever is present when it is revived, so its keys, and the output, would
depend on the sizes of the steps); a prompt fed in several pieces (backends.runtime.decode.feed) is
pruned piece by piece, each by its own last token. Lossy and opt-in. Refused: a second LazyLLM, a batch
of several rows, the ONNX export, KV eviction, sparse attention, a sharded step, an early-exit draft graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of, copy_step, query
from ..ir.draft import DRAFT_STATES, STEP_OUTPUTS_META, resume_graph
from ..ir.layout import SlotLayout
from ..ir.ops import pruned_visibility, selected_attention
from ..ir.roles import META_KEY, Role, annotate, info, placeholder
from ..passes.base import CAPTURED, Pass, PassResult
from ..passes.runtime import LoweredStep, RuntimeHook
from .kv_eviction.base import EVICTION_META
from .tree_attention import TREE_ATTENTION

LAZY_LLM = "lazy_llm"
PRUNED = "lazy_pruned"  # buffer [stages, B, S] bool: slots whose tokens have no keys from the stage's first layer up


@dataclass(frozen=True)
class LazyLLM(Pass):
    """Prune prompt tokens layer by layer during the prefill (module docstring). keep: the share of a
    prompt piece's tokens left above each pruning layer, non-increasing, in (0, 1]; layers: the pruning
    layers, ascending, each >= 1 (negative ones count from the top); None spaces them evenly (a quarter,
    half and three quarters of the way up for three)."""

    keep: tuple[float, ...] = (0.7, 0.5, 0.35)
    layers: tuple[int, ...] | None = None

    requires = frozenset({CAPTURED, TREE_ATTENTION})
    ensures = frozenset({LAZY_LLM})
    changes_output = "LazyLLM: prompt tokens are pruned from the upper layers during the prefill, so the output may differ"

    def __post_init__(self):
        keep = tuple(self.keep) if isinstance(self.keep, (list, tuple)) else self.keep
        if (not isinstance(keep, tuple) or not keep
                or any(isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1 for k in keep)):  # fmt: skip
            raise InvalidParameterError(f"LazyLLM.keep must be a non-empty tuple of shares in (0, 1], got {self.keep!r}")
        if any(b > a for a, b in zip(keep, keep[1:])):
            raise InvalidParameterError(f"LazyLLM.keep must not grow from one pruning layer to the next, got {keep}")
        object.__setattr__(self, "keep", tuple(float(k) for k in keep))  # JSON gives a list
        layers = self.layers
        if layers is not None:
            layers = tuple(layers) if isinstance(layers, (list, tuple)) else layers
            if not isinstance(layers, tuple) or any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
                raise InvalidParameterError(f"LazyLLM.layers must be a tuple of layer indices, got {self.layers!r}")
            if len(layers) != len(keep):
                raise InvalidParameterError(f"LazyLLM: {len(layers)} pruning layers for {len(keep)} shares in keep")
            object.__setattr__(self, "layers", layers)

    def pruning_layers(self, num_layers: int) -> tuple[int, ...]:
        """The pruning layers of a model of `num_layers`, ascending (raises InvalidParameterError where
        they do not fit)."""
        n = len(self.keep)
        chosen = tuple(round(num_layers * (i + 1) / (n + 1)) for i in range(n)) if self.layers is None else self.layers
        bad = [i for i in chosen if not -num_layers <= i < num_layers]
        if bad:
            raise InvalidParameterError(f"LazyLLM: pruning layer(s) {bad} outside the model's {num_layers} layers")
        layers = tuple(i % num_layers for i in chosen)
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 1:
            raise InvalidParameterError(
                f"LazyLLM: pruning layers {layers} must ascend from layer 1 (a layer below scores the tokens)"
            )
        return layers

    def stage_of(self, layer: int, num_layers: int) -> int | None:
        """The stage a layer belongs to (the last pruning layer at or below it), None below the first."""
        below = [s for s, first in enumerate(self.pruning_layers(num_layers)) if first <= layer]
        return below[-1] if below else None

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        if PRUNED in dict(gm.named_buffers()):
            return "the step already prunes its prompt (LazyLLM)"
        if EVICTION_META in gm.meta:
            return "the step evicts its KV cache: an eviction moves slots, which the pruned slots would not follow"
        attention = query.attention_ops(gm.graph)
        if any(op.target is selected_attention for op in attention):
            return "the step attends sparsely: its selection would choose among slots that have no keys"
        if {op.target for op in attention} - {query.SDPA}:
            return "the model's attention has sinks or soft-capped logits, which the token scores do not compute"
        if query.is_sharded(gm.graph):
            return "the step is sharded over processes (TensorParallel): a choice would see only this process's heads"
        if resume_graph(gm) is not None:
            return "the step has an early-exit draft graph, which drafts in the step's cache one token at a time"
        try:
            layers = self.pruning_layers(arch_of(gm).num_layers)
            for layer in layers:
                _live_ins(gm.graph, layer)
            _outside_reads(gm.graph, layers[0])
        except InvalidParameterError as exc:
            return str(exc)
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        layers, batch, _, slots, _ = gm.k_cache.shape
        stages = len(self.keep)
        gm.register_buffer(PRUNED, torch.zeros(stages, batch, slots, dtype=torch.bool, device=gm.k_cache.device),
                           persistent=False)  # fmt: skip
        graph = gm.graph
        pruned = None
        for layer, attention in enumerate(query.attention_ops(graph)):
            stage = self.stage_of(layer, layers)
            if stage is None:
                continue
            if pruned is None:
                with graph.inserting_before(attention):
                    pruned = annotate(graph.get_attr(PRUNED), Role.MASK)
            with graph.inserting_before(attention):
                mask = graph.call_function(pruned_visibility, (attention.kwargs["attn_mask"], pruned, stage))
            annotate(mask, Role.MASK, layer)
            attention.kwargs = {**attention.kwargs, "attn_mask": mask}
        graph.lint()
        gm.recompile()
        firsts = self.pruning_layers(layers)
        shares = ", ".join(f"{k:.0%} above layer {first}" for k, first in zip(self.keep, firsts))
        return PassResult(gm, True, f"prefill keeps {shares}; decode steps hide the pruned slots ({PRUNED} "
                                    f"[{stages}, {batch}, {slots}])")  # fmt: skip

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Each layer at or above a pruning layer reads its mask through its stage's pruned slots; the
        layers below read theirs unrestricted."""
        num_layers = arch_of(gm).num_layers
        stages = dict(gm.named_buffers()).get(PRUNED)
        if stages is None or stages.shape[0] != len(self.keep):
            raise GraphVerificationError(f"{self.name}: the step has no {PRUNED} state of {len(self.keep)} stages")
        for layer, attention in enumerate(query.attention_ops(gm.graph)):
            mask = attention.kwargs.get("attn_mask")
            read = mask.args[2] if mask is not None and mask.target is pruned_visibility else None
            if read != self.stage_of(layer, num_layers):
                raise GraphVerificationError(
                    f"{self.name}: layer {layer} hides the pruned slots of stage {read}, expected "
                    f"{self.stage_of(layer, num_layers)}"
                )

    def runtime_hook(self, step: LoweredStep) -> LazyPrefill:
        return LazyPrefill(step, self)

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype):
        """None: the prefill graph's pruning is not exported (the exporter refuses the pass by name)."""
        return None


# ---- the prefill graph's ops ----


def keep_tokens(q, k, mask, scale: float | None, own_slots, piece, share: float) -> torch.Tensor:
    """[B, n] ascending indices of the step's tokens to keep: the step's last token first, then those
    it attended to most in the layer below (softmax of q k^T scale over its visible slots, averaged over
    query heads); n = ceil(share * the piece's tokens), at most T. q [B, H, T, D] and k [B, KV, S' >= S, D]
    of that layer, mask [B, 1, T, S] bool, own_slots [B, T] (each token's slot), piece [B, T0]."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], mask.shape[-1]
    last = q[:, :, -1].reshape(b, kv, h // kv, d).float()  # [B, KV, G, D]: head h reads KV head h // G
    scale = d**-0.5 if scale is None else scale
    logits = torch.einsum("bkgd,bksd->bkgs", last, k[:, :, :s].float()) * scale  # [B, KV, G, S]
    visible = mask[:, 0, -1, :]  # [B, S]
    weights = logits.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1).mean((1, 2))  # [B, S]
    scores = weights.gather(1, own_slots).clone()  # [B, T]
    scores[:, -1] = float("inf")
    n = min(t, max(1, math.ceil(share * piece.shape[1])))
    return scores.topk(n, dim=1).indices.sort(1).values


def take_tokens(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """x with only the kept tokens along its token axis `dim`: keep [B, n] (row b's indices)."""
    dim = dim % x.dim()
    shape = [1] * x.dim()
    shape[0], shape[dim] = keep.shape[0], keep.shape[1]
    sizes = [keep.shape[1] if i == dim else x.shape[i] for i in range(x.dim())]
    return x.gather(dim, keep.reshape(shape).expand(sizes))


def prune_mask(mask: torch.Tensor, keep: torch.Tensor, own_slots: torch.Tensor) -> torch.Tensor:
    """The kept tokens' mask rows [B, 1, n, S], the slots of the tokens not kept hidden (they get no keys
    in the layers above): mask [B, 1, T, S] bool, keep [B, n], own_slots [B, T]."""
    dropped = torch.ones(own_slots.shape, dtype=torch.bool, device=mask.device).scatter(1, keep, False)  # [B, T]
    hidden = torch.zeros(mask.shape[0], mask.shape[-1], dtype=torch.bool, device=mask.device)
    hidden = hidden.scatter(1, own_slots, dropped)  # [B, S]
    return take_tokens(mask, keep, -2) & ~hidden[:, None, None, :]


def restore_tokens(full: torch.Tensor, keep: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """full [B, T, H] with the kept tokens' rows replaced by part [B, n, H] (keep [B, n])."""
    return full.scatter(1, keep[:, :, None].expand(-1, -1, full.shape[-1]), part)


# ---- building the prefill graph ----

_TOKEN_AXIS = {Role.ROPE: -2, Role.CACHE_INDEX: -1}  # a live-in's token axis, by its role
_TOKEN_INPUTS = {"positions": -1, "cache_slots": -1}  # step inputs with a token axis
_PLAIN_INPUTS = ("kv_len",)
_AXIS_META = "specpass_lazy_axis"  # on a gathered node: the axis a later stage gathers it along


def _in_layers(node: torch.fx.Node, first: int) -> bool:
    return META_KEY in node.meta and info(node).layer is not None and info(node).layer >= first


def _live_ins(graph: torch.fx.Graph, first: int) -> dict[torch.fx.Node, int | str | None]:
    """What layers first .. read from below them: node -> its token axis, "stream" (the residual
    stream, [B, T, H]), "mask" ([B, 1, T, S]) or None (no token axis: buffers, cache views, kv_len).
    Raises InvalidParameterError on a value the pruning cannot follow."""
    live: dict[torch.fx.Node, int | str | None] = {}
    for node in graph.nodes:
        if not _in_layers(node, first):
            continue
        for value in node.all_input_nodes:
            if value in live or _in_layers(value, first):
                continue
            role = info(value).role if META_KEY in value.meta else None
            if _AXIS_META in value.meta:
                live[value] = value.meta[_AXIS_META]
            elif value.op == "get_attr" or role is Role.CACHE:
                live[value] = None
            elif role is Role.MASK:
                live[value] = "mask"
            elif role is Role.RESIDUAL:
                live[value] = "stream"
            elif role is Role.INPUT and value.target in _TOKEN_INPUTS:
                live[value] = _TOKEN_INPUTS[value.target]
            elif role is Role.INPUT and value.target in _PLAIN_INPUTS:
                live[value] = None
            elif role in _TOKEN_AXIS:
                live[value] = _TOKEN_AXIS[role]
            else:
                raise InvalidParameterError(
                    f"LazyLLM: layer {info(node).layer} reads {value.name} ({role.value if role else 'unannotated'}) "
                    f"from below layer {first}, which the pruning cannot follow"
                )
    if list(live.values()).count("stream") != 1:
        raise InvalidParameterError(f"LazyLLM: layer {first} does not read one residual stream from below")
    return live


def _outside_reads(graph: torch.fx.Graph, first: int) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(reader, value) in graph order: nodes outside layers first .. (the final norm, the outputs) reading
    their values; each value must be a residual stream (raises InvalidParameterError otherwise)."""
    reads = []
    for node in graph.nodes:
        if _in_layers(node, first):
            continue
        for value in node.all_input_nodes:
            if _in_layers(value, first):
                if info(value).role is not Role.RESIDUAL:
                    raise InvalidParameterError(
                        f"LazyLLM: {node.name} reads {value.name} ({info(value).role.value}) of layer "
                        f"{info(value).layer}, which is not a residual stream the pruning can restore"
                    )
                reads.append((node, value))
    return reads


def _replace_inputs(node: torch.fx.Node, replacements: dict) -> None:
    node.args = torch.fx.map_arg(node.args, lambda n: replacements.get(n, n))
    node.kwargs = torch.fx.map_arg(node.kwargs, lambda n: replacements.get(n, n))


def prefill_graph(gm: torch.fx.GraphModule, lazy: LazyLLM) -> tuple[torch.fx.GraphModule, int]:
    """A copy of the rewritten step `gm` (sharing its tensors) that prunes at the pruning layers (module
    docstring); its outputs are the step's, then each stage's kept indices [B, n_s] into the step's
    tokens. Returns it and the step's output count."""
    new = copy_step(gm)
    graph = new.graph
    layers = lazy.pruning_layers(arch_of(gm).num_layers)
    attention = query.attention_ops(graph)
    reads = _outside_reads(graph, layers[0])
    piece = own = placeholder(graph, "cache_slots")  # [B, T]
    kept, streams = [], []  # per stage: kept indices into the piece [B, n_s]; the stream entering the stage
    for first, share in zip(layers, lazy.keep):
        live = _live_ins(graph, first)
        stream = next(node for node, axis in live.items() if axis == "stream")
        below = attention[first - 1]
        q, k = below.args[:2]
        with graph.inserting_after(stream):
            keep = graph.call_function(keep_tokens, (q, k, below.kwargs["attn_mask"], below.kwargs.get("scale"),
                                                     own, piece, share))  # fmt: skip
        replacements, after = {}, keep
        for value, axis in live.items():
            if axis is None:
                continue
            with graph.inserting_after(after):
                if axis == "mask":
                    after = graph.call_function(prune_mask, (value, keep, own))
                else:
                    after = graph.call_function(take_tokens, (value, keep, 1 if axis == "stream" else axis))
            after.meta[_AXIS_META] = axis
            replacements[value] = after
        with graph.inserting_after(after):
            kept.append(keep if not kept else graph.call_function(torch.gather, (kept[-1], 1, keep)))
        own = replacements.get(own, own)
        for node in list(graph.nodes):
            if _in_layers(node, first):
                _replace_inputs(node, replacements)
        streams.append(stream)
    output = next(n for n in graph.nodes if n.op == "output")
    restored: dict[torch.fx.Node, torch.fx.Node] = {}
    for reader, value in reads:
        if value not in restored:
            stage = lazy.stage_of(info(value).layer, len(attention))
            full = streams[0]  # every token's state entering the first pruning layer: [B, T, H]
            with graph.inserting_before(reader):
                for s in range(stage + 1):
                    part = streams[s + 1] if s < stage else value  # [B, n_s, H]
                    full = graph.call_function(restore_tokens, (full, kept[s], part))
            restored[value] = annotate(full, Role.RESIDUAL)
        _replace_inputs(reader, restored)
    outputs = output.args[0]
    output.args = ((*outputs, *kept),)
    graph.lint()
    new.recompile()
    return new, len(outputs)


class LazyPrefill(RuntimeHook):
    """The prompt through the pruning prefill graph, lowered as the step's side graphs (on the step's
    kernels, its GGUF blocks included); the slots it pruned recorded in the step's `lazy_pruned` state (read by the decode steps' masks)."""

    batch_refusal = "LazyLLM (each row's prompt is pruned by its own last token; prune one sequence at a time)"

    def __init__(self, step: LoweredStep, lazy: LazyLLM):
        gm = step.graph_module
        self.pruned = dict(gm.named_buffers())[PRUNED]  # [stages, B, S]
        graph, self.outputs = prefill_graph(gm, lazy)
        self.prefill = step.lower_side(graph)
        self.states = gm.meta.get(STEP_OUTPUTS_META, {}).get(DRAFT_STATES, 1)

    def __str__(self) -> str:
        return f"prunes the prompt in {self.pruned.shape[0]} stages"

    def new_sequence(self) -> None:
        self.pruned.zero_()

    def state_bytes(self) -> int:
        return self.pruned.numel() * self.pruned.element_size()

    @torch.no_grad()
    def prefill_forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.pruned.device
        inputs = layout.to(device).step_inputs(tokens.to(device))
        outputs = self.prefill.run_graph(inputs)
        slots = inputs["cache_slots"]  # [B, T]
        for stage, kept in enumerate(outputs[self.outputs :]):  # [B, n_s]
            dropped = torch.ones(slots.shape, dtype=torch.bool, device=device).scatter(1, kept, False)  # [B, T]
            rows = torch.arange(slots.shape[0], device=device)[:, None].expand_as(slots)
            self.pruned[stage, rows[dropped], slots[dropped]] = True
        return outputs[0], outputs[self.states]
