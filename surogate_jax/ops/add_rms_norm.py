"""Fused residual add + RMSNorm: (y, s) = (rms_norm(s, w), s) with s = x + residual.

The pre-norm decoder's `x = x + attn(h); h = norm(x)` in one kernel: it reads the block output x
and the residual stream and writes the new residual stream s and the normalized h, instead of an
add (read 2, write 1) followed by a norm (read 1, write 1).

Shapes and dtypes:
  x [..., D], residual [..., D] (float32 / bfloat16 / float16, promoted to one dtype), w [D]
  -> y [..., D], s [..., D] in that dtype.
  s = round(x + residual) to the dtype, exactly what the unfused `x + residual` gives; the norm
  then runs in float32 on the rounded s and y is rounded once (rstd [...] float32 is saved).
  The public op casts w to the activation dtype first; dw flows back through the cast.

Backward (per row, fp32; shat = s * rstd, g = dy * w, ds = incoming gradient of s):
  dx = dresidual = rstd * (g - shat * mean(g * shat)) + ds
  dw = sum over all rows of dy * shat

Implementations: `add_rms_norm_ref` (pure jnp, autodiff-able), the FFI kernels
`surogate_add_rms_norm_fwd/bwd` (kernels/add_rms_norm.cu via ffi/add_rms_norm.cc), and the public
`add_rms_norm`, a `jax.custom_vjp` picking one of them (see ops/_loader.py for `impl`). Outputs
are tagged `checkpoint_name(y, "add_rms_norm")` and `checkpoint_name(s, "residual")`.
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
from surogate_jax.ops.rms_norm import WS_BLOCKS, rms_norm_ref
from surogate_jax.ops.rms_norm import _fwd_ref as _rms_fwd_ref

OP = "add_rms_norm"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
FWD_TARGET = "surogate_add_rms_norm_fwd"
BWD_TARGET = "surogate_add_rms_norm_bwd"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def add_rms_norm_ref(x: jax.Array, residual: jax.Array, w: jax.Array, eps: float = 1e-6):
    """Reference: s = x + residual rounded to the common dtype; returns (rms_norm_ref(s, w), s)."""
    dtype = jnp.result_type(x, residual)
    s = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(dtype)
    return rms_norm_ref(s, w, eps), s


# --- reference formulas in the kernels' fwd/bwd form (residuals: s, rstd [...] float32) ---


def _fwd_ref(x, res, w, eps):
    s = (x.astype(jnp.float32) + res.astype(jnp.float32)).astype(x.dtype)
    y, rstd = _rms_fwd_ref(s, w, eps)
    return y, s, rstd


def _bwd_ref(dy, ds, s, w, rstd):
    """Norm gradient kept in fp32 until ds is added, rounded once (what the kernel does)."""
    r = rstd[..., None]
    shat = s.astype(jnp.float32) * r
    dyf = dy.astype(jnp.float32)
    g = dyf * w.astype(jnp.float32)
    dx = r * (g - shat * jnp.mean(g * shat, axis=-1, keepdims=True)) + ds.astype(jnp.float32)
    dw = jnp.sum((dyf * shat).reshape(-1, s.shape[-1]), axis=0)
    return dx.astype(s.dtype), dw.astype(w.dtype)


# --- the CUDA kernels through XLA FFI (every operand in one dtype) ---
# vmap_method="broadcast_all": as for rms_norm, w gets the batch axis in front and the handler
# normalizes each batch element's rows with its own w row (and sums dw per batch element).


def _fwd_ffi(x, res, w, eps):
    out = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32),
    )
    call = jax.ffi.ffi_call(FWD_TARGET, out, vmap_method="broadcast_all")
    return call(x, res, w, eps=np.float32(eps))


def _bwd_ffi(dy, ds, s, w, rstd):
    rows = int(np.prod(s.shape[:-1]))
    ws = jax.ShapeDtypeStruct((max(1, min(rows, WS_BLOCKS)), s.shape[-1]), jnp.float32)
    out = (jax.ShapeDtypeStruct(s.shape, s.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype), ws)
    call = jax.ffi.ffi_call(BWD_TARGET, out, vmap_method="broadcast_all")
    dx, dw, _ = call(dy.astype(s.dtype), ds.astype(s.dtype), s, w, rstd)
    return dx, dw



def _fwd(x, res, w, eps, impl, mesh):
    ref = functools.partial(_fwd_ref, eps=eps)
    if x.size == 0:
        return ref(x, res, w)
    fn = pick(impl, functools.partial(_fwd_ffi, eps=eps), ref, OP, "fwd")
    return on_shards(fn, x, res, w, mesh=mesh, batched=(True, True, False), out_batched=(True, True, True))


def _bwd(dy, ds, s, w, rstd, impl, mesh):
    if s.size == 0:
        return _bwd_ref(dy, ds, s, w, rstd)
    fn = pick(impl, _bwd_ffi, _bwd_ref, OP, "bwd")
    return on_shards(fn, dy, ds, s, w, rstd, mesh=mesh, batched=(True, True, True, False, True),
                     out_batched=(True, False), out_summed=(False, True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _add_rms_norm(x, res, w, eps, impl, mesh):
    y, s, _ = _fwd(x, res, w, eps, impl, mesh)
    return y, s


def _add_rms_norm_vjp_fwd(x, res, w, eps, impl, mesh):
    y, s, rstd = _fwd(x, res, w, eps, impl, mesh)
    return (y, s), (s, w, rstd)


def _add_rms_norm_vjp_bwd(eps, impl, mesh, saved, cts):
    del eps
    s, w, rstd = saved
    dy, ds = cts
    dx, dw = _bwd(dy, ds, s, w, rstd, impl, mesh)
    return dx, dx, dw


_add_rms_norm.defvjp(_add_rms_norm_vjp_fwd, _add_rms_norm_vjp_bwd)


def add_rms_norm(
    x: jax.Array, residual: jax.Array, w: jax.Array, eps: float = 1e-6, *, impl: str | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (rms_norm(s, w, eps), s) with s = x + residual, for x, residual [..., D], w [D].

    impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; the environment
    variable SUROGATE_JAX_OPS=ref forces the reference. mesh: rows are split over its data axes
    (ops/_sharding.py; None: one call on the whole x). Outputs are tagged
    `checkpoint_name(y, "add_rms_norm")` and `checkpoint_name(s, "residual")`.
    """
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {x.shape} and residual {residual.shape} must have one shape")
    if x.ndim < 1 or w.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: w must have shape {x.shape[-1:]} for x {x.shape}, got {w.shape}")
    dtype = jnp.result_type(x, residual)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"add_rms_norm: x and residual must be floating point, got {dtype}")
    impl = resolve_impl(impl, OP)
    if impl != "ref" and dtype not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"add_rms_norm: impl='ffi' supports float32/bfloat16/float16, got {dtype}")
        impl = "ref"
    y, s = _add_rms_norm(x.astype(dtype), residual.astype(dtype), w.astype(dtype), float(eps), impl, mesh)
    return checkpoint_name(y, "add_rms_norm"), checkpoint_name(s, "residual")
