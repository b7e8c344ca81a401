"""ONNX Runtime lowering: the decode loop drives a step exported by `specpass export` on an ORT session.

The KV cache is two torch tensors [L, B, KV, S, D] bound with IOBinding as the step's `past_keys` /
`past_values` (never copied between steps); `past_mask` hides each row's slots past its committed length,
S grows in buckets of KV_BUCKET slots, and `commit` copies each row's accepted path from `new_keys` /
`new_values` into consecutive slots, as the PyTorch lowering compacts. Row b is sequence b; when rows
finish, `keep_rows` gathers the live ones. The pipeline's passes give their runtime halves
(`Pass.onnx_runtime_hook`: KV eviction runs its exported policy graphs after each commit), which open and
run their sessions through this program. `cuda_graphs=True` (CUDA EP, one row) replays one ORT CUDA graph
per (tree, cache) bucket.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..lowering.buckets import KV_BUCKET, kv_bucket, tree_bucket
from .kv_io import KV_OUTPUTS, QUERIES_OUTPUT
from .draft import OrtDraft
from .ort import bind, ort_session, read_manifest, run_binding, run_bound
from ..runtime.generation import check_batch_size
from ..runtime.invariance import check_invariance
from ..runtime.program import DecodeProgram
from ...drafters import Drafter, default_drafter
from ...common.errors import InvalidParameterError, SpecpassError
from ...ir.draft import DRAFT_STATES
from ...ir.layout import SlotLayout
from ...passes import Pipeline
from ...passes.runtime import RuntimeHooks

_TORCH = {"float32": torch.float32, "float16": torch.float16}


class OrtProgram(DecodeProgram):
    """An exported step on ONNX Runtime behind the decode loop's program interface."""

    def __init__(
        self,
        directory: str,
        *,
        drafter: Drafter | None = None,
        device: str | torch.device = "cpu",
        cache_size: int | None = None,
        max_nodes: int | None = None,
        budget: str | int = "cost",
        cuda_graphs: bool = False,
        rows: int = 1,
    ):
        """directory: a `specpass export` output; drafter: default prompt lookup + token recycling;
        device: cpu (CPU EP) or cuda (CUDA EP); cache_size: KV slots per sequence (default 2048; an
        evicting export's is its budget, fixed at export); max_nodes: cap on the tree
        size (default: the exported TreeAttention's max_nodes; 1 is plain greedy decoding); budget:
        "cost" or a fixed node count, as in CompileOptions; rows: the most sequences one `generate`
        call decodes together (a batch: input_ids [B, P] with B <= rows)."""
        super().__init__(drafter if drafter is not None else default_drafter(), budget)
        if cache_size is not None and (not isinstance(cache_size, int) or cache_size < 2):
            raise InvalidParameterError(f"cache_size must be an int >= 2, got {cache_size!r}")
        self.manifest = read_manifest(directory)
        self.directory = directory
        self.pipeline = Pipeline.from_dict(self.manifest["pipeline"])
        self.verifies_trees = self.pipeline.verifies_trees()
        self.max_nodes = self.pipeline.largest_tree()
        if max_nodes is not None:
            if not isinstance(max_nodes, int) or not 1 <= max_nodes <= self.max_nodes:
                raise InvalidParameterError(f"max_nodes must be an int in [1, {self.max_nodes}], got {max_nodes!r}")
            self.max_nodes = max_nodes
        self.device = torch.device(device)
        if cuda_graphs and self.device.type != "cuda":
            raise InvalidParameterError("cuda_graphs needs device='cuda'")
        self.cuda_graphs = cuda_graphs
        if not isinstance(rows, int) or rows < 1:
            raise InvalidParameterError(f"rows must be an int >= 1, got {rows!r}")
        if rows > 1:
            _check_batched_export(self.manifest, directory, cuda_graphs)
        self.rows = rows
        self.session = ort_session(os.path.join(directory, "model.onnx"), self.device, cuda_graphs)
        self.dtype = _TORCH[self.manifest["dtype"]]
        self.hooks = RuntimeHooks([hook for p in self.pipeline if (hook := p.onnx_runtime_hook(self)) is not None])
        fixing = next((hook for hook in self.hooks if hook.fixed_cache is not None), None)  # an eviction's budget
        self.fixed_cache = fixed = fixing.fixed_cache if fixing is not None else None
        if fixed is not None and cache_size not in (None, fixed):
            raise InvalidParameterError(f"this export {fixing}, fixed at export: its cache_size is that; "
                                        f"got cache_size={cache_size}")  # fmt: skip
        self.max_nodes = min(self.max_nodes, self.hooks.max_step or self.max_nodes)  # no tree larger than a step takes
        self.cache_size = cache_size or fixed or 2048
        self.eos_token_ids = tuple(self.manifest["eos_token_ids"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.pad_token_id = self.manifest.get("pad_token_id")
        if "draft" in self.manifest:
            self.draft = OrtDraft(directory, self.manifest["draft"], self.device, self.dtype)
        m = self.manifest
        declared = {output["name"] for output in m["outputs"]}
        self.states_name = DRAFT_STATES if DRAFT_STATES in declared else "hidden"  # what the drafters read
        self.records_queries = QUERIES_OUTPUT in declared  # an evicting step's queries, for its policy
        self._kv_shape = (m["num_layers"], m["num_kv_heads"], m["head_dim"])
        self.keys = self._zeros_cache(1, fixed or KV_BUCKET)  # [L, B, KV, S, D]: B live rows; a fixed cache never grows
        self.values = self._zeros_cache(1, fixed or KV_BUCKET)
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.queries: torch.Tensor | None = None  # [L, B, H, T, D]: the last step's, when the step records them
        self._graphs: dict[tuple[int, int], tuple] = {}  # CUDA graphs: bucket -> (inputs, outputs, binding)
        self.invariance = check_invariance(self)  # ORT's kernels are its own: measured and reported, not refused
        self.hooks.new_sequence()

    @property
    def report(self) -> str:
        """Whether the session computes one function (backends.runtime.invariance), as measured here."""
        verdict = "one function" if self.invariance.passed else "not one function (speculation may change the output)"
        return f"ONNX Runtime, {self.device.type} EP: {verdict}: {self.invariance}"

    def open_session(self, name: str):
        """An ORT session of the export's file `name` on this program's device (a runtime hook's graphs)."""
        return ort_session(os.path.join(self.directory, name), self.device)

    def run_session(self, session, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        """Run `session` with torch tensors bound as its inputs and outputs (written in place)."""
        run_bound(session, self.device, inputs, outputs)

    def _zeros_cache(self, rows: int, slots: int) -> torch.Tensor:
        layers, heads, dim = self._kv_shape
        return torch.zeros(layers, rows, heads, slots, dim, dtype=self.dtype, device=self.device)

    def _reserve(self, rows: int, slots: int) -> None:
        """Make the cache buffers `rows` rows (a new batch: the rows' contents are not kept) of at least
        `slots` slots (grown to a multiple of KV_BUCKET, the committed slots kept)."""
        have_rows, have = self.keys.shape[1], self.keys.shape[3]
        if have_rows != rows:
            self.keys, self.values = self._zeros_cache(rows, have), self._zeros_cache(rows, have)
        if slots <= have or self.fixed_cache is not None:  # the loop keeps a step inside a fixed cache
            return
        grown = kv_bucket(slots)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._zeros_cache(rows, grown)
            new[:, :, :, :have] = old
            setattr(self, name, new)

    def _inputs(self, input_ids: torch.Tensor, layout: SlotLayout) -> dict:
        """The functional step's inputs (backends.onnx.kv_io) for input_ids [B, T] laid out by `layout`."""
        return {
            "input_ids": input_ids, "positions": layout.positions(), "past_keys": self.keys, "past_values": self.values,
            "past_mask": layout.past_mask(self.keys.shape[3]), "tree_mask": layout.ancestors,
        }  # fmt: skip

    def forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_size(self, layout.rows)
        tokens, layout = tokens.to(self.device), layout.to(self.device)
        self._reserve(layout.rows, max(layout.committed) + 1)
        if self.cuda_graphs:
            outputs = self._run_graph(tokens, layout)
        else:
            outputs = self._run(self._inputs(tokens, layout), layout.size)
        self._new = (outputs["new_keys"], outputs["new_values"])
        self.queries = outputs.get(QUERIES_OUTPUT)
        return outputs["logits"], outputs[self.states_name]

    def compact(self, layout: SlotLayout, paths: list[list[int]]) -> None:
        """Copy each row's path from the last step's new_keys / new_values into its committed slots."""
        if self._new is None:
            raise SpecpassError("commit before any forward")
        self._reserve(len(paths), max(c + len(p) for c, p in zip(layout.committed, paths)))
        for b, (committed, path) in enumerate(zip(layout.committed, paths, strict=True)):
            if not path:
                continue
            nodes = torch.tensor(path, device=self.device)
            for cache, new in zip((self.keys, self.values), self._new):  # new: [L, B, KV, T, D]
                cache[:, b, :, committed : committed + len(path)] = new[:, b].index_select(2, nodes)

    def keep_rows(self, keep: Sequence[int], slots: int) -> None:
        index = torch.tensor(list(keep), device=self.device)
        self.keys, self.values = self.keys.index_select(1, index), self.values.index_select(1, index)
        self.hooks.keep_rows(keep)

    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def _outputs(self, t: int) -> dict[str, torch.Tensor]:
        (layers, heads, dim), batch = self._kv_shape, self.keys.shape[1]
        m, kw = self.manifest, {"dtype": self.dtype, "device": self.device}
        outputs = {
            "logits": torch.empty(batch, t, m["vocab_size"], **kw),
            "hidden": torch.empty(batch, t, m["hidden_size"], **kw),
            "new_keys": torch.empty(layers, batch, heads, t, dim, **kw),
            "new_values": torch.empty(layers, batch, heads, t, dim, **kw),
        }
        if self.records_queries:
            outputs[QUERIES_OUTPUT] = torch.empty(layers, batch, m["num_heads"], t, dim, **kw)
        if self.states_name == DRAFT_STATES:
            outputs[DRAFT_STATES] = torch.empty(batch, t, m["hidden_size"], **kw)
        return outputs

    def _run(self, inputs: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
        outputs = self._outputs(t)
        run_bound(self.session, self.device, inputs, outputs)
        return outputs

    def _run_graph(self, input_ids: torch.Tensor, layout: SlotLayout) -> dict[str, torch.Tensor]:
        """CUDA-graph path: pad the step to its tree bucket (backends.lowering.buckets), copy into the bucket's
        static buffers, replay, and return views of the real nodes' outputs."""
        import onnxruntime as ort

        tb = tree_bucket(layout.size)
        key = (tb, self.keys.shape[3])  # one row: rows > 1 is refused with cuda_graphs (_check_batched_export)
        padded = layout.padded(tb, layout.rows)
        inputs = self._inputs(padded.step_inputs(input_ids)["input_ids"], padded)
        if key not in self._graphs:
            static = {name: value.contiguous().clone() for name, value in inputs.items()}
            static["past_keys"], static["past_values"] = self.keys, self.values
            outputs = self._outputs(tb)
            self._graphs[key] = (static, outputs, bind(self.session, self.device, static, outputs))
        static, outputs, binding = self._graphs[key]
        for name in ("input_ids", "positions", "past_mask", "tree_mask"):
            static[name].copy_(inputs[name])
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", str(list(self._graphs).index(key) + 1))
        run_binding(self.session, binding, run_options)
        t = layout.size
        per_layer = (*KV_OUTPUTS, QUERIES_OUTPUT)  # [L, B, heads, T, D]
        return {name: value[:, :, :, :t] if name in per_layer else value[:, :t] for name, value in outputs.items()}


def _check_batched_export(manifest: dict, directory: str, cuda_graphs: bool) -> None:
    """Refuse rows > 1 where the export or the options cannot run a batch (module docstring)."""
    if manifest["inputs"][0]["shape"][0] != "B":
        raise InvalidParameterError(f"{directory} was exported for one sequence (batch 1 is fixed in its graph); "
                                    "export it again with this specpass version to run batches (rows > 1)")  # fmt: skip
    if cuda_graphs:
        raise InvalidParameterError("rows > 1 does not run with cuda_graphs=True (its graphs are captured for one "
                                    "row); use cuda_graphs=False for batches")  # fmt: skip
