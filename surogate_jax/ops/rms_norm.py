"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w over the last axis.

Shapes and dtypes:
  x [..., D] (float32 / bfloat16 / float16), w [D] -> y [..., D] in x.dtype.
  The CUDA path computes in float32 and rounds y once; rstd [...] (float32) is saved for backward.
  The public op casts w to x.dtype first (the kernel takes one dtype; the gradient flows back
  through the cast, so dw arrives in w's own dtype).

Backward (per row, fp32; xhat = x * rstd, g = dy * w):
  dx = rstd * (g - xhat * mean(g * xhat))
  dw = sum over all rows of dy * xhat

Implementations: `rms_norm_ref` (pure jnp, autodiff-able; the reference tests compare against),
the FFI kernels `surogate_rms_norm_fwd/bwd` (kernels/rms_norm.cu via ffi/rms_norm.cc), and the
public `rms_norm`, a `jax.custom_vjp` that picks one of them (see ops/_loader.py for `impl`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._loader import pick, resolve_impl
from surogate_jax.ops._sharding import on_shards

OP = "rms_norm"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
FWD_TARGET = "surogate_rms_norm_fwd"
BWD_TARGET = "surogate_rms_norm_bwd"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
WS_BLOCKS = 1024


def rms_norm_ref(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Reference RMSNorm over the last axis: fp32 math, output in x.dtype."""
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (xf * rstd * w.astype(jnp.float32)).astype(x.dtype)


# --- reference formulas in the kernels' fwd/bwd form (residual: rstd [...], float32) ---


def _fwd_ref(x, w, eps):
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1) + eps)
    y = (xf * rstd[..., None] * w.astype(jnp.float32)).astype(x.dtype)
    return y, rstd


def _bwd_ref(dy, x, w, rstd):
    r = rstd[..., None]
    xhat = x.astype(jnp.float32) * r
    dyf = dy.astype(jnp.float32)
    g = dyf * w.astype(jnp.float32)
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dw = jnp.sum((dyf * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


# --- the CUDA kernels through XLA FFI (w already in x.dtype) ---
# vmap_method="broadcast_all": under vmap every operand gets the batch axis in front, so w becomes
# [B, D] and the handler normalizes each batch element's rows with its own w row (and sums dw per
# batch element), which is exactly the batched semantics.


def _fwd_ffi(x, w, eps):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
    call = jax.ffi.ffi_call(FWD_TARGET, out, vmap_method="broadcast_all")
    return call(x, w, eps=np.float32(eps))


def _bwd_ffi(dy, x, w, rstd):
    # Third output: fp32 dw partial sums, one row per block of the kernel's persistent grid (at
    # most WS_BLOCKS blocks, about 8 per H100 SM); XLA frees it right after the call.
    rows = int(np.prod(x.shape[:-1]))
    ws = jax.ShapeDtypeStruct((max(1, min(rows, WS_BLOCKS)), x.shape[-1]), jnp.float32)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype), ws)
    call = jax.ffi.ffi_call(BWD_TARGET, out, vmap_method="broadcast_all")
    dx, dw, _ = call(dy.astype(x.dtype), x, w, rstd)
    return dx, dw



# The reference also runs per shard (on_shards) so CPU tests on a multi-device mesh exercise the
# same split/psum wiring as the kernels.
def _fwd(x, w, eps, impl, mesh):
    ref = functools.partial(_fwd_ref, eps=eps)
    if x.size == 0:
        return ref(x, w)
    fn = pick(impl, functools.partial(_fwd_ffi, eps=eps), ref, OP, "fwd")
    return on_shards(fn, x, w, mesh=mesh, batched=(True, False), out_batched=(True, True))


def _bwd(dy, x, w, rstd, impl, mesh):
    if x.size == 0:
        return _bwd_ref(dy, x, w, rstd)
    fn = pick(impl, _bwd_ffi, _bwd_ref, OP, "bwd")
    # dx is per row; dw sums over all rows, so the shards' partial dw are added.
    return on_shards(fn, dy, x, w, rstd, mesh=mesh, batched=(True, True, False, True), out_batched=(True, False),
                     out_summed=(False, True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, w, eps, impl, mesh):
    return _fwd(x, w, eps, impl, mesh)[0]


def _rms_norm_vjp_fwd(x, w, eps, impl, mesh):
    y, rstd = _fwd(x, w, eps, impl, mesh)
    return y, (x, w, rstd)


def _rms_norm_vjp_bwd(eps, impl, mesh, res, dy):
    del eps
    x, w, rstd = res
    return _bwd(dy, x, w, rstd, impl, mesh)


_rms_norm.defvjp(_rms_norm_vjp_fwd, _rms_norm_vjp_bwd)


def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6, *, impl: str | None = None,
             mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """RMSNorm of x [..., D] with weight w [D]; returns x.dtype.

    impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; the environment
    variable SUROGATE_JAX_OPS=ref forces the reference. mesh: rows are split over its data axes
    (ops/_sharding.py; None: one call on the whole x). The output is tagged
    `checkpoint_name(y, "rms_norm")` for remat policies.
    """
    if x.ndim < 1 or w.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: w must have shape {x.shape[-1:]} for x {x.shape}, got {w.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rms_norm: x must be floating point, got {x.dtype}")
    impl = resolve_impl(impl, OP)
    if impl != "ref" and x.dtype not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"rms_norm: impl='ffi' supports float32/bfloat16/float16, got {x.dtype}")
        impl = "ref"
    y = _rms_norm(x, w.astype(x.dtype), float(eps), impl, mesh)
    return checkpoint_name(y, "rms_norm")
