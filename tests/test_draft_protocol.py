"""A draft graph that is not heads plugs in through the draft-graph protocol (ir.draft).

The toy here is a truncated model: the target's own embedding, its first two decoder layers
(attending causally within a window of the last W tokens, no KV cache) and its LM head. Its pass, its
drafter and this test are all it takes: the pass is known to pipelines by its class name, the verifier
checks its graph against its spec, the lowering lowers it, and the decode loop drives it, with an
output equal to plain greedy decoding.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specpass
from conftest import NEW_TOKENS
from specpass.drafters import Drafter, DraftSession
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.best_first import Candidate
from specpass.common.errors import PassMismatchError
from specpass.ir import arch_of, draft_spec, model_parts
from specpass.ir.decode_step import ApplyRope, RotaryPositions
from specpass.ir.draft import ROWS, DraftGraphSpec, DraftTensor, trace_draft
from specpass.ir.roles import Role
from specpass.passes import DraftGraphPass, Pipeline, known_passes
from specpass.rewrites import TreeAttention

WINDOW = 8


class Block(nn.Module):
    """One decoder layer of the model (its own submodules, shared), causal within the W tokens."""

    def __init__(self, parts, arch):
        super().__init__()
        attention = parts.attention  # a Llama layer: separate projections, norms before attention and MLP
        self.input_norm, self.mlp_norm, self.mlp = parts.attention_norm, parts.mlp_norm, parts.mlp
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.head_dim, self.scale, self.gqa = arch.head_dim, attention.scale, arch.kv_groups > 1
        self.rope = ApplyRope(arch.head_dim, arch.head_dim)

    def forward(self, h, cos, sin):  # h [N, W, H]
        n, w = h.shape[0], h.shape[1]
        x = self.input_norm(h)
        q = self.q_proj(x).view(n, w, -1, self.head_dim).transpose(1, 2)  # [N, heads, W, D]
        k = self.k_proj(x).view(n, w, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, w, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.gqa)
        h = h + self.o_proj(out.transpose(1, 2).reshape(n, w, -1))
        return h + self.mlp(self.mlp_norm(h))


class TruncatedModel(nn.Module):
    """tokens [N, W] -> next-token logits [N, V] of the first `layers` layers on those W tokens."""

    def __init__(self, parts, layers: int, arch):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = parts.embed_tokens, parts.norm, parts.lm_head
        self.rotary = RotaryPositions(parts.rotaries[0])
        self.blocks = nn.ModuleList(Block(parts.layers[i], arch) for i in range(layers))

    def forward(self, tokens):
        n, w = tokens.shape
        h = self.embed_tokens(tokens)  # [N, W, H]
        cos, sin = self.rotary(torch.arange(w, device=tokens.device)[None].expand(n, w), h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        return (self.lm_head(self.norm(h[:, -1])),)  # [N, V]


@dataclass(frozen=True)
class TruncatedDraft(DraftGraphPass):
    layers: int = 2

    def check_draft(self, gm):
        depth = arch_of(gm).num_layers
        return None if 1 <= self.layers < depth else f"{self.layers} layers do not truncate a {depth}-layer model"

    def build_draft(self, gm):
        arch = arch_of(gm)
        module = TruncatedModel(model_parts(gm), self.layers, arch)
        draft = trace_draft(module, {"lm_head": Role.LM_HEAD, "embed_tokens": Role.EMBED})
        spec = DraftGraphSpec(
            kind="truncated", source=self.name,
            inputs=(DraftTensor("tokens", (ROWS, WINDOW), "int64", bound=arch.vocab_size),),
            outputs=(DraftTensor("logits", (ROWS, arch.vocab_size), "model"),), config={"layers": self.layers},
        )  # fmt: skip
        return draft, spec, f"the first {self.layers} layers and the LM head"


@dataclass(frozen=True)
class TruncatedDrafter(Drafter):
    """Drafts a greedy chain of `depth` tokens with the truncated model, one draft call per token."""

    depth: int = 3

    def start(self, prompt, prefill, memory=None, draft=None, seed=0):
        if draft is None or draft.spec.kind != "truncated":
            raise specpass.InvalidParameterError("TruncatedDrafter needs TruncatedDraft in the pipeline")
        return TruncatedSession(self.depth, draft)


class TruncatedSession(DraftSession):
    def __init__(self, depth: int, draft):
        self.depth, self.draft = depth, draft
        self.stats = AcceptanceStats({}, default=0.3)
        self.calls = 0

    def candidates(self, tokens: Sequence[int]):
        context, chain = list(tokens[-WINDOW:]), []
        for _ in range(self.depth):
            window = torch.tensor([([0] * WINDOW + context)[-WINDOW:]])  # [1, W]
            (logits,) = self.draft(window)  # positionally, in the spec's input order
            self.calls += 1
            token = int(logits[0].argmax())
            chain.append(token)
            context.append(token)
        return _Chain(chain, self.stats)


class _Chain:
    def __init__(self, chain: list[int], stats: AcceptanceStats):
        self.chain, self.stats = chain, stats

    def root_candidates(self):
        return [Candidate(self.chain[0], self.stats.rate(0), 0, 0)]

    def child_candidates(self, token, state):
        nxt = state + 1
        return [Candidate(self.chain[nxt], self.stats.rate(nxt), nxt, nxt)] if nxt < len(self.chain) else []


@pytest.fixture(scope="module")
def pipeline():
    return Pipeline(TreeAttention(8), TruncatedDraft(2))


def test_the_pass_is_registered_and_round_trips_json(pipeline):
    assert known_passes()["TruncatedDraft"] is TruncatedDraft
    assert Pipeline.from_json(pipeline.to_json()) == pipeline


def test_the_draft_graph_is_verified_lowered_and_lossless(default_model, cases, pipeline):
    model, _ = default_model
    program = specpass.compile_program(model, {"pipeline": pipeline, "drafter": TruncatedDrafter(), "budget": 4})
    assert "TruncatedDraft: modified" in str(program.report) and "first 2 layers" in str(program.report)
    spec = draft_spec(program.step.graph_module)
    assert spec.kind == "truncated" and spec.input_names == ("tokens",) and program.draft.spec is spec
    gm = program.step.graph_module
    for mine, step_s in (("blocks.1.q_proj", "layers.1.self_attn.q_proj"), ("lm_head", "lm_head")):
        assert gm.draft.get_submodule(mine).weight is gm.get_submodule(step_s).weight  # shared, not copied
    accepted = 0
    for ids, reference in cases[1:3]:  # code 2 ends at EOS after 46 tokens, chat 0 at the length limit
        out = specpass.generate(program, ids, NEW_TOKENS)
        assert torch.equal(out.sequences, reference)
        accepted += out.stats.new_tokens - len(out.stats.steps) - 1
    assert accepted > 0  # the truncated model's drafts were verified and some accepted


def test_it_is_refused_twice_and_where_it_does_not_fit(default_model):
    model, _ = default_model
    with pytest.raises(PassMismatchError, match="already has a draft graph"):
        specpass.compile_program(model, {"pipeline": Pipeline(TruncatedDraft(2), specpass.rewrites.DraftHeads())})
    with pytest.raises(PassMismatchError, match="do not truncate a 30-layer model"):
        specpass.compile_program(model, {"pipeline": Pipeline(TruncatedDraft(30))})
