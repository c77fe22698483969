"""Precision recipes and their state: `recipe` (bf16 / fp8-hybrid / nvfp4: which GEMM each projection
runs, the frozen-base cache) and `fp8` (the fp8-hybrid delayed-scaling state updates). The quantizers
and GEMMs themselves are ops (surogate_jax.ops). Submodules are imported explicitly; nothing is
imported here."""
