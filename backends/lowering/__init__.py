"""Lowerings: the registry (`registry.LOWERINGS`, the `Step` contract) and one module per way a rewritten step runs."""
