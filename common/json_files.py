"""Reading the JSON files specpass writes (export manifests, trained drafts' configs)."""

from __future__ import annotations

import json

from .errors import DamagedFileError


def read_json_object(path: str, hint: str) -> dict:
    """The JSON object in `path`; a DamagedFileError naming the file and `hint` (how to make it again)
    when it cannot be read or holds something else than an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise DamagedFileError(f"{path} is damaged ({type(exc).__name__}: {exc}); {hint}") from None
    if not isinstance(data, dict):
        raise DamagedFileError(f"{path} is damaged (not a JSON object); {hint}")
    return data
