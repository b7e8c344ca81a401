"""`specpass export`: the rewritten decode step as an ONNX model, checked with onnx.checker and on ORT.

Capture -> the pipeline's passes (verified after each) -> KV as inputs and outputs (backends.onnx.kv_io)
-> `torch.onnx.export(..., dynamo=True)` -> save -> checks. The dynamo exporter exports `torch.export`'s
graph of the very FX module the passes produced, with B, T and S symbolic (the TorchScript exporter
re-traces through Python and is deprecated). Its onnxscript optimizer is off (`optimize=False`): ORT
optimizes the graph when it opens a session, and the optimizer made the export slower for no faster ORT
step (docs/experiments.md, "ONNX export without onnxscript's optimizer"). The directory: model.onnx
(+ .data), draft.onnx, the files a pass's export hook adds, pipeline.json, manifest.json and the
tokenizer's files, written to a hidden folder beside the output and renamed into place once checked, so
an interrupted export never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from .kv_io import INPUTS, KV_OUTPUTS, QUERIES_OUTPUT, kv_as_io
from .draft import export_draft
from .ort import MANIFEST_VERSION, RELATIVE_TOLERANCE, TOLERANCE, check_against_torch, ort_session
from ...common.errors import ExportError, SpecpassError
from ...ir import ArchSpec, arch_of, arch_spec, capture, draft_graph, draft_spec
from ...ir.draft import DRAFT_STATES, STEP_OUTPUTS_META
from ...passes import Pass, Pipeline
from ...passes.export import ExportGraph, ExportHook
from ...rewrites.kv_eviction import EVICTION_META

EXTERNAL_DATA_BYTES = 1 << 30  # weights above this go to model.onnx.data
DTYPES = {"float32": torch.float32, "float16": torch.float16}

MEANING = {
    "input_ids": "tokens to verify: a tree (node 0 = last committed token), a chain, or a prompt",
    "positions": "rotary positions: committed prefix length + depth in the tree",
    "past_keys": "cached keys of S slots (after rotary), all layers",
    "past_values": "cached values of S slots, all layers",
    "past_mask": "past_mask[b, t, s]: token t attends to cached slot s (the committed prefix)",
    "tree_mask": "tree_mask[b, t, j]: token t attends to token j (j is t or an ancestor of t)",
    "logits": "next-token logits after each of the T tokens",
    "hidden": "final normed hidden state of each of the T tokens",
    "new_keys": "keys of the T tokens; commit an accepted path with new_keys[..., path, :]",
    "new_values": "values of the T tokens",
    "queries": "queries of the T tokens (KV eviction: observe.onnx scores the accepted ones)",
    DRAFT_STATES: "what the draft graph reads of each of the T tokens (a feature draft's fused features)",
}


@dataclass(frozen=True)
class ExportResult:
    directory: str
    onnx_path: str
    manifest: dict
    max_abs_diff: float | None  # None when the check was skipped


def export_hooks(pipeline: Pipeline, rewritten: torch.fx.GraphModule, dtype: torch.dtype) -> list[ExportHook]:
    """Each pass's export hook for the step it rewrote (Pass.export_hook); a pass without one is refused."""
    hooks = []
    for p in pipeline:
        hook = p.export_hook(rewritten, arch_of(rewritten), dtype)
        if hook is None:
            exportable = ", ".join(sorted(t.__name__ for t in _exportable_types()))
            raise ExportError(f"the ONNX exporter cannot express pass {p.name}: a pass is exported when it says what "
                              f"it adds to an export (Pass.export_hook); these do: {exportable}")  # fmt: skip
        hooks.append(hook)
    return hooks


def _exportable_types() -> list[type]:
    from ...passes import known_passes

    return [t for t in known_passes().values() if t.export_hook is not Pass.export_hook]


