"""Tensor parallelism: the decode step sharded over the torch.distributed process group (Megatron-style).

On rank r of W: q, k, v, gate and up are column-parallel (rank r's heads, KV heads and MLP slice); o and
down are row-parallel, their outputs summed over ranks as an all-gather and `ranked_sum` (the ranks' parts
in rank order, so a token's bits do not depend on the step's size, as they would under gloo's ring
all-reduce); the LM head is sharded over the vocabulary and gathered; the KV cache keeps rank r's KV heads.
The rest is replicated. Every rank gets the same logits, so every rank's decode loop takes the same path
(rewrites.lockstep checks it). In laddered layers (rewrites.ladder_residual) a sub-layer's wait moves
after the next sub-layer's all-reduce is issued, so communication overlaps compute.

Invariants: outputs equal the unsharded step's up to rounding of the sums. Refused: no process group,
counts not divisible by W, fused q/k/v or gate/up, q/k norms over a whole projection, a mixture of experts
(its experts are not sharded yet), a draft graph, twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from ..common.errors import GraphVerificationError
from ..ir import arch_of
from ..ir.draft import draft_graph
from ..ir.query import residual_adds
from ..ir.roles import META_KEY, NodeInfo, Role, info, nodes_with_role
from ..passes.base import Pass, PassResult
from .kv_eviction import EVICTION_META
from .ladder_residual import laddered_layers

TENSOR_PARALLEL = "tensor_parallel"
SHARDS = "tp"  # submodule holding the sharded linears
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
FUSED = ("qkv_proj", "gate_up_proj")
_ops = torch.ops._c10d_functional


def _process_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name


def collective_nodes(graph: torch.fx.Graph, op) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


@dataclass(frozen=True)
class TensorParallel(Pass):
    """Shard the step over torch.distributed's default process group (see the module docstring).
    List it last in a pipeline: it reads which layers are laddered to place the waits."""

    ensures = frozenset({TENSOR_PARALLEL})

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        group = _process_group()
        if group is None:
            return "torch.distributed is not initialised (launch with torchrun and call init_process_group)"
        world = group[1]
        if collective_nodes(gm.graph, _ops.all_gather_into_tensor.default):
            return "the step is already sharded"
        if draft_graph(gm) is not None:
            return "a step with a draft graph (draft heads, early exit) is not sharded: its side graph would stay whole"
        if EVICTION_META in gm.meta:
            return "a step with KV eviction is not sharded: its eviction graphs read the whole cache"
        if nodes_with_role(gm.graph, Role.EXPERT):
            return ("a mixture of experts is not sharded yet: its experts would need expert or width parallelism, "
                    "and its shared MLP names would be sharded alone")  # fmt: skip
        arch = arch_of(gm)
        sizes = {"attention heads": arch.num_heads, "KV heads": arch.num_kv_heads, "vocabulary": arch.vocab_size}
        sizes |= {"MLP width": _module(gm, n).out_features for n in _linears(gm, ("gate_proj",))[:1]}
        for what, size in sizes.items():
            if size % world:
                return f"{size} {what} do not split over {world} processes"
        fused = [n.target for n in _linears(gm, FUSED)]
        if fused:
            return f"fused projections ({fused[0]}, ...) are not sharded yet"
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target.endswith(("q_norm.weight", "k_norm.weight")):
                if gm.get_parameter(node.target).numel() != arch.head_dim:
                    return f"{node.target} normalises the whole projection, not one head: it would need a gather"
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        rank, world, group = _process_group()
        graph = gm.graph
        shards = nn.Module()
        gm.add_module(SHARDS, shards)
        waits: dict[torch.fx.Node, torch.fx.Node] = {}  # row-parallel output -> its wait
        for node in _linears(gm, COLUMN + ROW + ("lm_head",)):
            linear = _module(gm, node)
            leaf = node.target.rsplit(".", 1)[-1]
            sharded = _column(linear, rank, world) if leaf in COLUMN or leaf == "lm_head" else _row(linear, rank, world)
            name = node.target.replace(".", "_")
            shards.add_module(name, sharded)
            node.target = f"{SHARDS}.{name}"
            if leaf in ROW:
                waits[node] = _all_reduce_after(graph, node, world, group)
            elif leaf == "lm_head":
                _all_gather_after(graph, node, world, group)
        for name in ("k_cache", "v_cache"):  # [L, B, KV, S, D]: this rank's KV heads
            cache = getattr(gm, name)
            per_rank = cache.shape[2] // world
            gm.register_buffer(name, cache[:, :, rank * per_rank : (rank + 1) * per_rank].clone(), persistent=False)
        _delay_laddered_waits(graph, arch_of(gm).num_layers, waits)
        graph.lint()
        summary = (f"rank {rank} of {world}: {2 * arch_of(gm).num_layers} all-reduces (gathered, summed in rank order), "
                   f"logits gathered over the vocabulary")  # fmt: skip
        return PassResult(gm, modified=True, summary=summary)

    def runtime_hook(self, step):
        """Every rank's loop in lockstep (rewrites.lockstep)."""
        from .lockstep import Lockstep

        return Lockstep()

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Two all-reduces (gathered, summed in rank order) a layer, each waited on; one more gather for the
        logits; waits of laddered sub-layers after the next sub-layer's gather."""
        graph = gm.graph
        num_layers = arch_of(gm).num_layers
        reduces = sum_gathers(graph)
        if len(reduces) != 2 * num_layers:
            raise GraphVerificationError(f"TensorParallel: {len(reduces)} all-reduces, expected {2 * num_layers}")
        if len(collective_nodes(graph, _ops.all_gather_into_tensor.default)) != 2 * num_layers + 1:
            raise GraphVerificationError("TensorParallel: the logits are not gathered once")
        order = {n: i for i, n in enumerate(graph.nodes)}
        for reduce, later in zip(reduces, reduces[1:]):
            wait = next(u for u in reduce.users if u.target is _ops.wait_tensor.default)
            if info(later).layer in laddered_layers(graph, num_layers) and order[wait] < order[later]:
                raise GraphVerificationError(
                    f"TensorParallel: a laddered sub-layer of layer {info(reduce).layer} waits before the next all-reduce"
                )


