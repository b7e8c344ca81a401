"""Pass contract, pass manager, pipeline values and the registry of pass classes."""

from .base import CAPTURED, Pass, PassResult
from .draft import DraftGraphPass
from .manager import PassManager, PassRecord, PassReport, order_passes
from .pipeline import Pipeline
from .registry import known_passes, pass_type

__all__ = [
    "CAPTURED",
    "DraftGraphPass",
    "Pass",
    "PassManager",
    "PassRecord",
    "PassReport",
    "PassResult",
    "Pipeline",
    "known_passes",
    "order_passes",
    "pass_type",
]
