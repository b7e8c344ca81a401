"""Issue 54 item 1 probe: the default model's rewritten step (TreeAttention(64)) compiled by inductor on
the CPU, with freezing and the C++ wrapper, against the eager and oneDNN steps: milliseconds a
forward of T = 1 and T = 16 tokens after 256 committed slots (median of 20 after 3 warm-ups), the
first call's seconds (the compile), and a logits checksum (the same inputs in every variant).

    python benchmarks/inductor_cpu_probe.py VARIANT    # eager | onednn | inductor | inductor_freezing |
                                                      # inductor_freezing_cpp | inductor_static_freezing_cpp

Prints one JSON line. A probe, not a lowering: the inductor variants replace InductorStep's compile
call for this process only (torch.compile options), the product's `lowering="inductor"` is unchanged.
"""
import json, sys, time
import torch
import specpass
from specpass.ir import SlotLayout
from specpass.backends.lowering import inductor as ind
from specpass.backends.lowering.eager import EagerStep

variant = sys.argv[1]
VARIANTS = {
    "inductor": dict(dynamic=True, options={}),
    "inductor_freezing": dict(dynamic=True, options={"freezing": True}),
    "inductor_freezing_cpp": dict(dynamic=True, options={"freezing": True, "cpp_wrapper": True}),
    "inductor_static_freezing_cpp": dict(dynamic=False, options={"freezing": True, "cpp_wrapper": True}),
}
if variant in VARIANTS:
    cfg = VARIANTS[variant]
    def init(self, gm):
        EagerStep.__init__(self, ind.inplace_cache_writes(gm), kind="inductor")
        self.compiled = torch.compile(self.gm, fullgraph=True, dynamic=cfg["dynamic"], options=cfg["options"])
    ind.InductorStep.__init__ = init
lowering = "inductor" if variant.startswith("inductor") else variant
torch.manual_seed(0)
model, _ = specpass.load_default_model()
program = specpass.compile_program(model, {"lowering": lowering, "budget": 64})
out = {"variant": variant, "threads": torch.get_num_threads()}
with torch.no_grad():
    for t in (1, 16):
        tokens = torch.arange(1, t + 1)
        layout = SlotLayout.chain(256, t)
        started = time.perf_counter()
        first, _ = program.measured_forward(tokens, layout)
        out[f"first_call_s_T{t}"] = round(time.perf_counter() - started, 1)
        times = []
        for _ in range(23):
            s = time.perf_counter(); program.measured_forward(tokens, layout); times.append(time.perf_counter() - s)
        out[f"ms_T{t}"] = round(1e3 * sorted(times[3:])[10], 2)
        out[f"logits_T{t}_checksum"] = float(first.double().abs().sum())
print(json.dumps(out), flush=True)
