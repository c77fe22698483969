"""QLoRA: LoRA over a frozen base whose seven projections are stored quantized (NF4, block-scaled FP8 or NVFP4).

`QloraSpec` names the format (config keys qlora_bnb / qlora_fp8 / qlora_fp4 and their knobs); `base` holds the
projection GEMM through a quantized weight; `nf4`, `fp8_block` and `fp4` are the formats. The public
`quantize_nf4` / `dequantize_nf4` read and write exactly what bitsandbytes and transformers store.
"""

from surogate_jax.qlora.base import FORMATS, QloraSpec


def __getattr__(name):  # the format modules load on first use (the model imports only `base`)
    if name in ("quantize_nf4", "dequantize_nf4"):
        from surogate_jax.qlora import nf4  # noqa: PLC0415

        return getattr(nf4, name)
    raise AttributeError(f"module 'surogate_jax.qlora' has no attribute {name!r}")


__all__ = ["FORMATS", "QloraSpec", "dequantize_nf4", "quantize_nf4"]
