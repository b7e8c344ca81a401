"""A mixture-of-experts MLP in the captured step: routing as HF computes it, every expert over every token.

HF's expert loop gathers the tokens routed to each expert, so the rows an expert's GEMM sees (and, with
most kernels, the bits of a token's result) depend on the other tokens of the call. Here each expert
runs over all of the step's tokens, each with its own nn.Linear (so a lowering's linear kernel, which
computes a row alone, reaches it), and a token takes the outputs of its chosen experts with their
weights, the others with weight 0, summed in expert order as HF's `index_add_` does: a token's result
depends on that token alone, at every T, with static shapes (FX, CUDA graphs, ONNX). The cost is E / k
times the routed work (the dense form; for small models); docs/design.md, "Mixtures of experts".
"""

from __future__ import annotations

import torch
from torch import nn

from .families import MixtureParts


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear whose weight is `weight` [out, in] itself (a view of HF's stacked parameter)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
    return layer


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), HF's fused [gate | up] projection as one linear."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, activation: nn.Module):
        super().__init__()
        self.gate_up = _linear(gate_up)  # [2I, H]
        self.down = _linear(down)  # [H, I]
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, H]
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [N, I] x 2
        return self.down(self.activation(gate) * up)  # [N, H]


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts MLP as MixtureParts describes it (module docstring)."""

    def __init__(self, parts: MixtureParts):
        super().__init__()
        self.router = _linear(parts.router)  # [E, H]
        self.experts = nn.ModuleList(
            Expert(parts.gate_up[e], parts.down[e], parts.activation) for e in range(parts.gate_up.shape[0])
        )
        self.top_k = parts.top_k
        self.normalize = parts.normalize
        self.weights_in_float32 = parts.weights_in_float32
        self.shared_expert = parts.shared_expert  # None: no shared expert
        self.shared_expert_gate = parts.shared_gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h [B, T, H]
        x = h.reshape(-1, h.shape[-1])  # [N, H]
        logits = self.router(x)  # [N, E]
        probs = logits.float().softmax(dim=-1)  # [N, E]
        top, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, chosen, top)  # [N, E]: 0 where an expert is not chosen
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)  # [N, H]
        for e, expert in enumerate(self.experts):
            out = out + (expert(x) * weights[:, e : e + 1]).to(x.dtype)  # adding 0 leaves a sum's bits as they are
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view_as(h)
