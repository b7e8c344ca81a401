"""Capture of HF causal LMs into annotated FX decode-step graphs, and the graph invariants.

ir/ is the bottom layer: it imports nothing from passes/, rewrites/ or backends/.
"""

from .arch import ArchSpec, arch_spec
from .capture import arch_of, capture, copy_step, is_captured_step, model_parts, replace_node
from .draft import DraftGraphSpec, DraftTensor, draft_graph, draft_spec
from .families import FAMILIES, SUPPORTED_ARCHITECTURES, Family, family_of
from .layout import SlotLayout
from .roles import NodeInfo, Role, info
from .verify import verify

__all__ = [
    "FAMILIES",
    "SUPPORTED_ARCHITECTURES",
    "ArchSpec",
    "DraftGraphSpec",
    "DraftTensor",
    "Family",
    "NodeInfo",
    "Role",
    "SlotLayout",
    "arch_of",
    "arch_spec",
    "capture",
    "copy_step",
    "replace_node",
    "draft_graph",
    "draft_spec",
    "family_of",
    "info",
    "is_captured_step",
    "model_parts",
    "verify",
]
