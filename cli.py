"""The `specpass` command: `generate` (speculative vs plain greedy on one prompt), `export`, `train-heads`, `bench`,
`eval-kv`, `train-retention`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .drafters.registry import DRAFTER_NAMES


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, `specpass: error: ...`, like every other CLI failure."""

    def error(self, message: str):
        self.exit(2, f"specpass: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _pipeline(text: str | None):
    """The --pipeline given (JSON or a file holding it), or None: the default, fitted to the model
    once it is loaded (backends.options.default_pipeline)."""
    from .passes import Pipeline

    if text is None:
        return None
    if os.path.exists(text):
        with open(text) as f:
            text = f.read()
    return Pipeline.from_json(text)


def _encode(tokenizer, prompt: str, raw: bool):
    from .common.errors import InvalidParameterError
    from .research.prompts import encode_chat, encode_code

    ids = encode_code(tokenizer, prompt) if raw else encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    if ids.shape[1] == 0:
        raise InvalidParameterError("the prompt is empty")
    return ids


def _pytorch_runs(args: argparse.Namespace):
    """(tokenizer, plain greedy run, speculative run) on PyTorch: HF greedy beside specpass."""
    import torch

    from .api import compile_program, generate
    from .backends.options import CompileOptions, default_pipeline
    from .common.errors import InvalidParameterError
    from .drafters.registry import drafter_by_name
    from .models import load_model
    from .passes import Pipeline
    from .ir import arch_spec
    from .rewrites import DraftHeads, FeatureDraft, TensorParallel, TreeAttention

    pipeline = _pipeline(args.pipeline)  # a bad pipeline is refused before the model loads
    if pipeline is not None and pipeline.has(TensorParallel):
        _join_torchrun()
    model, tokenizer, _ = load_model(args.model)
    if tokenizer is None:
        raise InvalidParameterError(f"{args.model} holds no tokenizer files; generate needs them to encode --prompt")
    pipeline = pipeline if pipeline is not None else default_pipeline(arch_spec(model))
    if args.heads == "feature":
        pipeline = Pipeline(*pipeline, FeatureDraft(draft=args.heads_dir or "default"))
    elif args.heads is not None:
        pipeline = Pipeline(*pipeline, DraftHeads(design=args.heads, heads=args.heads_dir or "default"))
    options = {"pipeline": pipeline, "drafter": drafter_by_name(args.drafter)}
    compiled = torch.compile(model, backend="specpass", options=options)
    compile_program(compiled)  # capture, rewrite, lower and measure the cost curve up front
    sampling = _sampling(args)
    lossy = _lossy_passes(pipeline)
    one_node = CompileOptions(budget=1, pipeline=Pipeline(TreeAttention(1), *lossy))
    # HF samples with other noise, and knows no lossy rewrite: then the reference is specpass's one-node trees
    own_reference = sampling["do_sample"] or bool(lossy)
    if own_reference:
        compile_program(model, one_node)  # built before timing

    def reference(ids, max_new_tokens):
        if own_reference:
            return generate(model, ids, max_new_tokens, options=one_node, **sampling).sequences
        return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)

    def speculative(ids, max_new_tokens, streamer=None):
        return generate(compiled, ids, max_new_tokens=max_new_tokens, streamer=streamer, **sampling)

    label = "plain sampling (one-node)" if sampling["do_sample"] else "plain greedy (same rewrites)" if lossy else "plain greedy (HF)"
    return tokenizer, reference, speculative, label


