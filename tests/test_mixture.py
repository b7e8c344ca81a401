"""Mixture-of-experts families (Mixtral, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE, OLMoE
with clip_qkv, gpt-oss with attention sinks and alternating windows) on tiny random configs: the captured
block's roles and shared weights; greedy equal to HF greedy alone, in batches and with trees of 1, 8 and
64 nodes (or the window's depth), on the CPU lowerings and on ORT; seeded sampling equal to one-node
sampling; each rewrite applied or refused by name. The bitwise invariance of every family (these
included) is tests/test_invariance.py's; capture against HF's prefill and cached steps,
tests/test_capture.py's; the property test draws them too."""

import pytest
import torch
from conftest import FIXED_BUDGET, needs_cxx, padded, tiny_model

import specpass
from specpass.common.errors import PassMismatchError
from specpass.drafters import Combined, PromptLookup, SelfDraft, TokenRecycling
from specpass.ir import capture, info
from specpass.ir.roles import Role, nodes_with_role
from specpass.rewrites import EarlyExit, LadderResidual, TreeAttention
from specpass.rewrites.kv_eviction import SinksWindow

MIXTURES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "gpt-oss")


def _peaked(arch: str, seed: int = 2):
    model = tiny_model(arch, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
    return model


def _prompts(count: int) -> list[torch.Tensor]:
    """Repetitive prompts of different lengths (drafts get accepted; rows pad differently)."""
    gen = torch.Generator().manual_seed(count)
    pieces = [torch.randint(3, 96, (n,), generator=gen) for n in range(5, 5 + count)]
    return [torch.cat([p, p, p[:3]]) for p in pieces]


def _hf_greedy(model, prompt: torch.Tensor, new: int) -> list[int]:
    ids = prompt[None]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", MIXTURES)
def test_the_captured_mixture_has_its_roles_and_the_models_own_weights(arch):
    model = tiny_model(arch)
    gm = capture(model, cache_size=32)
    hf_layers = model.model.layers
    sparse = [i for i, layer in enumerate(hf_layers) if hasattr(layer.mlp, "experts")]
    assert sparse == ([1] if arch == "qwen2-moe" else [0, 1])  # Qwen2-MoE's layer 0 is dense (decoder_sparse_step 2)
    sinks = any(n.op == "get_attr" and n.target.endswith("sinks") for n in gm.graph.nodes)
    assert sinks == (arch == "gpt-oss")  # the attention reads HF's sinks parameter
    routers = nodes_with_role(gm.graph, Role.ROUTER)
    assert sorted({info(n).layer for n in routers}) == sparse
    experts = {info(n).layer for n in nodes_with_role(gm.graph, Role.EXPERT) if n.op == "call_module"}
    assert experts == set(sparse)
    assert bool(nodes_with_role(gm.graph, Role.SHARED_EXPERT)) == (arch == "qwen2-moe")
    for i in sparse:
        hf = hf_layers[i].mlp
        captured = gm.get_submodule(f"layers.{i}.mlp")
        router = hf.gate if hasattr(hf, "gate") else hf.router  # gpt-oss: `router`, with a bias
        assert captured.router.weight.data_ptr() == router.weight.data_ptr()
        for e in range(hf.experts.gate_up_proj.shape[0]):  # views of HF's stacked weights, never copies
            expert = captured.get_submodule(f"experts.{e}")
            assert expert.gate_up.weight.data_ptr() == hf.experts.gate_up_proj[e].data_ptr()
            assert expert.down.weight.data_ptr() == hf.experts.down_proj[e].data_ptr()


@pytest.mark.parametrize("arch", MIXTURES)
def test_greedy_equals_hf_greedy_alone_in_a_batch_and_with_trees_of_1_8_and_64_nodes(arch):
    """On the eager lowering (oneDNN: tests/test_invariance.py bit for bit, and greedy on every lowering in
    benchmarks/results/families-moe-lowerings-*.json)."""
    lowering = "eager"
    model = _peaked(arch)
    prompts = _prompts(3)
    expected = [_hf_greedy(model, p, 30) for p in prompts]
    window = specpass.ir.arch_spec(model).smallest_window  # trees stay shallower than a sliding window
    for nodes in (1, 8, 64 if window is None else window - 1):
        options = {"pipeline": specpass.Pipeline(TreeAttention(max(nodes, 2))), "lowering": lowering, "budget": nodes,
                   "drafter": Combined(PromptLookup(), TokenRecycling()), "cache_size": 128}  # fmt: skip
        alone = specpass.generate(model, prompts[0][None], 30, eos_token_id=[], options=options)
        assert alone.sequences[0, len(prompts[0]) :].tolist() == expected[0], nodes
        assert (alone.stats.tau > 1.0) == (nodes > 1)  # drafts were accepted wherever there were drafts
    ids, mask = padded(prompts)  # the rows of different lengths, with the largest trees
    batch = specpass.generate(model, ids, 30, attention_mask=mask, eos_token_id=[], options=options)
    assert [list(row) for row in batch.new_tokens] == expected


@needs_cxx
def test_inductor_greedy_equals_hf_greedy_on_a_mixture():
    """gpt-oss: its attention with sinks and its router's softmax run as custom ops in compiled code."""
    model = _peaked("gpt-oss")
    options = {"pipeline": specpass.Pipeline(TreeAttention(8)), "lowering": "inductor", "budget": 8, "cache_size": 128}
    prompt = _prompts(1)[0]
    out = specpass.generate(model, prompt[None], 24, eos_token_id=[], options=options)
    assert out.sequences[0, len(prompt) :].tolist() == _hf_greedy(model, prompt, 24)
    assert out.stats.tau > 1.0


def test_a_mixture_with_attention_sinks_exported_to_onnx_decodes_on_ort_as_hf_greedy(tmp_path):
    from specpass.backends.onnx.export import export

    model = _peaked("gpt-oss")
    result = export(model, specpass.Pipeline(TreeAttention(16)), str(tmp_path / "onnx"), force=True, progress=False)
    program = specpass.load_onnx(result.directory, cache_size=128, budget=16)
    for prompt in _prompts(2):
        out = specpass.generate(program, prompt[None], max_new_tokens=24, eos_token_id=[])
        assert out.sequences[0, len(prompt) :].tolist() == _hf_greedy(model, prompt, 24)
    assert out.stats.tau > 1.0


def test_seeded_sampling_in_a_batch_equals_one_node_sampling_of_each_row():
    model = _peaked("qwen3-moe")
    prompts = _prompts(3)
    tree = {"pipeline": specpass.Pipeline(TreeAttention(16)), "budget": FIXED_BUDGET, "cache_size": 128}
    ids, mask = padded(prompts)
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95}
    batch = specpass.generate(model, ids, 24, attention_mask=mask, eos_token_id=[], seed=[3, 4, 5], options=tree,
                              **sampling)  # fmt: skip
    one_node = tree | {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}
    for b, prompt in enumerate(prompts):
        alone = specpass.generate(model, prompt[None], 24, eos_token_id=[], seed=3 + b, options=one_node, **sampling)
        assert list(batch.new_tokens[b]) == alone.sequences[0, len(prompt) :].tolist(), b
    greedy = [_hf_greedy(model, p, 24) for p in prompts]
    assert [list(row) for row in batch.new_tokens] != greedy  # the rows did sample


