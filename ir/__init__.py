"""Capture of HF causal LMs into annotated FX decode-step graphs, and the graph invariants."""

from specpass.ir.arch import SUPPORTED_ARCHITECTURES, ArchSpec, arch_spec
from specpass.ir.capture import arch_of, capture, copy_step, is_captured_step
from specpass.ir.roles import NodeInfo, Role, info
from specpass.ir.verify import verify

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchSpec",
    "NodeInfo",
    "Role",
    "arch_of",
    "arch_spec",
    "capture",
    "copy_step",
    "info",
    "is_captured_step",
    "verify",
]
