"""Issue 54 probe: the default model's gguf step (int4 blocks, one token a step) compiled whole by
inductor on the CPU, against the same step run op by op: milliseconds a one-token forward after 256
committed slots (median of 30 after 3 warm-ups), the first call's seconds (the compile), and the
logits of four consecutive cache-writing steps against the op-by-op step's (max difference, same argmax).

    python benchmarks/gguf_compile_probe.py VARIANT    # none | freezing_cpp (freezing + the C++ wrapper)

Prints one JSON line. A probe, not a lowering: static shapes (each attended length compiles again, so
the four-step check recompiles), the compiled graph swapped into this process's program only.
"""
import json, sys, time, torch
import specpass
from specpass.ir import SlotLayout
from specpass.backends.lowering.inductor import inplace_cache_writes, _plain

variant = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "gguf"  # or onednn: the float32 step on oneDNN-packed linears
VARIANTS = {  # (dynamic shapes, inductor options)
    "none": (False, {}), "freezing_cpp": (False, {"freezing": True, "cpp_wrapper": True}),
    "dynamic": (True, {}), "dynamic_freezing": (True, {"freezing": True}),
    "dynamic_freezing_cpp": (True, {"freezing": True, "cpp_wrapper": True}), "dynamic_cpp": (True, {"cpp_wrapper": True}),
}
dynamic, options = VARIANTS[variant]
torch.manual_seed(0)
model, _ = specpass.load_default_model()
program = specpass.compile_program(model, {"lowering": "gguf", "budget": 1})
outer = program.step.run
print(type(outer).__name__, outer.kinds, outer.default, flush=True)
run = outer.steps[kind]  # every call on this step (outer.pinned below)

def time_step(t=1, n=30):
    tokens, layout = torch.arange(1, t + 1), SlotLayout.chain(256, t)
    times = []
    for _ in range(n + 3):
        s = time.perf_counter(); out = program.measured_forward(tokens, layout); times.append(time.perf_counter() - s)
    return round(1e3 * sorted(times[3:])[n // 2], 2), out[0]

def sequence_logits(steps=4):
    """Logits of 4 consecutive one-token steps writing the cache (slots 256..259)."""
    outs = []
    for i in range(steps):
        outs.append(program.measured_forward(torch.tensor([5 + i]), SlotLayout.chain(256 + i, 1))[0].clone())
    return torch.stack(outs)

with torch.no_grad(), outer.pinned(kind):
    eager_ms, _ = time_step()
    eager_tree_ms = {t: time_step(t, n=10)[0] for t in (4, 16)}
    reference = sequence_logits()
    gm = inplace_cache_writes(run.gm)
    compiled = torch.compile(gm, fullgraph=True, dynamic=dynamic, options=options)
    run.run_graph = lambda inputs: compiled(**{name: _plain(inputs[name]) for name in run.input_names})
    started = time.perf_counter()
    program.measured_forward(torch.tensor([1]), SlotLayout.chain(256, 1))
    compile_s = round(time.perf_counter() - started, 1)
    compiled_ms, _ = time_step()
    again = sequence_logits()
    started = time.perf_counter()
    program.measured_forward(torch.arange(1, 5), SlotLayout.chain(256, 4))
    compile_tree_s = round(time.perf_counter() - started, 1)
    tree_ms = {t: time_step(t, n=10)[0] for t in (4, 16)}
print(json.dumps({"variant": variant, "step": kind, "eager_gguf_ms_T1": eager_ms, "compiled_ms_T1": compiled_ms, "compile_s": compile_s,
                  "eager_gguf_ms_T4_T16": eager_tree_ms, "compiled_ms_T4_T16": tree_ms, "first_T4_call_s": compile_tree_s,
                  "max_abs_logit_diff_4_steps": float((again - reference).abs().max()),
                  "same_argmax": bool(torch.equal(again.argmax(-1), reference.argmax(-1)))}), flush=True)