def _shapes(arch: ArchSpec, batch: int, t: int, s: int) -> dict[str, tuple]:
    kv = (arch.num_layers, batch, arch.num_kv_heads)
    return {
        "input_ids": (batch, t), "positions": (batch, t), "past_keys": (*kv, s, arch.head_dim),
        "past_values": (*kv, s, arch.head_dim), "past_mask": (batch, t, s), "tree_mask": (batch, t, t),
        "logits": (batch, t, arch.vocab_size), "hidden": (batch, t, arch.hidden_size),
        "new_keys": (*kv, t, arch.head_dim), "new_values": (*kv, t, arch.head_dim),
        "queries": (arch.num_layers, batch, arch.num_heads, t, arch.head_dim),
        DRAFT_STATES: (batch, t, arch.hidden_size),
    }  # fmt: skip


def _sample(arch: ArchSpec, dtype: torch.dtype, t: int, s: int, tokens: list[int] | None = None,
            batch: int = 1) -> dict:  # fmt: skip
    """Inputs for `batch` rows of T tokens over S cached slots: a chain after a visible prefix (export
    traces these)."""
    gen = torch.Generator().manual_seed(0)
    shapes = _shapes(arch, batch, t, s)
    ids = torch.tensor([tokens]) if tokens is not None else torch.randint(0, arch.vocab_size, (batch, t), generator=gen)
    return {
        "input_ids": ids,
        "positions": torch.arange(s, s + t).expand(batch, t),
        "past_keys": torch.randn(shapes["past_keys"], generator=gen).to(dtype),
        "past_values": torch.randn(shapes["past_values"], generator=gen).to(dtype),
        "past_mask": torch.ones(shapes["past_mask"], dtype=torch.bool),
        "tree_mask": torch.ones(t, t, dtype=torch.bool).tril().expand(batch, t, t),
    }


def rewritten_step(model: nn.Module, pipeline: Pipeline) -> torch.fx.GraphModule:
    """Capture and run the pipeline (verified after each pass); `kv_as_io` makes it the exported function."""
    rewritten, _ = pipeline.run(capture(model, cache_size=2))  # the functional step owns no cache
    return rewritten


def output_names(step: torch.fx.GraphModule) -> list[str]:
    """The exported step's outputs: logits, hidden, new K/V, the queries when it evicts, then the outputs
    draft passes declared (ir.draft.add_step_output), in their order."""
    declared = sorted(step.meta.get(STEP_OUTPUTS_META, {}).items(), key=lambda item: item[1])
    return ["logits", "hidden", *KV_OUTPUTS, *([QUERIES_OUTPUT] if EVICTION_META in step.meta else []),
            *(name for name, _ in declared)]  # fmt: skip


