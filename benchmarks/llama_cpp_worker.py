"""llama.cpp in a process of its own, for benchmarks/gguf_cpu.py: its OpenMP threads and torch's never share
the cores, and it never runs inside the torch process (an 11-26 run that did so halved HF's speed).

    python benchmarks/llama_cpp_worker.py GGUF_PATH THREADS [--no-extra-buffers]

--no-extra-buffers loads the weights without llama.cpp's extra buffer types (its AMX and repacked layouts):
on a 2-core Intel Xeon with AMX (2026-12-05, llama-cpp-python 0.3.36) every decode with them segfaulted,
and for Q4_1 AMX is the only one that applies (ggml's repack takes Q4_0 / Q4_K / IQ4_NL / Q8_0).

Reads one JSON request a line on stdin: {"ids": [...], "max_new_tokens": N, "eos": [...], "draft_tokens": K}
(K = 0: plain decoding; else llama-cpp-python's prompt-lookup drafter proposing K tokens);
writes one JSON line a request: {"new": [...], "seconds", "first_token_seconds", "decode_ms_per_token",
"decoded_tokens"} where the last two are llama.cpp's own eval timing (llama_perf_context: decode
evaluations only, prefill excluded). Greedy: temp 0, top_k 1, no repeat penalty. Imports no torch.
"""

from __future__ import annotations

import json
import sys
import time


DRAFT_TOKENS = (0, 10, 2)  # plain; prompt lookup as llama-cpp-python's default (10); and 2, as its docs advise on CPUs


def _models(path: str, threads: int, extra_buffers: bool) -> dict:
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if not extra_buffers:  # Llama() takes no such argument; it reads the bindings' default model params
        default_params = bindings.llama_model_default_params

        def without_extra_buffers():
            params = default_params()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers

    def make(draft_tokens: int):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens) if draft_tokens else None
        # n_batch = n_ctx: with a drafter llama-cpp-python keeps logits for every evaluated token in n_batch
        # rows, and a prompt past n_batch tokens overflowed them (ValueError in Llama.eval)
        return Llama(model_path=path, n_ctx=4096, n_batch=4096, n_threads=threads, n_threads_batch=threads,
                     draft_model=draft, verbose=False, seed=0)  # fmt: skip

    return {k: make(k) for k in DRAFT_TOKENS}


def generate(llm, ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
    import llama_cpp

    llm.reset()  # no reuse of an earlier prompt's cache
    llama_cpp.llama_perf_context_reset(llm.ctx)
    new: list[int] = []
    started = time.perf_counter()
    first = None
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        new.append(token)  # an EOS too, as HF's and specpass's outputs hold it (and count it)
        if token in eos or len(new) == max_new_tokens:
            break
    seconds = time.perf_counter() - started
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {"new": new, "seconds": seconds, "first_token_seconds": (first or started) - started,
            "decoded_tokens": perf.n_eval, "decode_ms_per_token": perf.t_eval_ms / max(perf.n_eval, 1)}  # fmt: skip


def main() -> int:
    import llama_cpp

    path, threads = sys.argv[1], int(sys.argv[2])
    extra_buffers = "--no-extra-buffers" not in sys.argv[3:]
    models = _models(path, threads, extra_buffers)
    print(json.dumps({"ready": True, "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                      "version": llama_cpp.__version__, "extra_buffers": extra_buffers}), flush=True)  # fmt: skip
    for line in sys.stdin:
        request = json.loads(line)
        llm = models[int(request.get("draft_tokens", 0))]
        result = generate(llm, request["ids"], request["max_new_tokens"], set(request["eos"]))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