def test_self_drafting_from_the_first_layer_equals_hf_greedy():
    model = _peaked("mixtral")
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(1)), "drafter": SelfDraft(4),
               "cache_size": 128, "budget": 5}  # fmt: skip
    for prompt in _prompts(2):
        out = specpass.generate(model, prompt[None], max_new_tokens=30, eos_token_id=[], options=options)
        assert out.sequences[0, len(prompt) :].tolist() == _hf_greedy(model, prompt, 30)


@torch.no_grad()
def test_kv_eviction_on_a_mixture_gains_nothing_from_speculation_and_changes_the_output():
    model = _peaked("qwen2-moe")
    prompt = _prompts(3)[2]
    prompt = torch.cat([prompt, prompt])  # 34 tokens: past the budget
    outputs = {}
    for budget in (1, 8):
        options = {"pipeline": specpass.Pipeline(TreeAttention(16), SinksWindow(24, 8, sinks=2)), "budget": budget,
                   "drafter": PromptLookup()}  # fmt: skip
        outputs[budget] = specpass.generate(model, prompt[None], 40, eos_token_id=[], options=options)
    assert outputs[8].sequences.tolist() == outputs[1].sequences.tolist()
    assert outputs[8].sequences[0, len(prompt) :].tolist() != _hf_greedy(model, prompt, 40)  # a lossy rewrite


