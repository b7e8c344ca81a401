"""Run by tests/test_tensor_parallel.py under `torchrun --nproc-per-node 3` (gloo, CPU), once for both
workloads: the batch on all 3 ranks, then the 2-process checks on ranks 0 and 1 (a new world of 2).

`batch`: a batch of prompts of different lengths under TP, each row against HF greedy of that prompt
alone, with the cost budget (rank 0's curve and sizes).

`shard` (2 processes): each rank shards tiny models and checks against the same model unsharded, in
the same process: logits of a prefill, a one-token decode step and a tree verification (allclose:
rtol 1e-5, atol 1e-5), for the plain and the laddered model; then speculative greedy decoding under TP
token for token (every step's accepted path is compared across ranks inside the program) against HF
greedy for the plain model and single-process one-node greedy for the laddered one (HF cannot run
it). Prints one OK line per check. (The default model over 3 processes: the README's torchrun
command, in the test file.)

A workload that fails prints its traceback (`rank R batch failed:`) and the other still runs: each test
reads its own workload's lines (a rank exiting non-zero would make torchrun stop the others). A
collective that some ranks never reach fails after 3 minutes instead of hanging.
"""

from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist

import specpass
from specpass.drafters import DraftTree
from specpass.ir import SlotLayout, capture
from specpass.rewrites import LadderResidual, TensorParallel, TreeAttention
from specpass.research.tiny_models import tiny_model

TIMEOUT = datetime.timedelta(minutes=3)


def _steps(gm) -> list[torch.Tensor]:
    """Logits of a 20-token prefill, a one-token step and a 5-node tree, in that order."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    run = lambda ids, layout: gm(**{k: v for k, v in layout.step_inputs(ids).items() if k in names})[0]  # noqa: E731
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    return [run(prompt, SlotLayout.chain(0, 20)), run(torch.tensor([[11]]), SlotLayout.chain(20, 1)),
            run(torch.from_numpy(tree.tokens)[None], SlotLayout.tree(21, tree.ancestor_mask()))]  # fmt: skip


@torch.no_grad()
def check(model, ladder: LadderResidual, name: str, new_tokens: int, prompts: list[torch.Tensor], atol: float) -> None:
    rank = dist.get_rank()
    single, _ = specpass.Pipeline(TreeAttention(16), ladder).run(capture(model, cache_size=96))
    sharded, _ = specpass.Pipeline(TreeAttention(16), ladder, TensorParallel()).run(capture(model, cache_size=96))
    worst = 0.0
    for expected, got in zip(_steps(single), _steps(sharded)):  # prefill, decode, tree
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)
        worst = max(worst, float((got - expected).abs().max()))
    print(f"rank {rank} {name} {ladder}: prefill, decode and tree logits equal unsharded "
          f"(max |diff| {worst:.1e})", flush=True)  # fmt: skip
    one_node = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1), ladder)}
    tp = {"pipeline": specpass.Pipeline(TreeAttention(16), ladder, TensorParallel()), "budget": "cost"}
    reference = "one-node greedy" if ladder.layers else "HF greedy"  # HF cannot run a laddered model
    for ids in prompts:
        if ladder.layers:
            expected = specpass.generate(model, ids, new_tokens, options=one_node).sequences
        else:
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)  # fmt: skip
        out = specpass.generate(model, ids, new_tokens, options=tp)
        assert torch.equal(out.sequences, expected), (name, ladder, out.sequences, expected)
    print(f"rank {rank} {name} {ladder}: speculative greedy under TP equals {reference} "
          f"({len(prompts)} prompts, tau {out.stats.tau:.2f})", flush=True)  # fmt: skip


def refusals() -> None:
    """Where the pass must not apply, with W = 2: the reason, and the graph unchanged."""
    import transformers

    from specpass.common.errors import PassMismatchError

    three_kv = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3)).eval()  # fmt: skip
    cases = {"3 KV heads do not split over 2 processes": three_kv,
             "fused projections (layers.0.self_attn.qkv_proj": tiny_model("phi3"),
             "normalises the whole projection": tiny_model("olmo2")}  # fmt: skip
    for reason, model in cases.items():
        gm = capture(model, cache_size=32)
        source = gm.graph.python_code("self").src
        try:
            specpass.Pipeline(TensorParallel()).run(gm)
        except PassMismatchError as exc:
            assert reason in str(exc), (reason, str(exc))
        else:
            raise AssertionError(f"TensorParallel applied where it must not: {reason}")
        assert gm.graph.python_code("self").src == source
    print(f"rank {dist.get_rank()} refusals: {len(cases)} refused with their reasons, graphs unchanged", flush=True)


@torch.no_grad()
def batch() -> None:
    """Rows sharded like one sequence: a llama of 6 heads, 3 KV heads (a third on each of 3 ranks)."""
    import transformers

    from specpass.drafters import PromptLookup

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=256)).eval()  # fmt: skip
    model.lm_head.weight.mul_(8.0)  # a peaked next-token law: prompt lookup gets multi-token steps
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (n,), generator=gen) for n in (5, 11, 8)]
    prompts[1] = prompts[1].repeat(2)  # a repetitive row
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    expected = [model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=24,
                               do_sample=False)[0, len(p) :].tolist() for p in prompts]  # fmt: skip
    # the cost budget: rank 0's timings and tree sizes on every rank
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), TensorParallel()), "drafter": PromptLookup(),
               "lowering": "eager"}  # fmt: skip
    out = specpass.generate(model, ids, 24, attention_mask=mask, eos_token_id=[], options=options)
    assert [list(t) for t in out.new_tokens] == expected, (out.new_tokens, expected)
    tau = max(s.tau for s in out.stats)
    print(f"rank {dist.get_rank()} batch of {len(prompts)} rows, budget cost: every row equals HF greedy "
          f"alone (largest tau {tau:.2f})", flush=True)  # fmt: skip


def shard() -> None:
    """The 2-process checks: the refusals, then three families plain and laddered."""
    refusals()
    for arch in ("llama", "qwen2", "mistral"):
        model = tiny_model(arch)
        cases = [torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(s)) for s in (4, 5)]
        for ladder in (LadderResidual(), LadderResidual((0, 1)), LadderResidual((1,))):
            check(model, ladder, arch, 30, cases, atol=1e-5)


def _run(workload) -> bool:
    """Run one workload; on an error print it (the tests read the output) and go on."""
    try:
        workload()
        return True
    except Exception:
        print(f"rank {dist.get_rank()} {workload.__name__} failed:\n{traceback.format_exc()}", flush=True)
        return False


def _two_of_three() -> bool:
    """Leave the world of 3 for a world of ranks 0 and 1 (a fresh store that rank 0 hosts); True on those."""
    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    if rank > 1:
        return False
    store = store or dist.TCPStore("127.0.0.1", port[0], 2, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    return True


def main() -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    torch.set_num_threads(1)
    _run(batch)
    if _two_of_three():
        _run(shard)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
