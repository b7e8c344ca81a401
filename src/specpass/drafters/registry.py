"""Drafters by name, for the command line."""

from __future__ import annotations

from specpass.drafters import default_drafter
from specpass.drafters.base import Drafter
from specpass.drafters.prompt_lookup import PromptLookup
from specpass.drafters.token_recycling import TokenRecycling
from specpass.errors import InvalidParameterError

DRAFTER_NAMES = ("combined", "prompt-lookup", "token-recycling")


def drafter_by_name(name: str) -> Drafter:
    if name == "combined":
        return default_drafter()
    if name == "prompt-lookup":
        return PromptLookup()
    if name == "token-recycling":
        return TokenRecycling()
    raise InvalidParameterError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_NAMES)}")
