"""TensorParallel (rewrites.tensor_parallel): the sharded graph's structure in-process (a one-rank gloo
group), and sharded numerics and speculative decoding across processes (`torchrun`, tests/tp_worker.py)."""

import json
import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_model

import specpass
from specpass.common.errors import PassMismatchError
from specpass.ir import capture
from specpass.ir.roles import info
from specpass.rewrites import LadderResidual, TensorParallel, TreeAttention
from specpass.rewrites.tensor_parallel import collective_nodes, sum_gathers

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")
_ops = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def worker_output() -> str:
    """The worker's output from one torchrun launch of 3 processes (gloo, CPU) for both workloads: the
    3-process batch, then the 2-process checks on ranks 0 and 1. A failing workload prints its traceback
    and the other still runs, so each test below fails on its own lines only."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
               "--master-port", str(_free_port()), WORKER]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    return done.stdout + done.stderr


def _expect(output: str, lines: list[str]) -> None:
    for line in lines:
        assert line in output, output[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    """A gloo group of one process: the pass shards into one shard, with every collective in place."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_two_processes_shard_tiny_llama_qwen2_mistral_plain_and_laddered(worker_output):
    for rank in (0, 1):
        _expect(worker_output, [f"rank {rank} refusals: 3 refused with their reasons, graphs unchanged"])
        for arch in ("llama", "qwen2", "mistral"):
            for ladder in ("()", "(0, 1)", "(1,)"):
                prefix = f"rank {rank} {arch} LadderResidual(layers={ladder}):"
                reference = "HF greedy" if ladder == "()" else "one-node greedy"
                _expect(worker_output, [f"{prefix} prefill, decode and tree logits equal unsharded",
                                        f"{prefix} speculative greedy under TP equals {reference}"])  # fmt: skip
    assert "rank 2 refusals" not in worker_output  # a world of two: rank 2 left after the batch


def test_three_processes_shard_a_batch_whose_every_row_equals_hf_greedy_alone(worker_output):
    _expect(worker_output, [f"rank {rank} batch of 3 rows, budget cost: every row equals HF greedy alone"
                            for rank in (0, 1, 2)])  # fmt: skip


def _readme_torchrun_command() -> list[str]:
    """The README's torchrun command, as arguments after `specpass` (its line continuations joined)."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M) if "torchrun" in b)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:5] == ["torchrun", "--nproc-per-node", "3", "--no-python", "specpass"], words
    return words[5:]


def test_the_readme_torchrun_command_without_its_ladder_equals_hf_greedy(default_model):
    """The README's command, run as written over 3 gloo processes (SmolLM2-135M: 9 heads, 3 KV heads)
    but without the lossy LadderResidual (and 16 tokens): rank 0 prints that the output equals HF
    greedy. The processes read the model from the conversion cache the fixture's load filled."""
    args = _readme_torchrun_command()
    at = args.index("--pipeline") + 1
    pipeline = json.loads(args[at])
    assert [p["pass"] for p in pipeline["passes"]] == ["TreeAttention", "LadderResidual", "TensorParallel"]
    pipeline["passes"] = [p for p in pipeline["passes"] if p["pass"] != "LadderResidual"]
    args[at] = json.dumps(pipeline)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
               str(_free_port()), "-m", "specpass.cli", *args, "--max-new-tokens", "16"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("identical to greedy: True") == 1  # rank 0, against HF greedy (no lossy pass)


def _order(graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _waits(graph) -> list:
    return collective_nodes(graph, _ops.wait_tensor.default)


def test_a_sharded_step_has_two_all_reduces_a_layer_and_laddered_waits_come_after_the_next_compute(one_rank_group):
    model = tiny_model("llama")
    for ladder, laddered in ((LadderResidual(), set()), (LadderResidual((1,)), {1})):
        pipeline = specpass.Pipeline(TreeAttention(8), ladder, TensorParallel())
        gm, report = pipeline.run(capture(model, cache_size=64))
        reduces = sum_gathers(gm.graph)  # each an all-gather, its wait and the sum in rank order
        assert [info(r).layer for r in reduces] == [0, 0, 1, 1]  # attention and MLP of each layer
        assert not collective_nodes(gm.graph, _ops.all_reduce.default)  # gloo's ring sums in an order set by the size
        assert len(collective_nodes(gm.graph, _ops.all_gather_into_tensor.default)) == 5  # and the logits
        order = _order(gm.graph)
        for reduce, following in zip(reduces, reduces[1:]):
            wait = next(iter(reduce.users))
            next_compute = following.args[0]  # the next sub-layer's row-parallel output
            delayed = order[wait] > order[following]
            # a wait moves past the next sub-layer's compute and all-reduce iff that sub-layer is laddered
            assert delayed == (info(following).layer in laddered)
            assert order[next_compute] < order[following]
        assert "rank 0 of 1: 4 all-reduces (gathered, summed in rank order)" in str(report)
        # the sharded step still computes the same function (one shard: the whole model)
        reference, _ = specpass.Pipeline(TreeAttention(8), ladder).run(capture(model, cache_size=64))
        ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
        inputs = specpass.ir.SlotLayout.chain(0, 12).step_inputs(ids)
        torch.testing.assert_close(gm(**inputs)[0], reference(**inputs)[0], rtol=1e-5, atol=1e-5)


def test_the_pass_refuses_without_a_process_group_twice_and_with_a_draft_graph(one_rank_group):
    model = tiny_model("llama")
    sharded, _ = specpass.Pipeline(TensorParallel()).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="already sharded"):
        specpass.Pipeline(TensorParallel()).run(sharded)
    exited, _ = specpass.Pipeline(TreeAttention(8), specpass.rewrites.EarlyExit(1)).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="draft graph"):
        specpass.Pipeline(TensorParallel()).run(exited)
    dist.destroy_process_group()
    try:
        with pytest.raises(PassMismatchError, match="torch.distributed is not initialised"):
            specpass.Pipeline(TensorParallel()).run(capture(model, cache_size=64))
    finally:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def test_the_cli_generates_under_torchrun_and_refuses_without_it(tmp_path, capsys):
    from conftest import char_tokenizer

    from specpass.cli import main

    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "model")
    char_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "model")
    pipeline = specpass.Pipeline(TreeAttention(16), LadderResidual((1,)), TensorParallel()).to_json()
    args = ["generate", "--model", str(tmp_path / "model"), "--prompt", "the cat sat on the mat", "--raw",
            "--max-new-tokens", "16", "--pipeline", pipeline]  # fmt: skip
    assert main(args) == 2  # not under torchrun: one line, before the model loads
    assert "launch with `torchrun --nproc-per-node N --no-python specpass generate" in capsys.readouterr().err
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "specpass.cli", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.count("identical to greedy: True") == 1  # rank 0 prints, against the laddered model's greedy
    assert done.stdout.count("note: the output differs from the original model's: LadderResidual") == 1
