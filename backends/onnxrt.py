"""ONNX Runtime lowering: the decode loop drives a step exported by `specpass export` on an ORT session.

KV cache. Two torch tensors [L, 1, KV, S, D] (on the CPU, or on the GPU with the CUDA EP) are the
step's `past_keys` / `past_values` inputs as they are: slots at and past the committed length are
hidden by `past_mask`. S grows in buckets of KV_BUCKET slots (the buffer is reallocated and copied
when the committed prefix outgrows it), so the step attends over at most KV_BUCKET - 1 spare slots.
After a verify step `commit` copies the accepted path's entries of `new_keys` / `new_values` into
consecutive slots: compaction without recompute, as in the PyTorch lowering.

Inputs and outputs are bound with IOBinding to torch tensors' memory: the KV cache never leaves the
device and is never copied between steps. With `cuda_graphs=True` on the CUDA EP every input and
output lives in a static buffer per (tree-size bucket, cache bucket), the tree padded like the
PyTorch CUDA-graph lowering, and ORT captures one CUDA graph per bucket (`gpu_graph_id`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import torch

from specpass.backends.onnx_draft import OrtDraft
from specpass.backends.program import DecodeProgram
from specpass.drafters import Drafter, default_drafter
from specpass.errors import InvalidParameterError, SpecpassError
from specpass.passes import Pipeline
from specpass.rewrites import TreeAttention

KV_BUCKET = 256
_NUMPY = {torch.int64: np.int64, torch.bool: np.bool_, torch.float32: np.float32, torch.float16: np.float16}
_TORCH = {"float32": torch.float32, "float16": torch.float16}


def ort_session(onnx_path: str, device: torch.device, cuda_graphs: bool = False):
    """An ORT session on the CPU EP, or the CUDA EP (optionally with CUDA graphs) for a CUDA device."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise SpecpassError(
            "the ONNX Runtime backend needs onnxruntime: pip install 'specpass[cpu]' (or 'specpass[gpu]' for CUDA)"
        ) from exc
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SpecpassError("the CUDA EP is not available: install onnxruntime-gpu ('specpass[gpu]')")
        cuda = {"device_id": device.index or 0, "enable_cuda_graph": "1" if cuda_graphs else "0"}
        providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(onnx_path, options, providers=providers)


def read_manifest(directory: str) -> dict:
    if not os.path.isdir(directory):
        raise SpecpassError(f"no specpass export at {directory!r}: the directory does not exist")
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        raise SpecpassError(f"{directory} holds no specpass export (no manifest.json); run `specpass export -o DIR`")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != 1:
        raise SpecpassError(f"{path}: unknown manifest format {manifest.get('format_version')!r}")
    return manifest