def export(
    model: nn.Module,
    pipeline: Pipeline | None,
    out_dir: str,
    *,
    tokenizer=None,
    model_name: str = "",
    force: bool = False,
    check: bool = True,
    progress: bool = True,
) -> ExportResult:
    """Export `model` rewritten by `pipeline` (None: the default fitted to the model, backends.options)
    to `out_dir` (see module docstring). The model's dtype (float32 or float16) is the exported dtype."""
    from tqdm.auto import tqdm

    from ..options import default_pipeline

    needed = ("onnx", "onnxscript", "onnxruntime") if check else ("onnx", "onnxscript")  # onnxruntime runs the check
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"the ONNX export needs {' and '.join(missing)}: pip install 'specpass[onnx]'")
    pipeline = pipeline if pipeline is not None else default_pipeline(arch_spec(model))

    dtype = next(model.parameters()).dtype
    if dtype not in TOLERANCE:
        raise ExportError(f"export supports float32 and float16 weights, the model is {dtype}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not force:
        raise ExportError(f"{out_dir} exists and is not empty; pass --force (force=True) to overwrite it")
    stages = ["capture + passes + KV as inputs/outputs", "torch.export + ONNX translation", "save", "checks"]
    bar = tqdm(total=len(stages) - (0 if check else 1), desc="specpass export", disable=not progress)

    def stage(name: str):
        bar.set_postfix_str(name)

    stage(stages[0])
    rewritten = rewritten_step(model, pipeline)
    hooks = export_hooks(pipeline, rewritten, dtype)
    step = kv_as_io(rewritten)
    arch = arch_of(step)
    bar.update()
    stage(stages[1])
    onnx_program = _torch_export(step, arch, dtype)
    bar.update()
    stage(stages[2])
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.export-", dir=parent)
    try:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        onnx_program.save(os.path.join(staging, "model.onnx"), external_data=weight_bytes > EXTERNAL_DATA_BYTES)
        with open(os.path.join(staging, "pipeline.json"), "w") as f:
            f.write(pipeline.to_json())
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        entries = {}
        if draft_graph(step) is not None:  # a draft graph (ir.draft) goes to draft.onnx
            entries["draft"] = export_draft(draft_graph(step), draft_spec(step), dtype, staging, check, _quiet_exporter)
        for hook in hooks:  # what the passes add beside the step (their own graphs, a manifest entry)
            diffs = {g.file: _export_graph(g, staging, dtype, check) for g in hook.graphs}
            if hook.manifest_key is not None:
                entries[hook.manifest_key] = dict(hook.entry) | ({"check_max_abs_diff": diffs} if check else {})
        bar.update()
        diffs = None
        if check:
            stage(stages[3])
            sample_tokens = _sample_tokens(tokenizer, arch)
            diffs = check_onnx(os.path.join(staging, "model.onnx"), step, arch, dtype, sample_tokens)
            bar.update()
        manifest = _manifest(step, dtype, pipeline, model_name, weight_bytes > EXTERNAL_DATA_BYTES, diffs) | entries
        with open(os.path.join(staging, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2)
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
    return ExportResult(out_dir, os.path.join(out_dir, "model.onnx"), manifest, max(diffs.values()) if diffs else None)


def _export_graph(graph: ExportGraph, out_dir: str, dtype: torch.dtype, check: bool) -> float | None:
    """Export a pass's graph to out_dir/graph.file; with `check`, onnx.checker and ORT against PyTorch
    on the sample inputs (returns the largest difference; ExportError past TOLERANCE)."""
    path = os.path.join(out_dir, graph.file)
    inputs = dict(graph.inputs)
    try:
        with _quiet_exporter():
            program = torch.onnx.export(graph.module, (), kwargs=inputs, dynamo=True, dynamic_shapes=graph.dynamic_shapes,
                                        input_names=list(inputs), output_names=list(graph.outputs), optimize=False)  # fmt: skip
    except Exception as exc:
        raise ExportError(f"torch.onnx.export of {graph.file} failed: {type(exc).__name__}: {str(exc)[:600]}") from exc
    program.save(path)
    return check_against_torch(path, graph.module, inputs, graph.outputs, dtype, graph.file) if check else None


def _move_into_place(staging: str, out_dir: str) -> None:
    """Rename the checked export `staging` to `out_dir` (an existing one, allowed by `force`, is renamed
    aside first and deleted after): an interrupted export leaves no `out_dir` that looks complete."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    old = None
    if os.path.lexists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.old-", dir=os.path.dirname(staging))
        os.rename(out_dir, os.path.join(old, "export"))
    os.rename(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _torch_export(step: torch.fx.GraphModule, arch: ArchSpec, dtype: torch.dtype):
    """B (rows), T and S symbolic. The sample has two rows: torch.export specialises a dimension it
    sees with size 1, and ORT then refuses every other batch size."""
    b = torch.export.Dim("B", min=1, max=1024)
    t, s = torch.export.Dim("T", min=1, max=4096), torch.export.Dim("S", min=1, max=1 << 20)
    dynamic = {
        "input_ids": {0: b, 1: t}, "positions": {0: b, 1: t}, "past_keys": {1: b, 3: s}, "past_values": {1: b, 3: s},
        "past_mask": {0: b, 1: t, 2: s}, "tree_mask": {0: b, 1: t, 2: t},
    }  # fmt: skip
    sample = {name: value.contiguous() for name, value in _sample(arch, dtype, t=4, s=8, batch=2).items()}
    try:
        with _quiet_exporter():
            return torch.onnx.export(
                step, (), kwargs=sample, dynamo=True, dynamic_shapes=dynamic,
                input_names=list(INPUTS), output_names=output_names(step), optimize=False,
            )  # fmt: skip
    except SpecpassError:
        raise
    except Exception as exc:  # the exporter's own errors are long; keep the first lines
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {str(exc)[:600]}") from exc


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter prints a step-by-step log, warns about torchvision ops and about renamed axes."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _sample_tokens(tokenizer, arch: ArchSpec) -> list[int] | None:
    if tokenizer is None:
        return None
    text = 'def mean(values):\n    """Return the arithmetic mean of values."""\n    return sum(values) / len(values)\n'
    ids = tokenizer(text).input_ids
    return [i for i in ids if i < arch.vocab_size][:24]


def check_onnx(onnx_path: str, step: torch.fx.GraphModule, arch: ArchSpec, dtype: torch.dtype, tokens) -> dict:
    """onnx.checker, then ORT against the PyTorch step on a prefill and a tree step over its KV.

    Returns the max |ORT - PyTorch| per output of the tree step; raises ExportError past TOLERANCE.
    """
    import onnx

    try:
        onnx.checker.check_model(onnx_path, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected {onnx_path}: {exc}") from exc
    session = ort_session(onnx_path, device=torch.device("cpu"))
    tokens = tokens if tokens is not None else torch.randint(0, arch.vocab_size, (24,)).tolist()
    prefix, tree_tokens = tokens[:-5], tokens[-5:]
    # 1. prefill the prefix as a chain; the single past slot is masked out (ORT rejects S = 0)
    prefill = _sample(arch, dtype, t=len(prefix), s=1, tokens=prefix)
    prefill["past_mask"][:] = False
    prefill["positions"] = torch.arange(len(prefix))[None]
    with torch.no_grad():
        _, _, keys, values = step(**prefill)[:4]
    # 2. a 5-node tree over that prefix: root -> (a, b), a -> c, c -> d
    parents = (-1, 0, 0, 1, 3)
    mask = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    depth = mask.sum(-1) - 1
    n = len(prefix)
    inputs = {
        "input_ids": torch.tensor([tree_tokens]), "positions": (n + depth)[None],
        "past_keys": keys.contiguous(), "past_values": values.contiguous(),
        "past_mask": torch.ones(1, 5, n, dtype=torch.bool), "tree_mask": mask[None],
    }  # fmt: skip
    with torch.no_grad():
        expected = step(**inputs)
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    names = output_names(step)
    diffs = {name: float((torch.from_numpy(g).float() - e.float()).abs().max()) for name, g, e in zip(names, got, expected)}
    allowed = {name: max(TOLERANCE[dtype], RELATIVE_TOLERANCE[dtype] * float(e.float().abs().max()))
               for name, e in zip(names, expected)}  # fmt: skip
    if not all(diffs[name] <= allowed[name] for name in names):
        raise ExportError(f"ORT and PyTorch disagree beyond {dtype}'s tolerance: max |diff| {diffs}, allowed {allowed}")
    return diffs


def _manifest(step: torch.fx.GraphModule, dtype, pipeline: Pipeline, model_name: str, external: bool, diffs) -> dict:
    arch = arch_of(step)
    shapes = _shapes(arch, "B", "T", "S")
    dtypes = {"input_ids": "int64", "positions": "int64", "past_mask": "bool", "tree_mask": "bool"}

    def io_entry(name: str) -> dict:
        return {"name": name, "shape": list(shapes[name]), "dtype": dtypes.get(name, _dtype_name(dtype)),
                "meaning": MEANING[name]}  # fmt: skip

    return {
        "format_version": MANIFEST_VERSION,
        "model": model_name,
        "architecture": arch.architecture,
        "dtype": _dtype_name(dtype),
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "eos_token_ids": list(arch.eos_token_ids),
        "pad_token_id": arch.pad_token_id,
        "pipeline": pipeline.to_dict(),
        "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        "external_data": external,
        "inputs": [io_entry(name) for name in INPUTS],
        "outputs": [io_entry(name) for name in output_names(step)],
        "check": {"max_abs_diff": diffs} if diffs is not None else "skipped",
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
