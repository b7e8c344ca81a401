"""KV-cache eviction as graph rewrites (lossy, opt-in): base.py states the semantics every policy
shares, policies.py the policies, ops.py the eviction graphs, scores.py their tensor math."""

from .base import EVICTION_META, KV_EVICTION, KVEviction
from .policies import A2SF, EMS, H2O, TOVA, Keyformer, SinksWindow, SnapKV, TrimKV

__all__ = ["A2SF", "EMS", "EVICTION_META", "H2O", "KV_EVICTION", "TOVA", "KVEviction", "Keyformer", "SinksWindow", "SnapKV", "TrimKV"]
