"""Kernels whose result for a token does not depend on the rest of the call: what makes speculation exact
by construction (docs/design.md, "Lossless by construction"). `kernel_set` says which ones a device and
dtype have; `use_kernels` puts them into a step's graph."""
