"""The gguf step compiled whole by inductor (`lowering="gguf-compiled"`): the same function as the gguf
step run op by op, on a tiny model's GGUF blocks (tests/gguf_compiled_worker.py); its compile reused by
a second process; refused, with the reason, where no C++ compiler exists."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import needs_cxx
from gguf_compiled_worker import quantized_tiny_step
from test_lowering import _run_prefix_and_tree

from specpass.backends.lowering.gguf import available, gguf_linear
from specpass.backends.lowering.registry import LOWERINGS, resolve_lowering
from specpass.errors import InvalidParameterError

needs_kernel = pytest.mark.skipif(
    not available(torch.device("cpu"), torch.float32), reason="this torch build has no int4 CPU kernel"
)
WORKER = os.path.join(os.path.dirname(__file__), "gguf_compiled_worker.py")


@needs_cxx
@needs_kernel
def test_compiled_gguf_step_equals_the_gguf_step_op_by_op():
    """Prefill, then a tree over the prefix: the compiled step's logits and the K/V it writes equal the
    op-by-op step's up to bfloat16 rounding (both round the GEMMs' activations to bfloat16; fused work
    around them may round one activation the other way), and every token's argmax is the same."""
    gm, ctx = quantized_tiny_step()
    op_by_op = LOWERINGS["gguf"].build(gm, ctx)
    expected = _run_prefix_and_tree(op_by_op)
    expected_k, expected_v = gm.k_cache.clone(), gm.v_cache.clone()
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    compiled = LOWERINGS["gguf-compiled"].build(gm, ctx)
    assert compiled.kinds == ("gguf-compiled",)
    linears = [n for n in compiled.gm.graph.nodes if n.target is gguf_linear]
    assert len(linears) == len([n for n in op_by_op.gm.graph.nodes if n.target is gguf_linear]) == 2 * 7 + 1
    got = _run_prefix_and_tree(compiled)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(gm.k_cache, expected_k, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(gm.v_cache, expected_v, rtol=2**-7, atol=2**-7)
    assert float(gm.k_cache[:, :, :, 30:35].abs().sum()) > 0  # the tree's K/V were written, in place


@needs_cxx
@needs_kernel
def test_a_second_process_reuses_the_compile(tmp_path):
    """Inductor's cache on disk: a fresh process compiling the same step reads every compiled graph
    back (cache hits, no miss) and computes the same logits."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["misses"] >= 1 and first["hits"] == 0
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert second["logits"] == first["logits"]


def test_compiled_lowerings_are_refused_without_a_cpp_compiler(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", (None, "no-such-c++-compiler"))
    gm, ctx = quantized_tiny_step()
    for name in ("gguf-compiled", "inductor"):
        with pytest.raises(InvalidParameterError, match=rf"lowering '{name}' compiles the step to C\+\+ .* needs a C\+\+ compiler"):
            LOWERINGS[name].build(gm, ctx)


def test_gguf_compiled_runs_beside_float32_and_not_in_batches():
    cpu = torch.device("cpu")
    assert resolve_lowering("gguf-compiled", cpu, torch.float32)[-1] == "gguf-compiled"
    assert LOWERINGS["gguf-compiled"].reads_gguf and not LOWERINGS["gguf-compiled"].batches
