"""A step's draft graph (ir.draft) on ONNX: exported beside the step as draft.onnx, run on ORT.

Everything comes from the graph's DraftGraphSpec: the sample inputs the exporter traces and the check
runs (`ir.draft.sample_inputs`), the dynamic named dimensions of every input, the output names, and
the buffers ORT writes into. For draft heads (rewrites.DraftHeads) that is hidden [N, H], tokens
[N, K], head [N] -> logits [N, D], vocab [D]. A feature draft (rewrites.FeatureDraft) has a KV cache
of its own, an input and an output as the step's is: tokens, states, positions [N, T(, H)], past_keys
/ past_values [N, nkv, S, d], mask [N, T, S + T], depth [N, T], previous [N, T, 2] -> new_states,
logits [N, T, D], vocab, keys / values
[N, nkv, S + T, d], with N, T and S dynamic. Weights the draft graph shares with the step (the LM
head or its rows, the embedding) are stored again in draft.onnx: an ONNX model is one graph.
"""

from __future__ import annotations

import os

import torch
import torch.fx

from .ort import check_against_torch, ort_session, run_bound
from ...common.errors import ExportError
from ...ir.draft import ROWS, DraftGraphSpec, named_sizes, sample_inputs
from ...passes import pass_type

DRAFT_FILE = "draft.onnx"


def export_draft(draft: torch.fx.GraphModule, spec: DraftGraphSpec, dtype: torch.dtype, out_dir: str, check: bool,
                 quiet) -> dict:  # fmt: skip
    """Write draft.onnx; returns its manifest entry (the spec, with the ORT/PyTorch check's max |diff|)."""
    dims = {name: torch.export.Dim(name, min=1, max=1 << 20) for t in spec.inputs for name in t.named_dims().values()}
    dynamic = {t.name: {axis: dims[name] for axis, name in t.named_dims().items()} | _sums(t) for t in spec.inputs}
    try:
        with quiet():
            program = torch.onnx.export(draft, (), kwargs=sample_inputs(spec, dtype, 3), dynamo=True,
                                        dynamic_shapes=dynamic, input_names=list(spec.input_names),
                                        output_names=list(spec.output_names), optimize=False)  # fmt: skip
    except Exception as exc:
        raise ExportError(f"torch.onnx.export of the draft graph failed: {type(exc).__name__}: {str(exc)[:600]}") from exc
    path = os.path.join(out_dir, DRAFT_FILE)
    program.save(path)
    entry = {"file": DRAFT_FILE, "spec": spec.to_dict()}
    if check:
        inputs = sample_inputs(spec, dtype, 5)  # other sizes than traced: the named dimensions are dynamic
        entry["check_max_abs_diff"] = check_against_torch(path, draft, inputs, spec.output_names, dtype, "the draft graph")
    return entry


def _sums(tensor) -> dict:
    """A dimension that is a sum of named sizes ("S+T") is dynamic too; torch.export derives its relation."""
    return {axis: torch.export.Dim.AUTO for axis, d in enumerate(tensor.shape) if isinstance(d, str) and "+" in d}


class OrtDraft:
    """draft.onnx on an ORT session, called like a program's draft graph (drafters.DraftModel).

    Inputs and outputs are bound with IOBinding to torch tensors on the program's device (outputs
    allocated from the spec), so a draft call on the CUDA EP never goes through host memory.
    """

    def __init__(self, directory: str, entry: dict, device: torch.device, dtype: torch.dtype):
        data = entry["spec"]
        self.spec = DraftGraphSpec.from_dict(data, pass_type(data["source"]).config_from_dict(data["config"]))
        self.device = device
        self.dtype = dtype
        self.session = ort_session(os.path.join(directory, entry["file"]), device)

    @property
    def config(self):
        return self.spec.config

    def __call__(self, *args: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs.update(zip(self.spec.input_names, args))
        sizes = named_sizes(self.spec, inputs)
        feeds = {t.name: inputs[t.name].to(self.device, t.torch_dtype(self.dtype)).contiguous()
                 for t in self.spec.inputs}  # fmt: skip
        outputs = {t.name: torch.empty(t.concrete_shape(sizes[ROWS], sizes), dtype=t.torch_dtype(self.dtype),
                                       device=self.device) for t in self.spec.outputs}  # fmt: skip
        run_bound(self.session, self.device, feeds, outputs)
        return tuple(outputs[name] for name in self.spec.output_names)
