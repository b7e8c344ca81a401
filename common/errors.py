"""Every error specpass raises on bad input derives from SpecpassError."""


class SpecpassError(Exception):
    """Base class of specpass's user-facing errors."""


class UnsupportedArchitectureError(SpecpassError):
    """The model is not one of the architectures specpass can capture."""


class InvalidParameterError(SpecpassError, ValueError):
    """A pass, drafter or generation parameter is out of range."""


def require_positive_ints(config, names: tuple[str, ...], owner: str = "") -> None:
    """Refuse a config whose fields `names` are not all ints >= 1 (a bool is not an int here); `owner`
    prefixes the field's name in the message."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidParameterError(f"{owner}{name} must be a positive int, got {value!r}")


class PassMismatchError(SpecpassError):
    """A pass does not match the graph; the graph is left unchanged."""


class PassPipelineError(SpecpassError):
    """A pipeline cannot be ordered, or one of its passes failed (names the passes already run)."""


class GraphVerificationError(SpecpassError):
    """The graph violates an IR invariant."""


class CacheCapacityError(SpecpassError):
    """The prompt does not fit into the static KV cache."""


class ExportError(SpecpassError):
    """An ONNX export cannot be done as asked (unsupported pass, existing output, failed check)."""


class UnsupportedSettingError(SpecpassError, ValueError):
    """A generation setting specpass does not implement (refused, never ignored)."""


class StaleProgramError(SpecpassError):
    """A program's model changed its weights after the program was built (backends.runtime.guard)."""


class DamagedFileError(SpecpassError):
    """A file specpass wrote (an export, trained heads or adapter) is damaged or incomplete; the message
    names it and how to make it again."""
