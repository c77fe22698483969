"""surogate_jax: a functional JAX trainer for Llama 3, Qwen2.5 and Qwen3 whose Flax models call our
own CUDA kernels through XLA FFI (pure-JAX references everywhere else).

Public API (stable):
    model, params = surogate_jax.load_pretrained(path_or_hub_id, dtype=jnp.float32)
    logits_BTV = model.apply({"params": params}, input_ids_BT, positions=..., segment_ids=...)
    surogate_jax.save_pretrained(out_dir, model, params)
    model, params = surogate_jax.load_pretrained(path, qlora=surogate_jax.qlora.QloraSpec("nf4"))  # QLoRA base
"""

from . import qlora
from .errors import ModelLoadError, SurogateError, UnsupportedConfigError
from .hf import load_pretrained, save_pretrained

__version__ = "0.1.0"

__all__ = [
    "ModelLoadError",
    "SurogateError",
    "UnsupportedConfigError",
    "__version__",
    "load_pretrained",
    "qlora",
    "save_pretrained",
]
