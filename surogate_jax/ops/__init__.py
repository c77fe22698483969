"""Fused ops: each has a pure-JAX reference `<op>_ref` and a public `<op>` that runs our CUDA
kernel through XLA FFI on GPU (when the extension is built) and the reference elsewhere."""

from surogate_jax.ops._loader import ffi_available, resolve_impl
from surogate_jax.ops.add_rms_norm import add_rms_norm, add_rms_norm_ref
from surogate_jax.ops.fp8_matmul import fp8_matmul, fp8_matmul_ref
from surogate_jax.ops.lm_head_ce import lm_head_ce, lm_head_ce_ref
from surogate_jax.ops.nf4_dequantize import nf4_dequantize, nf4_dequantize_ref
from surogate_jax.ops.rms_norm import rms_norm, rms_norm_ref
from surogate_jax.ops.rope import rope, rope_qk, rope_ref
from surogate_jax.ops.swiglu import swiglu, swiglu_packed, swiglu_ref
from surogate_jax.ops.swiglu_lora import swiglu_lora, swiglu_lora_ref
from surogate_jax.ops.tile_dequantize import tile_amax, tile_dequantize, tile_dequantize_ref

__all__ = [
    "add_rms_norm", "add_rms_norm_ref", "ffi_available", "fp8_matmul", "fp8_matmul_ref", "lm_head_ce",
    "lm_head_ce_ref", "nf4_dequantize", "nf4_dequantize_ref", "resolve_impl", "rms_norm", "rms_norm_ref", "rope",
    "rope_qk", "rope_ref", "swiglu", "swiglu_lora", "swiglu_lora_ref", "swiglu_packed", "swiglu_ref",
    "tile_amax", "tile_dequantize", "tile_dequantize_ref",
]
