"""Clover's draft (heads.clover) in the feature draft's interface: its module (training, the pass,
drafting and export: tests/test_draft_designs.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_draft

from specpass.common.errors import InvalidParameterError
from specpass.heads.clover import CloverDraft
from specpass.heads.feature_draft import FeatureDraftConfig


def _config(**changes) -> FeatureDraftConfig:
    values = dict(hidden_size=16, vocab_size=40, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                  feature_layers=(), draft_vocab=12, rope_theta=10000.0, rms_eps=1e-6, model="m", design="clover")  # fmt: skip
    return FeatureDraftConfig(**(values | changes))


def _draft(seed: int = 0) -> CloverDraft:
    return random_draft(CloverDraft(_config()), seed=seed)


def test_config_refuses_layers_and_an_unsplittable_width():
    with pytest.raises(InvalidParameterError, match="reads the final normed state"):
        _config(feature_layers=(1, 2, 3))
    with pytest.raises(InvalidParameterError, match="splits hidden_size"):
        _config(num_heads=3, num_kv_heads=1)
    with pytest.raises(InvalidParameterError, match="unknown feature draft design"):
        _config(design="medusa")


@torch.no_grad()
def test_the_fusion_cell_is_its_definition():
    """GatedFusion against loops: per attention head, gate = cos(q_h, k_h); out = x + v * gate."""
    draft = _draft()
    cell = draft.chain_fusion
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    out = cell(x, y)
    q, k, v = cell.q_proj(cell.norm(x)), cell.k_proj(y), cell.v_proj(y)
    for i in range(3):
        for h in range(4):
            part = slice(4 * h, 4 * h + 4)
            gate = torch.dot(q[i, part], k[i, part]) / (q[i, part].norm() * k[i, part].norm())
            torch.testing.assert_close(out[i, part], x[i, part] + v[i, part] * gate)


@torch.no_grad()
def test_a_drafted_token_reads_no_cache_and_depth_picks_each_tokens_part():
    """A token at depth > 0 gets the same state and logits whatever its call's cache and mask (the
    Regressive Connection: no attention); in one call, each token takes the part its depth says (the
    training chains against decoding: tests/test_feature_draft.py)."""
    draft = _draft()
    embeds, states = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    positions, depth = torch.arange(3)[None], torch.tensor([[0, 2, 1]])
    outs = []
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        keys, values = torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
        mask = torch.rand(1, 3, 7, generator=gen) < 0.5
        mask[..., 4:] = torch.ones(3, 3, dtype=torch.bool).tril()
        outs.append(draft.draft_step(embeds, states, positions, keys, values, mask, depth, torch.randn(1, 3, 2, 16)))
    for a, b in zip(outs[0][:2], outs[1][:2]):
        assert torch.equal(a[:, 1:], b[:, 1:]) and not torch.equal(a[:, 0], b[:, 0])  # depth 0 reads the cache
    chained = draft.chain_fusion(states, embeds)
    torch.testing.assert_close(outs[0][0][:, 1:], chained[:, 1:])
    torch.testing.assert_close(outs[0][1][:, 1:], draft.logits(draft.chain_out(torch.cat((chained, embeds), -1)))[:, 1:])
