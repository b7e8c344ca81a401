"""Pass contract, pass manager and pipeline values."""

from specpass.passes.base import CAPTURED, Pass, PassResult
from specpass.passes.manager import PassManager, PassRecord, PassReport, order_passes
from specpass.passes.pipeline import Pipeline

__all__ = ["CAPTURED", "Pass", "PassManager", "PassRecord", "PassReport", "PassResult", "Pipeline", "order_passes"]
