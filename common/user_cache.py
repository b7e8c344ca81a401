"""Where specpass keeps what it makes once and reuses: converted GGUF models (specpass.models) and
compiled steps (backends.lowering.aot_compiled)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """$SPECPASS_CACHE, else $XDG_CACHE_HOME/specpass, else ~/.cache/specpass. Deleting it is safe: what
    it held is made again when next needed."""
    if os.environ.get("SPECPASS_CACHE"):
        return os.environ["SPECPASS_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specpass")
