"""Low-precision recipes and quantizers (NVFP4 in `nvfp4`, the 16-point random Hadamard
transform in `hadamard`). Submodules are imported explicitly; nothing is imported here."""
