"""ONNX Runtime plumbing shared by the exporter, its checks and the ORT programs: sessions, the
export's manifest, IOBinding to torch tensors, and the float tolerance an export must meet."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ...common.errors import DamagedFileError, ExportError, SpecpassError
from ...common.json_files import read_json_object

MANIFEST_VERSION = 2  # 2: the draft graph's entry is its DraftGraphSpec (ir.draft)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-2}  # max |ORT - PyTorch| on an export's check, or:
# relative to the output's largest magnitude (float16: 4 units in the last place there; ORT's and PyTorch's
# CPU kernels differ by more than the absolute bound on a 30-layer model: docs/experiments.md, "ONNX
# Runtime's CUDA EP at last"; float32: 8 units, for outputs far above 1 such as a feature draft's fused
# hidden states, where 1e-4 is below a unit in the last place of their largest values)
RELATIVE_TOLERANCE = {torch.float32: 8 * 2.0**-23, torch.float16: 4 * 2.0**-10}
_NUMPY = {torch.int64: np.int64, torch.bool: np.bool_, torch.float32: np.float32, torch.float16: np.float16}


def ort_session(onnx_path: str, device: torch.device, cuda_graphs: bool = False):
    """An ORT session on the CPU EP, or the CUDA EP (optionally with CUDA graphs) for a CUDA device."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise SpecpassError(
            "the ONNX Runtime backend needs onnxruntime: pip install 'specpass[onnx]' (or 'specpass[onnx-gpu]' for CUDA)"
        ) from exc
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SpecpassError("the CUDA EP is not available: install onnxruntime-gpu ('specpass[onnx-gpu]')")
        cuda = {"device_id": device.index or 0, "enable_cuda_graph": "1" if cuda_graphs else "0",
                "use_tf32": "0"}  # float32 stays float32 (torch's default for matmuls too): exact greedy
        providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    errors = ort.capi.onnxruntime_pybind11_state
    try:
        session = ort.InferenceSession(onnx_path, options, providers=providers)
    except (errors.InvalidProtobuf, errors.NoSuchFile, errors.InvalidGraph, errors.Fail) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DamagedFileError(f"ONNX Runtime cannot load {onnx_path} ({reason}); the export is damaged or "
                               "incomplete: export it again (specpass export -o DIR --force)") from None  # fmt: skip
    if device.type == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        # ORT falls back to the CPU EP when the CUDA provider library does not load: refuse instead.
        raise SpecpassError(
            f"onnxruntime {ort.__version__} could not start its CUDA EP (session providers: "
            f"{session.get_providers()}): the CUDA and cuDNN libraries it was built for are missing or do not load"
        )
    return session


def read_manifest(directory: str) -> dict:
    if not os.path.isdir(directory):
        raise SpecpassError(f"no specpass export at {directory!r}: the directory does not exist")
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        raise SpecpassError(f"{directory} holds no specpass export (no manifest.json); run `specpass export -o DIR`")
    manifest = read_json_object(path, "export the model again (specpass export -o DIR --force)")
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise SpecpassError(
            f"{path}: manifest format {manifest.get('format_version')!r}, this specpass reads format "
            f"{MANIFEST_VERSION}: export the model again with this version"
        )
    return manifest


def run_bound(session, device: torch.device, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
    """Run `session` on torch tensors in place: inputs made contiguous (kept alive through the run),
    outputs written into the given tensors' memory."""
    feeds = {name: tensor.contiguous() for name, tensor in inputs.items()}
    run_binding(session, bind(session, device, feeds, outputs))


def run_binding(session, binding, run_options=None) -> None:
    """Run a bound session between torch's work and ORT's: ORT's CUDA EP computes on a stream of its
    own, so the inputs torch wrote on its stream are waited for first (`synchronize_inputs`: a device
    sync on the CUDA EP), and torch reads the outputs only after ORT's stream is done."""
    binding.synchronize_inputs()
    session.run_with_iobinding(binding, run_options)
    binding.synchronize_outputs()


def bind(session, device: torch.device, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
    """An IOBinding of `session` to the memory of contiguous torch tensors on `device` (alive until the
    run: ORT reads and writes their memory)."""
    binding = session.io_binding()
    index = device.index or 0
    for name, tensor in inputs.items():
        binding.bind_input(name, device.type, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
    for name, tensor in outputs.items():
        binding.bind_output(name, device.type, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
    return binding


def check_against_torch(path: str, module, inputs: dict, outputs: Sequence[str], dtype: torch.dtype, name: str) -> float:
    """onnx.checker, then the ONNX file at `path` on ORT (CPU) against `module` on the same `inputs`:
    integer outputs equal, float outputs within TOLERANCE[dtype]; returns the largest float difference.
    `name` says what was exported in the ExportError otherwise."""
    import onnx

    onnx.checker.check_model(path, full_check=True)
    with torch.no_grad():
        expected = module(**inputs)
    got = ort_session(path, torch.device("cpu")).run(None, {k: v.numpy() for k, v in inputs.items()})
    worst = 0.0
    for output, mine, theirs in zip(outputs, expected, got):
        theirs = torch.from_numpy(theirs)
        if not mine.dtype.is_floating_point:
            if not torch.equal(theirs, mine.cpu()):
                raise ExportError(f"{name}'s output {output} differs between ORT and PyTorch")
            continue
        worst = max(worst, float((theirs.float() - mine.float()).abs().max()))
    if not worst <= TOLERANCE[dtype]:
        raise ExportError(f"{name} on ORT differs from PyTorch by {worst:.3g} (> {TOLERANCE[dtype]})")
    return worst
