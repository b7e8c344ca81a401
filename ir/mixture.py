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


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear whose weight is `weight` [out, in] itself (a view of HF's stacked parameter), and bias."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=bias.requires_grad)
    return layer


class GatedActivation(nn.Module):
    """activation(gate) * up over HF's [gate | up] columns (the default of HF's experts)."""

    def __init__(self, activation: nn.Module):
        super().__init__()
        self.activation = activation

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2I]
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I] x 2
        return self.activation(gate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gate over interleaved [gate, up, gate, up, ...] columns, as its HF experts compute it."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2I]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # [N, I] x 2
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class Expert(nn.Module):
    """One expert: down(glu(gate_up(x))), HF's fused gate / up projection as one linear."""

    def __init__(self, parts: MixtureParts, e: int):
        super().__init__()
        gate_up, down = parts.gate_up[e], parts.down[e]
        if parts.transposed:  # stored [in, out]: the linear's weight is its transpose (a view)
            gate_up, down = gate_up.t(), down.t()
        bias = (lambda b: None if b is None else b[e])  # noqa: E731
        self.gate_up = _linear(gate_up, bias(parts.gate_up_bias))  # [2I, H]
        self.glu = GatedActivation(parts.activation) if parts.clamp is None else ClampedSwiGLU(*parts.clamp)
        self.down = _linear(down, bias(parts.down_bias))  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, H]
        return self.down(self.glu(self.gate_up(x)))  # [N, H]


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts MLP as MixtureParts describes it (module docstring)."""

    def __init__(self, parts: MixtureParts):
        super().__init__()
        self.router = _linear(parts.router, parts.router_bias)  # [E, H]
        self.experts = nn.ModuleList(Expert(parts, e) for e in range(parts.gate_up.shape[0]))
        self.top_k = parts.top_k
        self.softmax_first = parts.softmax_first
        self.normalize = parts.normalize
        self.weights_in_float32 = parts.weights_in_float32
        self.shared_expert = parts.shared_expert  # None: no shared expert
        self.shared_expert_gate = parts.shared_gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h [B, T, H]
        x = h.reshape(-1, h.shape[-1])  # [N, H]
        logits = self.router(x)  # [N, E]
        if self.softmax_first:
            probs = logits.float().softmax(dim=-1)  # [N, E]
            top, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        else:  # the top k logits, then a softmax over them (gpt-oss)
            top, chosen = logits.topk(self.top_k, dim=-1)  # [N, k]
            top = top.softmax(dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(logits, dtype=top.dtype).scatter(1, chosen, top)  # [N, E]: 0 where not chosen
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)  # [N, H]
        for e, expert in enumerate(self.experts):
            out = out + (expert(x) * weights[:, e : e + 1]).to(x.dtype)  # adding 0 leaves a sum's bits as they are
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view_as(h)