def _onnxrt_runs(args: argparse.Namespace):
    """(tokenizer, plain greedy run, speculative run) on ONNX Runtime: one-node trees beside the tree."""
    from transformers import AutoTokenizer

    from .api import generate, load_onnx
    from .backends.onnx.ort import read_manifest
    from .drafters.registry import drafter_by_name
    from .common.errors import InvalidParameterError

    if args.model is None:
        raise InvalidParameterError("--backend onnxrt needs --model DIR, a `specpass export` output")
    if args.pipeline is not None:
        raise InvalidParameterError("an ONNX export's pipeline is fixed at export time; drop --pipeline")
    read_manifest(args.model)  # a missing or foreign directory is named before anything loads
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    program = load_onnx(args.model, drafter=drafter_by_name(args.drafter), device=args.device)
    plain = load_onnx(args.model, device=args.device, max_nodes=1)  # the same rewrites, one node a step
    _lossy_passes(program.pipeline)
    program.cost_curve  # measured before timing
    sampling = _sampling(args)

    def reference(ids, max_new_tokens):
        return generate(plain, ids, max_new_tokens=max_new_tokens, **sampling).sequences

    def speculative(ids, max_new_tokens, streamer=None):
        return generate(program, ids, max_new_tokens=max_new_tokens, streamer=streamer, **sampling)

    return tokenizer, reference, speculative, "plain sampling (ORT)" if args.do_sample else "plain greedy (ORT)"


def _lossy_passes(pipeline) -> list:
    """The pipeline's passes that change the model's output, each named in a printed note (rank 0)."""
    lossy = [p for p in pipeline if p.changes_output is not None]
    for p in lossy if _rank() == 0 else ():
        print(f"note: the output differs from the original model's: {p.changes_output}")
    return lossy


def _sampling(args: argparse.Namespace) -> dict:
    """specpass.generate's sampling arguments from the flags (checked by generate)."""
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "acceptance")
    return {"do_sample": args.do_sample} | {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _join_torchrun() -> None:
    """Join the process group torchrun set up (gloo: the CLI runs on the CPU), for TensorParallel."""
    import torch.distributed as dist

    from .common.errors import InvalidParameterError

    if "WORLD_SIZE" not in os.environ:
        raise InvalidParameterError(
            "TensorParallel runs one process per shard: launch with "
            "`torchrun --nproc-per-node N --no-python specpass generate ...`"
        )
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from .backends.runtime.sampling import Sampling
    from .drafters.registry import drafter_by_name

    Sampling(**_sampling(args))  # bad sampling flags are refused before any model loads
    torch.manual_seed(0)
    tokenizer, plain, speculative, label = (_onnxrt_runs if args.backend == "onnxrt" else _pytorch_runs)(args)
    ids = _encode(tokenizer, args.prompt, args.raw)
    started = time.perf_counter()
    reference = plain(ids, args.max_new_tokens)
    plain_seconds = time.perf_counter() - started
    # rank 0 prints the speculative output as its tokens are accepted (tensor-parallel ranks hold the same result)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if _rank() == 0 else None
    out = speculative(ids, args.max_new_tokens, streamer)
    same = torch.equal(out.sequences, reference)
    if _rank() != 0:
        return 0 if same else 1
    print()
    plain_tokens = reference.shape[1] - ids.shape[1]
    plain_rate = plain_tokens / plain_seconds
    print(f"{'':30}{'tokens':>8}{'tokens/s':>10}{'tau':>7}")
    print(f"{label:30}{plain_tokens:>8}{plain_rate:>10.1f}{1.0:>7.2f}")
    s = out.stats
    print(f"{'specpass':30}{s.new_tokens:>8}{s.tokens_per_second:>10.1f}{s.tau:>7.2f}")
    if args.do_sample and args.acceptance != "match" and drafter_by_name(args.drafter).draws:
        print(f"speedup {s.tokens_per_second / plain_rate:.2f}x; multi-candidate rule: the distribution of plain "
              "sampling, not its tokens (--acceptance match gives those)")  # fmt: skip
        print(f"stats: {s}")
        return 0
    print(f"speedup {s.tokens_per_second / plain_rate:.2f}x, identical to {'plain sampling' if args.do_sample else 'greedy'}: {same}")
    print(f"stats: {s}")
    return 0 if same else 1


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from .backends.onnx.export import DTYPES, export
    from .models import load_model

    pipeline = _pipeline(args.pipeline)  # a bad pipeline is refused before the model loads; None: export fits the default
    model, tokenizer, name = load_model(args.model, dtype=DTYPES[args.dtype])
    with torch.no_grad():
        result = export(model, pipeline, args.output, tokenizer=tokenizer, model_name=name,
                        force=args.force, check=not args.no_check)  # fmt: skip
    print(f"wrote {result.onnx_path} ({result.manifest['architecture']}, {result.manifest['dtype']})")
    if result.max_abs_diff is None:
        print("checks skipped (--no-check)")
    else:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in result.manifest["check"]["max_abs_diff"].items())
        print(f"onnx.checker passed; max |ORT - PyTorch|: {diffs}")
    return 0