class OrtProgram(DecodeProgram):
    """An exported step on ONNX Runtime behind the decode loop's program interface."""

    def __init__(
        self,
        directory: str,
        *,
        drafter: Drafter | None = None,
        device: str | torch.device = "cpu",
        cache_size: int = 2048,
        max_nodes: int | None = None,
        budget: str | int = "cost",
        cuda_graphs: bool = False,
    ):
        """directory: a `specpass export` output; drafter: default prompt lookup + token recycling;
        device: cpu (CPU EP) or cuda (CUDA EP); cache_size: KV slots; max_nodes: cap on the tree
        size (default: the exported TreeAttention's max_nodes; 1 is plain greedy decoding); budget:
        "cost" or a fixed node count, as in CompileOptions."""
        super().__init__(drafter if drafter is not None else default_drafter(), budget)
        if not isinstance(cache_size, int) or cache_size < 2:
            raise InvalidParameterError(f"cache_size must be an int >= 2, got {cache_size!r}")
        self.manifest = read_manifest(directory)
        self.pipeline = Pipeline.from_dict(self.manifest["pipeline"])
        tree = next((p for p in self.pipeline if isinstance(p, TreeAttention)), None)
        self.tree = tree is not None
        self.max_nodes = tree.max_nodes if tree is not None else 16
        if max_nodes is not None:
            if not isinstance(max_nodes, int) or not 1 <= max_nodes <= self.max_nodes:
                raise InvalidParameterError(f"max_nodes must be an int in [1, {self.max_nodes}], got {max_nodes!r}")
            self.max_nodes = max_nodes
        self.device = torch.device(device)
        if cuda_graphs and self.device.type != "cuda":
            raise InvalidParameterError("cuda_graphs needs device='cuda'")
        self.cuda_graphs = cuda_graphs
        self.session = ort_session(os.path.join(directory, "model.onnx"), self.device, cuda_graphs)
        if "draft" in self.manifest:
            self.draft = OrtDraft(directory, self.manifest["draft"], self.device, ort_session)
        self.cache_size = cache_size
        self.eos_token_ids = tuple(self.manifest["eos_token_ids"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.dtype = _TORCH[self.manifest["dtype"]]
        m = self.manifest
        self._kv_shape = (m["num_layers"], 1, m["num_kv_heads"], m["head_dim"])
        self.keys = self._zeros_cache(KV_BUCKET)  # [L, 1, KV, S, D]
        self.values = self._zeros_cache(KV_BUCKET)
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graphs: dict[tuple[int, int], tuple] = {}  # CUDA graphs: bucket -> (inputs, outputs, binding)

    def _zeros_cache(self, slots: int) -> torch.Tensor:
        layers, batch, heads, dim = self._kv_shape
        return torch.zeros(layers, batch, heads, slots, dim, dtype=self.dtype, device=self.device)

    def _reserve(self, slots: int) -> None:
        """Grow the cache buffers to hold `slots` slots (a multiple of KV_BUCKET)."""
        have = self.keys.shape[3]
        if slots <= have:
            return
        grown = -(-slots // KV_BUCKET) * KV_BUCKET
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._zeros_cache(grown)
            new[:, :, :, :have] = old
            setattr(self, name, new)

    def forward(self, tokens, positions, tree_mask, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = tokens.shape[0]
        self._reserve(start + 1)
        slots = self.keys.shape[3]
        past_mask = (torch.arange(slots, device=self.device) < start).expand(1, t, slots)  # [1, T, S]
        inputs = {
            "input_ids": tokens[None], "positions": positions[None], "past_keys": self.keys,
            "past_values": self.values, "past_mask": past_mask, "tree_mask": tree_mask[None],
        }  # fmt: skip
        outputs = self._run_graph(inputs, t) if self.cuda_graphs else self._run(inputs, t)
        self._new = (outputs["new_keys"], outputs["new_values"])
        return outputs["logits"][0], outputs["hidden"][0]

    def commit(self, start: int, path: Sequence[int]) -> None:
        if self._new is None:
            raise SpecpassError("commit before any forward")
        self._reserve(start + len(path))
        nodes = torch.tensor(list(path), device=self.device)
        for cache, new in zip((self.keys, self.values), self._new):
            cache[:, :, :, start : start + len(path)] = new.index_select(3, nodes)

    def _outputs(self, t: int) -> dict[str, torch.Tensor]:
        layers, batch, heads, dim = self._kv_shape
        m, kw = self.manifest, {"dtype": self.dtype, "device": self.device}
        return {
            "logits": torch.empty(batch, t, m["vocab_size"], **kw),
            "hidden": torch.empty(batch, t, m["hidden_size"], **kw),
            "new_keys": torch.empty(layers, batch, heads, t, dim, **kw),
            "new_values": torch.empty(layers, batch, heads, t, dim, **kw),
        }

    def _bind(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        binding = self.session.io_binding()
        device = self.device.type
        index = self.device.index or 0
        for name, tensor in inputs.items():  # contiguous tensors, alive until the run (ORT reads their memory)
            binding.bind_input(name, device, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
        for name, tensor in outputs.items():
            binding.bind_output(name, device, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
        return binding

    def _run(self, inputs: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
        outputs = self._outputs(t)
        inputs = {name: tensor.contiguous() for name, tensor in inputs.items()}
        binding = self._bind(inputs, outputs)
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return outputs

    def _run_graph(self, inputs: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
        """CUDA-graph path: copy into the bucket's static buffers (the tree padded to a power of two:
        padded nodes see only themselves), replay, and return views of the real nodes' outputs."""
        import onnxruntime as ort

        tb = 1 << (t - 1).bit_length()
        key = (tb, self.keys.shape[3])
        if key not in self._graphs:
            static = {
                "input_ids": torch.zeros(1, tb, dtype=torch.long, device=self.device),
                "positions": torch.zeros(1, tb, dtype=torch.long, device=self.device),
                "past_keys": self.keys, "past_values": self.values,
                "past_mask": torch.zeros(1, tb, key[1], dtype=torch.bool, device=self.device),
                "tree_mask": torch.zeros(1, tb, tb, dtype=torch.bool, device=self.device),
            }  # fmt: skip
            outputs = self._outputs(tb)
            self._graphs[key] = (static, outputs, self._bind(static, outputs))
        static, outputs, binding = self._graphs[key]
        static["input_ids"].zero_()[:, :t] = inputs["input_ids"]
        static["positions"][:, :t] = inputs["positions"]
        static["positions"][:, t:] = inputs["positions"][:, -1:] + torch.arange(1, tb - t + 1, device=self.device)
        static["past_mask"].zero_()[:, :t] = inputs["past_mask"]
        static["tree_mask"].copy_(torch.eye(tb, dtype=torch.bool, device=self.device)[None])
        static["tree_mask"][:, :t, :t] = inputs["tree_mask"]
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", str(list(self._graphs).index(key) + 1))
        self.session.run_with_iobinding(binding, run_options)
        return {name: value[:, :, :, :t] if name.startswith("new_") else value[:, :t] for name, value in outputs.items()}
