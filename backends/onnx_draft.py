"""The draft graph (rewrites.DraftHeads) on ONNX: exported beside the step as draft.onnx, run on ORT.

draft.onnx: inputs hidden [N, H] (final hidden states the heads start from), tokens [N, K] int64
(Hydra's drafted tokens; Medusa ignores them), head [N] int64 (which head each row evaluates);
outputs logits [N, D] over the draft vocabulary and its token ids vocab [D] (heads.modules.DraftStep).
N is dynamic. The LM head (or its draft-vocabulary rows) and the embedding are stored again in
draft.onnx (an ONNX model is one graph), so an export with heads holds them twice on disk.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import torch.fx

from specpass.errors import ExportError
from specpass.heads.modules import HeadsConfig
from specpass.ir import ArchSpec

DRAFT_FILE = "draft.onnx"
DRAFT_INPUTS = ("hidden", "tokens", "head")
DRAFT_OUTPUTS = ("logits", "vocab")


def _sample(arch: ArchSpec, config: HeadsConfig, dtype: torch.dtype, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "hidden": torch.randn(rows, arch.hidden_size, generator=gen).to(dtype),
        "tokens": torch.randint(0, arch.vocab_size, (rows, config.num_heads), generator=gen),
        "head": torch.arange(rows) % config.num_heads,
    }


def export_draft(draft: torch.fx.GraphModule, config: HeadsConfig, arch: ArchSpec, dtype: torch.dtype,
                 out_dir: str, check: bool, quiet) -> dict:  # fmt: skip
    """Write draft.onnx; returns its manifest entry (with the ORT/PyTorch check's max |diff|)."""
    rows = torch.export.Dim("N", min=1, max=4096)
    dynamic = {"hidden": {0: rows}, "tokens": {0: rows}, "head": {0: rows}}
    try:
        with quiet():
            program = torch.onnx.export(draft, (), kwargs=_sample(arch, config, dtype, 3), dynamo=True,
                                        dynamic_shapes=dynamic, input_names=list(DRAFT_INPUTS),
                                        output_names=list(DRAFT_OUTPUTS), optimize=True)  # fmt: skip
    except Exception as exc:
        raise ExportError(f"torch.onnx.export of the draft graph failed: {type(exc).__name__}: {str(exc)[:600]}") from exc
    path = os.path.join(out_dir, DRAFT_FILE)
    program.save(path)
    entry = {"file": DRAFT_FILE, "heads": dataclasses.asdict(config), "inputs": list(DRAFT_INPUTS),
             "outputs": list(DRAFT_OUTPUTS)}  # fmt: skip
    if check:
        entry["check_max_abs_diff"] = _check(path, draft, arch, config, dtype)
    return entry


def _check(path: str, draft: torch.fx.GraphModule, arch: ArchSpec, config: HeadsConfig, dtype: torch.dtype) -> float:
    import onnx

    from specpass.backends.onnx_export import TOLERANCE
    from specpass.backends.onnxrt import ort_session

    onnx.checker.check_model(path, full_check=True)
    inputs = _sample(arch, config, dtype, 5)
    with torch.no_grad():
        expected, vocab = draft(**inputs)
    got, got_vocab = ort_session(path, torch.device("cpu")).run(None, {k: v.numpy() for k, v in inputs.items()})
    if not torch.equal(torch.from_numpy(got_vocab), vocab.cpu()):
        raise ExportError("the draft graph on ORT returns another draft vocabulary than PyTorch")
    diff = float((torch.from_numpy(got).float() - expected.float()).abs().max())
    if not diff <= TOLERANCE[dtype]:
        raise ExportError(f"the draft graph on ORT differs from PyTorch by {diff:.3g} (> {TOLERANCE[dtype]})")
    return diff


class OrtDraft:
    """draft.onnx on an ORT session, called like a program's draft graph (drafters.DraftModel)."""

    def __init__(self, directory: str, entry: dict, device: torch.device, session_factory):
        heads = dict(entry["heads"])
        heads["accuracy"] = tuple(tuple(row) for row in heads.get("accuracy", ()))
        self.config = HeadsConfig(**heads)
        self.device = device
        self.session = session_factory(os.path.join(directory, entry["file"]), device)

    def __call__(
        self, hidden: torch.Tensor, tokens: torch.Tensor, head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feeds = {"hidden": hidden.detach().cpu().numpy(), "tokens": tokens.cpu().numpy().astype(np.int64),
                 "head": head.cpu().numpy().astype(np.int64)}  # fmt: skip
        logits, vocab = self.session.run(None, feeds)  # [N, D], [D]: small, the KV cache is not involved
        return torch.from_numpy(logits).to(self.device), torch.from_numpy(vocab).to(self.device)
