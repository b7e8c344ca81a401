"""Every pass class, by name: the concrete subclasses of `Pass` defined so far.

No list is kept by hand: a rewrite module that defines a Pass subclass registers it by being
imported (`import specpass` imports the built-in rewrites). Two classes with one name are an error,
since a pipeline's JSON names passes by class name.
"""

from __future__ import annotations

import inspect

from ..common.errors import PassPipelineError
from .base import Pass


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def known_passes() -> dict[str, type[Pass]]:
    """name -> class of every concrete pass defined in this process."""
    known: dict[str, type[Pass]] = {}
    for cls in _subclasses(Pass):
        if inspect.isabstract(cls):
            continue
        if cls.__name__ in known and known[cls.__name__] is not cls:
            raise PassPipelineError(
                f"two pass classes are named {cls.__name__}: {known[cls.__name__].__module__} and {cls.__module__}"
            )
        known[cls.__name__] = cls
    return known


def pass_type(name: str) -> type[Pass]:
    known = known_passes()
    if name not in known:
        raise PassPipelineError(f"unknown pass {name!r}; known passes: {', '.join(sorted(known))}")
    return known[name]