def _linears(gm: torch.fx.GraphModule, leaves: tuple[str, ...]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target.rsplit(".", 1)[-1] in leaves]


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Linear:
    return gm.get_submodule(node.target)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


def _column(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    """Output rows [rank * n / W, (rank + 1) * n / W)."""
    n = linear.out_features // world
    rows = slice(rank * n, (rank + 1) * n)
    return _linear(linear.weight[rows], None if linear.bias is None else linear.bias[rows])


def _row(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    """Input columns [rank * n / W, (rank + 1) * n / W); the bias on rank 0 only (summed once)."""
    n = linear.in_features // world
    bias = linear.bias if rank == 0 else None
    return _linear(linear.weight[:, rank * n : (rank + 1) * n], bias)


def _annotated(node: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    node.meta[META_KEY] = NodeInfo(info(like).role, info(like).layer)
    return node


def _all_reduce_after(graph: torch.fx.Graph, node: torch.fx.Node, world: int, group: str) -> torch.fx.Node:
    """node's output summed over ranks in rank order (module docstring): node -> all_gather -> wait_tensor
    -> ranked_sum, which node's users read. Returns the wait."""
    users = list(node.users)
    with graph.inserting_after(node):
        dense = _annotated(graph.call_method("contiguous", (node,)), node)
    with graph.inserting_after(dense):
        gather = _annotated(graph.call_function(_ops.all_gather_into_tensor.default, (dense, world, group)), node)
    with graph.inserting_after(gather):
        wait = _annotated(graph.call_function(_ops.wait_tensor.default, (gather,)), node)
    with graph.inserting_after(wait):
        total = _annotated(graph.call_function(ranked_sum, (wait, world)), node)
    for user in users:
        user.replace_input_with(node, total)
    return wait


def ranked_sum(gathered: torch.Tensor, world: int) -> torch.Tensor:
    """[W * B, ...] (rank r's part in rows r * B .. (r + 1) * B - 1) -> [B, ...]: part 0 + part 1 + ...,
    added in rank order, element by element."""
    parts = gathered.chunk(world)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def sum_gathers(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The all-gathers of the sharded step's sums over ranks (those `ranked_sum` reads), in graph order."""
    sums = {n.args[0].args[0] for n in graph.nodes if n.op == "call_function" and n.target is ranked_sum}
    return [n for n in collective_nodes(graph, _ops.all_gather_into_tensor.default) if n in sums]


def _all_gather_after(graph: torch.fx.Graph, node: torch.fx.Node, world: int, group: str) -> None:
    """logits [B, T, V / W] on each rank -> [B, T, V] on every rank, rank order along the vocabulary."""
    users = list(node.users)
    with graph.inserting_after(node):
        front = _annotated(graph.call_method("movedim", (node, -1, 0)), node)  # [V / W, B, T]
    with graph.inserting_after(front):
        dense = _annotated(graph.call_method("contiguous", (front,)), node)
    with graph.inserting_after(dense):
        gather = _annotated(graph.call_function(_ops.all_gather_into_tensor.default, (dense, world, group)), node)
    with graph.inserting_after(gather):
        wait = _annotated(graph.call_function(_ops.wait_tensor.default, (gather,)), node)  # [V, B, T]
    with graph.inserting_after(wait):
        back = _annotated(graph.call_method("movedim", (wait, 0, -1)), node)  # [B, T, V]
    for user in users:
        user.replace_input_with(node, back)


def _delay_laddered_waits(graph: torch.fx.Graph, num_layers: int, waits: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """In laddered layers, move each sub-layer's wait (and what leads from it to its residual add) to
    just after the next sub-layer's all-reduce: the next sub-layer reads the stream from before it."""
    laddered = set(laddered_layers(graph, num_layers))
    ordered = [w for w in graph.nodes if w in set(waits.values())]  # sub-layer order
    for wait, next_wait in zip(ordered, ordered[1:]):
        if info(next_wait).layer not in laddered:
            continue  # the next sub-layer reads this output: nothing to overlap with
        add, upstream = next((a, up) for a in residual_adds(graph, info(wait).layer) if wait in (up := _ancestors(a)))
        issue = next_wait.args[0]  # the next sub-layer's all-reduce (its gather)
        between = _descendants(wait) & upstream  # the wait, the add and the nodes from one to the other
        chain = [n for n in graph.nodes if n in between]
        anchor = issue
        for node in chain:  # graph order, so each node still follows its inputs
            anchor.append(node)
            anchor = node


def _descendants(source: torch.fx.Node) -> set[torch.fx.Node]:
    """`source` and every node that reads it, directly or not."""
    return _reachable(source, lambda node: node.users)


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and every node it reads, directly or not."""
    return _reachable(node, lambda current: current.all_input_nodes)


def _reachable(start: torch.fx.Node, neighbours) -> set[torch.fx.Node]:
    """`start` and every node reached from it through `neighbours` (one pass, each node once)."""
    seen, stack = set(), [start]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(neighbours(current))
    return seen
