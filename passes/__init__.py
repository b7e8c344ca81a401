"""Pass contract, pass manager, pipeline values and the registry of pass classes."""

from specpass.passes.base import CAPTURED, Pass, PassResult
from specpass.passes.draft import DraftGraphPass
from specpass.passes.manager import PassManager, PassRecord, PassReport, order_passes
from specpass.passes.pipeline import Pipeline
from specpass.passes.registry import known_passes, pass_type

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