def test_kv_eviction_refuses_attention_sinks_by_name_and_leaves_the_graph():
    gm = capture(tiny_model("gpt-oss"), cache_size=64)
    before = str(gm.graph)
    with pytest.raises(PassMismatchError, match="attention has sinks"):
        specpass.Pipeline(TreeAttention(8), SinksWindow(24, 8, sinks=2)).run(gm)
    assert str(gm.graph) == before


def test_the_ladder_applies_and_tensor_parallelism_is_refused_by_name(one_rank_group):
    from specpass.rewrites import TensorParallel

    model = tiny_model("qwen3-moe")
    laddered, report = specpass.Pipeline(TreeAttention(8), LadderResidual((1,))).run(capture(model, cache_size=64))
    assert "output changes" in str(report) or "changes" in str(report)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    assert laddered(**specpass.ir.SlotLayout.chain(0, 8).step_inputs(ids))[0].shape == (1, 8, 96)
    gm = capture(model, cache_size=64)
    before = str(gm.graph)
    with pytest.raises(PassMismatchError, match="mixture of experts is not sharded"):
        specpass.Pipeline(TensorParallel()).run(gm)
    assert str(gm.graph) == before


@pytest.fixture
def one_rank_group():
    """A gloo group of one process: TensorParallel's checks run as under torchrun."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_hydra_heads_trained_on_a_mixture_lower_their_loss_and_decode_as_hf_greedy(tmp_path):
    """The heads trainer on a tiny mixture's own continuations (the heads read its final hidden states:
    nothing in them knows the experts), then lossless decoding with them, alone and combined."""
    from specpass.drafters import Heads
    from specpass.research.heads_training import TrainConfig, generate_corpus, train_heads
    from specpass.rewrites import DraftHeads

    model = _peaked("qwen3-moe")
    gen = torch.Generator().manual_seed(0)
    corpus = generate_corpus(model, [torch.randint(3, 96, (1, 6), generator=gen) for _ in range(24)],
                             max_new_tokens=24, progress=False)  # fmt: skip
    held_out = generate_corpus(model, [torch.randint(3, 96, (1, 6), generator=gen) for _ in range(4)],
                               max_new_tokens=24, progress=False)  # fmt: skip
    config = TrainConfig(design="hydra", num_heads=3, prompts=len(corpus), epochs=6, batch_size=16, lr=3e-3,
                         held_out=4, draft_vocab=48)  # fmt: skip
    _, _, losses = train_heads(model, corpus, held_out, config, out_dir=str(tmp_path), progress=False)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    pipeline = specpass.Pipeline(TreeAttention(16), DraftHeads("hydra", str(tmp_path)))
    for drafter in (Heads(), Combined(Heads(), PromptLookup(), TokenRecycling())):
        for prompt in _prompts(2):
            out = specpass.generate(model, prompt[None], 24, eos_token_id=[],
                                    options={"pipeline": pipeline, "drafter": drafter, "cache_size": 128})  # fmt: skip
            assert out.sequences[0, len(prompt) :].tolist() == _hf_greedy(model, prompt, 24)


def _four_layer_mixture():
    """Tiny Qwen3-MoE with 4 layers, peaked: room for a layer-skipping draft and a feature draft's layers."""
    import transformers

    from specpass.research.tiny_models import TINY, TINY_CONFIGS

    model_class, config_class, extra = TINY_CONFIGS["qwen3-moe"]
    torch.manual_seed(3)
    config = getattr(transformers, config_class)(**(TINY | extra | {"num_hidden_layers": 4}))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_a_layer_skipping_draft_and_a_trained_feature_draft_on_a_mixture_equal_hf_greedy(tmp_path):
    from conftest import train_tiny_feature_draft

    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, LayerSkip

    model = _four_layer_mixture()
    prompts = _prompts(2)
    expected = [_hf_greedy(model, p, 24) for p in prompts]
    skipping = {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip((2,))), "drafter": SelfDraft(4),
                "cache_size": 128, "budget": 5}  # fmt: skip
    *_, losses = train_tiny_feature_draft(model, str(tmp_path))
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    feature = {"pipeline": specpass.Pipeline(TreeAttention(16), FeatureDraft(str(tmp_path))), "drafter": Feature(),
               "cache_size": 128, "budget": 12}  # fmt: skip
    for options in (skipping, feature):
        for prompt, reference in zip(prompts, expected):
            out = specpass.generate(model, prompt[None], 24, eos_token_id=[], options=options)
            assert out.sequences[0, len(prompt) :].tolist() == reference
