"""Chimera's draft (heads.chimera) in the feature draft's interface: its module (training, the pass,
drafting and export: tests/test_draft_designs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_draft

from specpass.common.errors import InvalidParameterError
from specpass.heads.chimera import ChimeraDraft
from specpass.heads.feature_draft import FeatureDraftConfig


def _config(**changes) -> FeatureDraftConfig:
    values = dict(hidden_size=16, vocab_size=40, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                  feature_layers=(), draft_vocab=12, rope_theta=10000.0, rms_eps=1e-6, model="m", design="chimera",
                  parallel_heads=3)  # fmt: skip
    return FeatureDraftConfig(**(values | changes))


def _draft(seed: int = 0) -> ChimeraDraft:
    return random_draft(ChimeraDraft(_config()), seed=seed)


def test_config_refuses_layers_and_a_head_count_for_another_design():
    with pytest.raises(InvalidParameterError, match="reads the final normed state"):
        _config(feature_layers=(1, 2, 3))
    with pytest.raises(InvalidParameterError, match="positive for a Chimera draft"):
        _config(parallel_heads=0)
    with pytest.raises(InvalidParameterError, match="0 for a clover one"):
        _config(design="clover")


@torch.no_grad()
def test_a_committed_token_is_its_definition():
    """Depth 0 against the parts written out: the trigram of the two tokens before and the token itself,
    one causal decoder layer over the cache (here: none), z = W_f [h; norm(d)], head 0's residual block."""
    draft = _draft()
    t = 5
    embeds, states, previous = torch.randn(1, t, 16), torch.randn(1, t, 16), torch.randn(1, t, 2, 16)
    empty = torch.zeros(1, 2, 0, 4)
    causal = torch.ones(1, t, t, dtype=torch.bool).tril()
    z, logits, keys, _ = draft.draft_step(embeds, states, torch.arange(t)[None], empty, empty, causal,
                                          torch.zeros(1, t, dtype=torch.long), previous)  # fmt: skip
    trigram = torch.cat((previous[:, :, 0], previous[:, :, 1], embeds), -1) @ draft.trigram.weight.T
    decoded, _, _ = draft.decoder(trigram, torch.arange(t)[None], empty, empty, causal)
    expected = torch.cat((states, draft.decoder_norm(decoded)), -1) @ draft.fuse.weight.T
    torch.testing.assert_close(z, expected)
    head = draft.heads[0]
    torch.testing.assert_close(logits, draft.head(expected + F.silu(expected @ head.weight.T + head.bias)))
    assert keys.shape == (1, 2, t, 4)


@torch.no_grad()
def test_a_drafted_token_reads_only_its_parents_state_and_its_depths_head():
    """The heads are parallel: a token at depth j > 0 hands its parent's state on and takes head j,
    whatever its own token, the tokens before it, the cache and the mask; at depth 0 they all matter."""
    draft = _draft()
    states = torch.randn(1, 3, 16)
    positions, depth = torch.arange(3)[None], torch.tensor([[0, 2, 1]])
    outs = []
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        embeds, previous = torch.randn(1, 3, 16, generator=gen), torch.randn(1, 3, 2, 16, generator=gen)
        keys, values = torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
        mask = torch.rand(1, 3, 7, generator=gen) < 0.5
        mask[..., 4:] = torch.ones(3, 3, dtype=torch.bool).tril()
        outs.append(draft.draft_step(embeds, states, positions, keys, values, mask, depth, previous))
    for a, b in zip(outs[0][:2], outs[1][:2]):
        assert torch.equal(a[:, 1:], b[:, 1:]) and not torch.equal(a[:, 0], b[:, 0])
    torch.testing.assert_close(outs[0][0][:, 1:], states[:, 1:])
    for i, j in ((1, 2), (2, 1)):
        torch.testing.assert_close(outs[0][1][:, i], draft.logits(draft.head_output(states[:, i], j)))


def test_the_drafter_refuses_a_depth_past_the_heads():
    from specpass.drafters import Feature
    from specpass.drafters.contract import DraftModel
    from specpass.ir.draft import FEATURE_KIND, DraftGraphSpec

    class _Draft(DraftModel):
        spec = DraftGraphSpec(kind=FEATURE_KIND, source="FeatureDraft", inputs=(), outputs=(), config=_config())
        config = spec.config

        def __call__(self, *args, **inputs):
            raise AssertionError("not called")

    with pytest.raises(InvalidParameterError, match="deeper than this Chimera draft's 3 heads"):
        Feature(depth=4).start([1, 2], prefill=None, draft=_Draft())


def test_training_asks_no_more_steps_than_heads():
    draft = _draft()
    with pytest.raises(InvalidParameterError, match="has 3 heads; 4 chain steps"):
        draft.forward_chains(torch.randn(1, 4, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 2, 16), 4)
