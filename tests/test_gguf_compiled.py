"""The gguf step compiled whole ahead of time (`lowering="gguf-compiled"`, backends.lowering.aot_compiled):
the same function as the gguf step run op by op, on a tiny model's GGUF blocks
(tests/gguf_compiled_worker.py), writing the program's own cache; its package loaded by a second
process, named by the weights it holds; refused, with the reason, where no C++ compiler exists."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import needs_cxx, needs_int4_kernel, tiny_model
from gguf_compiled_worker import quantized_tiny_step
from test_lowering import _run_prefix_and_tree

import specpass
from specpass.backends.lowering import aot_compiled
from specpass.backends.lowering.aot_compiled import package_key
from specpass.backends.lowering.gguf import gguf_linear
from specpass.backends.lowering.registry import LOWERINGS, resolve_lowering
from specpass.common.errors import InvalidParameterError
from specpass.ir import capture

NO_COMPILER = (None, "no-such-c++-compiler")  # torch._inductor.config.cpp.cxx naming no compiler
WORKER = os.path.join(os.path.dirname(__file__), "gguf_compiled_worker.py")


@needs_cxx
@needs_int4_kernel
def test_compiled_gguf_step_equals_the_gguf_step_op_by_op(monkeypatch, tmp_path):
    """Prefill, then a tree over the prefix (one package for both sizes): the compiled step's logits and
    the K/V it writes into the program's cache buffers equal the op-by-op step's up to bfloat16 rounding
    (both round the GEMMs' activations to bfloat16; fused work around them may round one activation the
    other way), and every token's argmax is the same."""
    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path))
    gm, ctx = quantized_tiny_step()
    op_by_op = LOWERINGS["gguf"].build(gm, ctx)
    expected = _run_prefix_and_tree(op_by_op)
    expected_k, expected_v = gm.k_cache.clone(), gm.v_cache.clone()
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    compiled = LOWERINGS["gguf-compiled"].build(gm, ctx)
    assert compiled.lowering == "gguf-compiled"
    linears = [n for n in compiled.gm.graph.nodes if n.target is gguf_linear]
    assert len(linears) == len([n for n in op_by_op.gm.graph.nodes if n.target is gguf_linear]) == 2 * 7 + 1
    got = _run_prefix_and_tree(compiled)
    assert compiled.built_here and os.path.dirname(compiled.package_path) == str(tmp_path / "compiled")
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(gm.k_cache, expected_k, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(gm.v_cache, expected_v, rtol=2**-7, atol=2**-7)
    assert float(gm.k_cache[:, :, :, 30:35].abs().sum()) > 0  # the tree's K/V were written, in place

    from torch._inductor import config

    with config.patch({"cpp.cxx": NO_COMPILER}):  # loading a package needs none
        loaded = LOWERINGS["gguf-compiled"].build(gm, ctx)
        torch.testing.assert_close(_run_prefix_and_tree(loaded), got, rtol=0, atol=0)
    assert loaded.built_here is False and loaded.package_path == compiled.package_path
    with open(compiled.package_path, "r+b") as f:  # a package cut short (a full disk, a killed copy)
        f.truncate(os.path.getsize(compiled.package_path) // 2)
    again = LOWERINGS["gguf-compiled"].build(gm, ctx)
    with pytest.warns(UserWarning, match="is damaged .*compiling it again"):
        torch.testing.assert_close(_run_prefix_and_tree(again), got, rtol=0, atol=0)
    assert again.built_here is True and again.package_path == compiled.package_path


@needs_cxx
@needs_int4_kernel
def test_a_second_process_loads_the_package(tmp_path):
    """The first process compiles the package into $SPECPASS_CACHE; a fresh one loads it (nothing
    compiled) and computes the same logits."""
    env = {**os.environ, "SPECPASS_CACHE": str(tmp_path)}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["built_here"] is True and second["built_here"] is False
    assert first["package"] == second["package"] and os.path.exists(first["package"])
    assert second["logits"] == first["logits"]


def test_the_package_is_named_by_the_weights_it_holds(monkeypatch):
    """Equal steps share a package; a weight changed by one ulp, another cache size or another CPU's
    instruction-set extensions get another (the package bakes the weights in, its code is the CPU's); the KV
    caches' content does not count."""
    gm, _ = quantized_tiny_step()
    other, _ = quantized_tiny_step()
    assert package_key(gm) == package_key(other)
    other.k_cache.fill_(1.0)
    assert package_key(gm) == package_key(other)
    weight = other.get_submodule("layers.1.mlp.down_proj").weight
    with torch.no_grad():
        weight[3, 7] = torch.nextafter(weight[3, 7], torch.tensor(1.0))
    assert package_key(gm) != package_key(other)
    resized, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(tiny_model("llama"), cache_size=64))
    plain, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(tiny_model("llama"), cache_size=128))
    assert package_key(resized) != package_key(plain)
    same = package_key(gm)
    features = aot_compiled.cpu_features().split("|")[1].split()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):  # what -march=native may use
        assert ("avx2" in features) == torch.cpu._is_avx2_supported()
        assert ("avx512f" in features) == torch.cpu._is_avx512_supported()
    monkeypatch.setattr(aot_compiled, "cpu_features", lambda: "another machine|another vector ISA")
    assert package_key(gm) != same


@needs_int4_kernel
def test_compiled_lowerings_are_refused_without_a_cpp_compiler(monkeypatch, tmp_path):
    """Where the package is not compiled yet (an empty cache folder)."""
    from torch._inductor import config

    monkeypatch.setenv("SPECPASS_CACHE", str(tmp_path))
    gm, ctx = quantized_tiny_step()
    for name in ("gguf-compiled", "inductor"):
        with config.patch({"cpp.cxx": NO_COMPILER}), pytest.raises(InvalidParameterError, match=rf"lowering '{name}' compiles the step to C\+\+ .* needs a C\+\+ compiler"):
            LOWERINGS[name].build(gm, ctx)


def test_gguf_compiled_runs_alone_and_not_in_batches():
    cpu = torch.device("cpu")
    assert resolve_lowering("gguf-compiled", cpu, torch.float32) == "gguf-compiled"  # no float32 step beside it
    assert LOWERINGS["gguf-compiled"].reads_gguf and not LOWERINGS["gguf-compiled"].batches


def test_only_the_most_recently_used_packages_are_kept(tmp_path):
    """Each weight file, cache size or torch version leaves a package of its own (hundreds of MB):
    compiling a new one drops all but the KEPT_PACKAGES most recently used of that lowering, and
    never another lowering's package or a package being written."""
    names = [f"gguf-compiled-{index}.pt2" for index in range(6)]
    others = ["inductor-0.pt2", "gguf-compiled-9.123.partial.pt2"]
    for age, name in enumerate(reversed(names + others)):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (1000.0 * (1 + age), 1000.0 * (1 + age)))  # names[0] the newest
    dropped = aot_compiled.drop_old_packages(str(tmp_path), "gguf-compiled", keep=4)
    assert sorted(os.path.basename(p) for p in dropped) == names[4:]
    assert sorted(os.listdir(tmp_path)) == sorted(names[:4] + others)
