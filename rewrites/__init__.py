"""Graph rewrites, one module each. Each defines a Pass subclass, known by its class name to
Pipeline.from_json through passes.registry."""

from ..ir.draft import EARLY_EXIT_KIND, FEATURE_KIND, HEADS_KIND, HIDDEN_TRANSFER_KIND  # draft-graph kinds, defined once
from .draft_heads import DRAFT_HEADS, DraftHeads
from .feature_draft import FEATURE_DRAFT, FeatureDraft
from .early_exit import EARLY_EXIT, EarlyExit, EarlyExitConfig
from .hidden_transfer import HIDDEN_TRANSFER, HiddenTransfer
from .kv_eviction import A2SF, EMS, H2O, KV_EVICTION, TOVA, Keyformer, KVEviction, SinksWindow, SnapKV, TrimKV
from .ladder_residual import LADDER_RESIDUAL, LadderResidual
from .lazy_llm import LAZY_LLM, LazyLLM
from .layer_skip import LAYER_SKIP, LayerSkip
from .sparse_attention import SPARSE_ATTENTION, SparseAttention, TidalDecode, TokenSelect
from .tensor_parallel import TENSOR_PARALLEL, TensorParallel
from .tree_attention import TREE_ATTENTION, TreeAttention

__all__ = ["A2SF", "EMS", "H2O", "KV_EVICTION", "TOVA", "Keyformer", "KVEviction", "SinksWindow", "SnapKV", "TrimKV", "DRAFT_HEADS", "EARLY_EXIT", "FEATURE_DRAFT", "FEATURE_KIND", "FeatureDraft", "EARLY_EXIT_KIND", "HEADS_KIND", "HIDDEN_TRANSFER", "HIDDEN_TRANSFER_KIND", "HiddenTransfer", "LADDER_RESIDUAL", "LAZY_LLM", "LazyLLM", "LAYER_SKIP", "SPARSE_ATTENTION", "SparseAttention", "TENSOR_PARALLEL", "TidalDecode", "TokenSelect",
           "TREE_ATTENTION", "DraftHeads", "EarlyExit", "EarlyExitConfig", "LadderResidual", "LayerSkip", "TensorParallel",
           "TreeAttention"]