def cmd_train_heads(args: argparse.Namespace) -> int:
    import os

    import torch

    from .common.errors import InvalidParameterError
    from .research.exit_training import ExitTrainConfig, train_exit_adapter
    from .heads.feature_draft import default_feature_layers
    from .research.feature_training import FeatureTrainConfig, train_feature_draft
    from .heads.io import load_feature_draft
    from .research.heads_training import Continuation, TrainConfig, generate_corpus, train_heads
    from .models import load_model
    from .research.training_prompts import held_out_prompts, training_prompts
    from .research.transfer_training import TransferTrainConfig, train_transfer

    given = {"prompts": args.prompts, "epochs": args.epochs, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
             "held_out": args.held_out, "draft_vocab": args.draft_vocab}  # fmt: skip
    kind = args.kind
    if kind != "exit-adapter" and any(v is not None for v in (args.blocks, args.inner_size)):
        raise InvalidParameterError("--blocks and --inner-size are for --kind exit-adapter")
    if kind not in ("exit-adapter", "hidden-transfer") and args.layer is not None:
        raise InvalidParameterError("--layer is for --kind exit-adapter or hidden-transfer")
    if kind not in ("medusa", "hydra", "hidden-transfer") and args.heads is not None:
        raise InvalidParameterError(f"--heads is for draft heads (--kind medusa or hydra) and pseudo tokens "
                                    f"(--kind hidden-transfer), not --kind {kind}")  # fmt: skip
    if kind not in _FEATURE_KINDS and any(v is not None for v in (args.chain_steps, args.resume)):
        raise InvalidParameterError("--chain-steps and --resume are for --kind feature, clover or chimera")
    if kind not in (*_FEATURE_KINDS, "hidden-transfer") and args.sequences is not None:
        raise InvalidParameterError("--sequences is for --kind feature, clover, chimera or hidden-transfer")
    if kind == "hidden-transfer":
        if args.draft_vocab is not None:
            raise InvalidParameterError("--draft-vocab is not for --kind hidden-transfer: its pseudo tokens decode "
                                        "through the model's own LM head")  # fmt: skip
        given = {k: v for k, v in given.items() if k != "draft_vocab"}
        given |= {"layer": args.layer, "pseudo_tokens": args.heads, "sequences": args.sequences}
        config_type = TransferTrainConfig
    elif kind == "exit-adapter":
        given |= {"layer": args.layer, "blocks": args.blocks, "inner_size": args.inner_size}
        config_type = ExitTrainConfig
    elif kind in _FEATURE_KINDS:
        given |= {"steps": args.chain_steps, "sequences": args.sequences, "design": _FEATURE_KINDS[kind]}
        config_type = FeatureTrainConfig
    else:
        given |= {"design": kind, "num_heads": args.heads}
        config_type = TrainConfig
    config = config_type(**{k: v for k, v in given.items() if v is not None})
    model, tokenizer, _ = load_model(args.model, device=args.device)
    start = load_feature_draft(args.resume, model.lm_head) if args.resume else None
    layers = {"exit-adapter": lambda: (config.layer,), "feature": lambda: default_feature_layers(len(model.model.layers))}
    layers = start.config.feature_layers if start is not None else layers.get(kind, tuple)()
    if args.corpus and os.path.exists(args.corpus):
        corpus = [Continuation(tokens, start) for tokens, start in torch.load(args.corpus)]
        print(f"corpus: {len(corpus)} sequences from {args.corpus}")
    else:
        prompts = training_prompts(tokenizer, config.prompts)
        corpus = generate_corpus(model, prompts, config.max_new_tokens, layers=layers)
        if args.corpus:
            torch.save([(c.tokens, c.start) for c in corpus], args.corpus)
    held_prompts = held_out_prompts(tokenizer, config.held_out)
    held_out = generate_corpus(model, held_prompts, config.max_new_tokens, layers=layers)
    if kind == "hidden-transfer":
        _, result, _ = train_transfer(model, corpus, held_out, config, out_dir=args.out)
        print(f"wrote {args.out}: a hidden transfer of {result.pseudo_tokens} pseudo tokens into layer {result.layer} "
              f"for model {result.model}")  # fmt: skip
        for j, row in enumerate(result.accuracy, start=1):
            print(f"  pseudo token {j}: held-out top-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f}")
        return 0
    if kind == "exit-adapter":
        _, result, report = train_exit_adapter(model, corpus, held_out, config, out_dir=args.out)
        print(f"wrote {args.out}: an exit adapter after layer {result.layer} for model {result.model}, "
              f"a draft vocabulary of {result.draft_vocab} tokens")
        print(f"  held-out top-1 agreement with the model: {report['adapter_agreement']:.3f} "
              f"(the plain exit after layer {result.layer}: {report['plain_exit_agreement']:.3f})")
        return 0
    if kind in _FEATURE_KINDS:
        if start is not None and start.config.design != config.design:
            raise InvalidParameterError(f"--resume {args.resume} holds a {start.config.design} draft, not --kind {kind}")
        _, draft, _ = train_feature_draft(model, corpus, held_out, config, layers, out_dir=args.out, start=start)
        what = {"eagle3": f"a feature draft over layers {draft.feature_layers}", "clover": "a Clover draft",
                "chimera": f"a Chimera draft with {draft.parallel_heads} heads"}[draft.design]  # fmt: skip
        print(f"wrote {args.out}: {what} for model {draft.model}, a draft vocabulary of {draft.draft_vocab} tokens")
        for d, row in enumerate(draft.accuracy, start=1):
            print(f"  depth {d}: held-out top-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f}")
        return 0
    _, heads, _ = train_heads(model, corpus, held_out, config, out_dir=args.out)
    vocab = f"a draft vocabulary of {heads.draft_vocab} tokens" if heads.draft_vocab else "the whole vocabulary"
    print(f"wrote {args.out}: {heads.num_heads} {heads.design} heads for model {heads.model}, {vocab}")
    for d, row in enumerate(heads.accuracy, start=1):
        print(f"  head {d}: held-out top-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .research.bench import run_benchmark

    run_benchmark(
        prompts_per_set=args.prompts,
        max_new_tokens=args.max_new_tokens,
        out_dir=args.out,
        compile_baseline=not args.no_compile_baseline,
        rows=args.rows,
        tag=args.tag,
    )
    return 0


def cmd_train_retention(args: argparse.Namespace) -> int:
    import json
    import os

    from .heads.retention import save_gates
    from .models import load_model
    from .research.retention_training import RetentionTraining, train_retention, training_sequences

    given = {"capacity": args.capacity, "sequence": args.sequence, "steps": args.steps, "seed": args.seed}
    config = RetentionTraining(**{k: v for k, v in given.items() if v is not None})
    model, tokenizer, _ = load_model(args.model, device="cpu")
    gates, report = train_retention(model, training_sequences(tokenizer, config), config)
    save_gates(gates, args.out)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({k: v for k, v in report.items() if k != "history"} | {"steps": len(report["history"])}, f, indent=2)
    print(f"wrote retention gates to {args.out} (first step {report['first']}, last {report['last']})")
    return 0


def cmd_eval_kv(args: argparse.Namespace) -> int:
    import torch

    from .research import bench, eval_kv
    from .common.errors import InvalidParameterError
    from .models import load_default_model

    protocol = eval_kv.Protocol()
    chosen = {name: value for name, value in (
        ("lengths", args.lengths), ("budgets", args.budgets), ("policies", args.policies),
        ("passkey_lengths", args.passkey_lengths if args.passkey_lengths is not None else args.lengths),
        ("passkey_budgets", args.passkey_budgets if args.passkey_budgets is not None else args.budgets),
        ("speculation_policies", args.speculation_policies), ("onnx_policies", args.onnx_policies)) if value is not None}  # fmt: skip
    named = set(chosen.get("policies", ())) | set(chosen.get("speculation_policies", ())) | set(chosen.get("onnx_policies", ()))
    unknown = sorted(named - set(eval_kv.POLICIES) - {"trim-kv"})
    if unknown:
        raise InvalidParameterError(f"unknown policies {unknown}; choose from {', '.join(eval_kv.POLICIES)}")
    if any(not 0.0 < b < 1.0 for b in [*chosen.get("budgets", ()), *chosen.get("passkey_budgets", ()), args.onnx_budget]):
        raise InvalidParameterError("budgets are fractions of the length, in (0, 1)")
    if args.speculation_prompts < 0:
        raise InvalidParameterError("--speculation-prompts must be >= 0")
    chosen = {k: tuple(v) for k, v in chosen.items()}
    protocol = dataclasses.replace(protocol, **chosen, passkey_seeds=args.passkey_seeds, passkey_depths=args.passkey_depths,
                                   speculation_prompts=args.speculation_prompts, onnx_length=args.onnx_length,
                                   onnx_budget=args.onnx_budget)  # fmt: skip
    if args.gates is not None:
        eval_kv.POLICIES["trim-kv"] = eval_kv.trim_kv(args.gates)
    elif "trim-kv" in named:
        raise InvalidParameterError("the trim-kv policy needs --gates DIR (specpass train-retention --out DIR)")
    model, tokenizer = load_default_model()
    identity = bench.run_identity(torch.device("cpu"))
    save = lambda partial: bench.write_report(identity | partial, args.out, prefix="kv-eviction-")  # noqa: E731
    report = identity | eval_kv.run(model, tokenizer, protocol, save=save)
    path = save(report)
    eval_kv.plot(report, path.removesuffix(".json") + ".png")
    print(eval_kv.tables(report))
    print(f"wrote {path} and its .png")
    return 0


_RENAMED = {"eagle": "feature"}  # old choice -> its name now (the old one works until 0.2, with a note)
_FEATURE_KINDS = {"feature": "eagle3", "clover": "clover", "chimera": "chimera"}  # --kind -> the feature draft's design


def _rename(args: argparse.Namespace) -> None:
    """Old names of --heads / --kind choices become the new ones, with a note on stderr."""
    for option in ("heads", "kind"):
        old = getattr(args, option, None)
        if old in _RENAMED:
            print(f"specpass: note: --{option} {old} is now --{option} {_RENAMED[old]}", file=sys.stderr)
            setattr(args, option, _RENAMED[old])


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="specpass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative generation beside plain greedy (default model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--backend", choices=("pytorch", "onnxrt"), default="pytorch")
    gen.add_argument("--model", help="pytorch: a HF model directory or .gguf file (default: the embedded "
                                     "SmolLM2-135M-Instruct); onnxrt: a `specpass export` directory")  # fmt: skip
    gen.add_argument("--device", default="cpu", help="onnxrt: cpu (CPU EP) or cuda (CUDA EP)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--pipeline", help="pipeline JSON, or a file holding it (default: TreeAttention(64), "
                     "shorter below a sliding window of 64 or less)")
    gen.add_argument("--drafter", choices=DRAFTER_NAMES, default="combined")
    gen.add_argument("--heads", choices=("medusa", "hydra", "feature", *_RENAMED),
                     help="add draft heads (drafter heads*) or the feature draft (drafter feature*) to the pipeline")
    gen.add_argument("--heads-dir", help="a trained draft (default: the one shipped for the default model)")
    gen.add_argument("--raw", action="store_true", help="continue the prompt as raw text (no chat template)")
    gen.add_argument("--do-sample", action="store_true", help="sample (seeded; lossless against one-node trees)")
    gen.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default 0: off)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1.0: off)")
    gen.add_argument("--min-p", type=float, help="drop tokens below min_p x the likeliest's probability (default 0)")
    gen.add_argument("--seed", type=int, help="keys the sampling noise (default 0)")
    gen.add_argument("--acceptance", choices=("auto", "match"), help="drawn drafts (--drafter heads-drawn): auto "
                     "accepts by the multi-candidate rule, match by sample-and-match (default auto)")  # fmt: skip
    gen.set_defaults(run=cmd_generate)
    exp = sub.add_parser("export", help="write the rewritten decode step as an ONNX model, checked on ORT")
    exp.add_argument("model", nargs="?", help="a HF model directory or .gguf file (default: the embedded model)")
    exp.add_argument("-o", "--output", required=True, help="output directory")
    exp.add_argument("--pipeline", help="pipeline JSON, or a file holding it (default: TreeAttention(64), "
                     "shorter below a sliding window of 64 or less)")
    exp.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    exp.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    exp.add_argument("--no-check", action="store_true", help="skip onnx.checker and the ORT/PyTorch comparison")
    exp.set_defaults(run=cmd_export)
    heads = sub.add_parser("train-heads", help="self-distil Medusa or Hydra draft heads, an exit adapter, a feature "
                           "draft (EAGLE-3 style), a Clover or a Chimera draft, or a hidden transfer for a model")  # fmt: skip
    heads.add_argument("model", nargs="?", help="a HF model directory or .gguf file (default: the embedded model)")
    heads.add_argument("--kind", choices=("medusa", "hydra", "exit-adapter", *_FEATURE_KINDS, "hidden-transfer",
                                          *_RENAMED),  # fmt: skip
                       default="medusa")  # fmt: skip
    heads.add_argument("--out", required=True,
                       help="output directory (heads, exit_adapter or feature_draft .safetensors + .json)")
    heads.add_argument("--heads", type=int, help="number of heads K (default 4); hidden-transfer: pseudo tokens (default 3)")
    heads.add_argument("--layer", type=int, help="exit-adapter: it reads the stream after layers [0, layer) (default 4); "
                       "hidden-transfer: the pseudo states enter this layer (default: two thirds of the layers)")
    heads.add_argument("--blocks", type=int, help="exit-adapter: residual MLP blocks (default 1)")
    heads.add_argument("--inner-size", type=int, help="exit-adapter: each block's MLP width (default 1536)")
    heads.add_argument("--chain-steps", type=int,
                       help="feature, clover, chimera: draft steps trained at once on the draft's own states "
                       "(default 4; chimera: its heads)")  # fmt: skip
    heads.add_argument("--sequences", type=int,
                       help="feature, clover, chimera: whole sequences per optimizer step (default 8; the GPU recipe "
                       "32); hidden-transfer (default 4)")  # fmt: skip
    heads.add_argument("--prompts", type=int,
                       help="training prompts (standard-library, networkx and sympy functions, code and chat; default 2000, "
                       "feature, clover, chimera and hidden-transfer 1000)")
    heads.add_argument("--epochs", type=int, help="passes over the corpus (default 2; feature, clover, chimera and hidden-transfer 4)")
    heads.add_argument("--max-new-tokens", type=int, help="length of each greedy continuation (default 128)")
    heads.add_argument("--seed", type=int, help="(default 0)")
    heads.add_argument("--held-out", type=int,
                       help="held-out prompts (other modules than the training ones) for the accuracy table (default 32)")
    heads.add_argument("--draft-vocab", type=int,
                       help="tokens the heads may propose: the most frequent of the corpus (default 8192; 0: all)")
    heads.add_argument("--resume", metavar="DIR",
                       help="feature, clover, chimera: train this model's draft of that kind in DIR further (a new "
                       "schedule of --epochs)")  # fmt: skip
    heads.add_argument("--corpus", help="file caching the generated training corpus (read if present, else written)")
    heads.add_argument("--device", default="cpu", help="where the model generates and the heads train: cpu or cuda")
    heads.set_defaults(run=cmd_train_heads)
    retention = sub.add_parser("train-retention", help="train TRIM-KV retention gates for a model (the trim-kv policy)")
    retention.add_argument("model", nargs="?", help="a HF model directory or .gguf file (default: the embedded model)")
    retention.add_argument("--out", required=True, help="output directory (retention.safetensors + .json)")
    retention.add_argument("--capacity", type=_positive_int, help="memory M per layer and KV head (default 128)")
    retention.add_argument("--sequence", type=_positive_int, help="tokens per training sequence (default 512)")
    retention.add_argument("--steps", type=_positive_int, help="one sequence a step (default 150)")
    retention.add_argument("--seed", type=int, help="(default 0)")
    retention.set_defaults(run=cmd_train_retention)
    bench = sub.add_parser("bench", help="tokens/s and tau against HF baselines, measured in one run")
    bench.add_argument("--prompts", type=_positive_int, default=10, help="prompts per set (code, chat)")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--out", default="benchmarks/results")
    bench.add_argument(
        "--no-compile-baseline", action="store_true", help="skip HF static cache + torch.compile (compiles ~2 min)"
    )
    bench.add_argument("--rows", nargs="+", help="the rows to run (default: all; hf_greedy and hf_prompt_lookup always run)")
    bench.add_argument("--tag", default="", help="a prefix of the report's file name")
    bench.set_defaults(run=cmd_bench)
    kv = sub.add_parser("eval-kv", help="quality and memory of each KV-eviction policy, sparse attention and budget (long inputs)")
    kv.add_argument("--lengths", type=_positive_int, nargs="*",
                    help="input lengths in tokens for perplexity and agreement (default 2048 4096 8192; none: skip)")
    kv.add_argument("--budgets", type=float, nargs="+", help="cache budgets, fractions of the length (0.1 0.25 0.5)")
    kv.add_argument("--policies", nargs="+", help="(default: window sinks-window h2o a2sf tova snapkv keyformer "
                                                  "ems tidal-decode token-select)")
    kv.add_argument("--passkey-lengths", type=_positive_int, nargs="*", help="(default: --lengths)")
    kv.add_argument("--passkey-budgets", type=float, nargs="*", help="(default: --budgets)")
    kv.add_argument("--passkey-seeds", type=_positive_int, default=20)
    kv.add_argument("--passkey-depths", type=_positive_int, default=5)
    kv.add_argument("--speculation-prompts", type=int, default=20,
                    help="prompts for speculative = one-token-a-step decoding under eviction (at 4096 tokens, "
                         "budget 0.25; 0: skip)")
    kv.add_argument("--speculation-policies", nargs="*", default=["tova"])
    kv.add_argument("--onnx-policies", nargs="*",
                    help="policies exported to ONNX and run on ORT beside the full cache (default: tova; none: skip)")
    kv.add_argument("--onnx-length", type=_positive_int, default=8192)
    kv.add_argument("--onnx-budget", type=float, default=0.25)
    kv.add_argument("--gates", metavar="DIR", help="retention gates for the trim-kv policy (specpass train-retention)")
    kv.add_argument("--out", default="benchmarks/results")
    kv.set_defaults(run=cmd_eval_kv)
    args = parser.parse_args(argv)
    _rename(args)
    from .common.errors import SpecpassError

    try:
        return args.run(args)
    except SpecpassError as exc:
        print(f"specpass: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
