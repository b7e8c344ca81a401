"""Issue 54 probe: the default model's gguf step (int4 blocks) compiled whole by inductor on the CPU,
against the same step run op by op: milliseconds a forward of T = 1, 4 and 16 tokens after 256
committed slots (median of 30 or 10 after 3 warm-ups), the first calls' seconds (the compiles: T = 1
has its own with dynamic shapes), and the logits of four consecutive cache-writing one-token steps
against the op-by-op step's (max difference, same argmax).

    python benchmarks/gguf_compile_probe.py VARIANT [STEP]
    # VARIANT: none | freezing_cpp | dynamic | dynamic_freezing | dynamic_cpp | dynamic_freezing_cpp
    # STEP: gguf (default) | onednn (the float32 step; each oneDNN linear wrapped in a custom op, an
    #       extern call to inductor, whose own lowering of that op takes only frozen constants)

Prints one JSON line. A probe of `torch.compile`, not the lowering: `lowering="gguf-compiled"` compiles
with AOTInductor instead (backends/lowering/aot_compiled.py; why: docs/experiments.md, "A compiled gguf
step"). The compiled graph is swapped into this process's program only; static variants compile again
for each attended length.
"""
import json, sys, time, torch
import specpass
from specpass.ir import SlotLayout
from specpass.backends.lowering.inductor import dense_row_major, inplace_cache_writes

variant = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "gguf"  # or onednn: the float32 step on oneDNN-packed linears
VARIANTS = {  # (dynamic shapes, inductor options)
    "none": (False, {}), "freezing_cpp": (False, {"freezing": True, "cpp_wrapper": True}),
    "dynamic": (True, {}), "dynamic_freezing": (True, {"freezing": True}),
    "dynamic_freezing_cpp": (True, {"freezing": True, "cpp_wrapper": True}), "dynamic_cpp": (True, {"cpp_wrapper": True}),
}
dynamic, options = VARIANTS[variant]


@torch.library.custom_op("specpass_probe::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias, n):
    return x.new_empty(*x.shape[:-1], n)


def opaque_onednn_linears(gm):
    """The oneDNN linears of `gm` as `specpass_probe::onednn_linear` calls (in place)."""
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.mkldnn._linear_pointwise:
            x, weight, bias = node.args[:3]
            with gm.graph.inserting_before(node):
                call = gm.graph.call_function(torch.ops.specpass_probe.onednn_linear,
                                              (x, weight, bias, getattr(gm, weight.target).shape[0]))
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm

torch.manual_seed(0)
model, _ = specpass.load_default_model()
program = specpass.compile_program(model, {"lowering": "gguf", "budget": 1})  # onednn for T where faster, gguf
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
    gm = opaque_onednn_linears(inplace_cache_writes(run.gm))
    compiled = torch.compile(gm, fullgraph=True, dynamic=dynamic, options=options)
    run.run_graph = lambda inputs: compiled(**{name: dense_row_major(inputs[name]) for name in run.input_names})
    started = time.perf_counter()
    program.measured_forward(torch.tensor([1]), SlotLayout.chain(256, 1))
    compile_s = round(time.perf_counter() - started, 1)
    compiled_ms, _ = time_step()
    again = sequence_logits()
    started = time.perf_counter()
    program.measured_forward(torch.arange(1, 5), SlotLayout.chain(256, 4))
    compile_tree_s = round(time.perf_counter() - started, 1)
    tree_ms = {t: time_step(t, n=10)[0] for t in (4, 16)}
print(json.dumps({"variant": variant, "step": kind, "op_by_op_ms_T1": eager_ms, "compiled_ms_T1": compiled_ms, "compile_s": compile_s,
                  "op_by_op_ms_T4_T16": eager_tree_ms, "compiled_ms_T4_T16": tree_ms, "first_T4_call_s": compile_tree_s,
                  "max_abs_logit_diff_4_steps": float((again - reference).abs().max()),
                  "same_argmax": bool(torch.equal(again.argmax(-1), reference.argmax(-1)))}), flush=True)
