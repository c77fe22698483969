"""RoPE (HF "rotate half" convention), optionally fused with the per-head RMSNorm in front of it
(Qwen3's q_norm / k_norm).

Shapes and dtypes:
  rope(x [..., H, K], positions [...], inv_freq [K/2])          angles from positions
  rope(x [..., H, K], table=(cos [..., S], sin [..., S]))       angles from fp32 tables, S >= K/2
  optional norm_w [K] (+ eps): x is RMS-normalized over K (per head) and scaled by norm_w first.
  x float32 / bfloat16 / float16 -> y of the same shape and dtype; positions int (cast to int32),
  inv_freq / tables cast to float32. "..." is any number of leading dims (usually [B, T]), and
  positions are per token, so packed rows whose positions restart per document are fine.
  With F = K/2 and, for token t and pair j < F, angle a = float32(positions[t]) * inv_freq[j]
  (cos/sin of it, or cos[t, j] / sin[t, j] from the tables: only the first F entries of a table
  row are read, so HF-style [..., K] tables with repeated halves work as they are):
    n = x                                      (no norm)
    n = x * rsqrt(mean_K(x^2) + eps) * norm_w  (norm)
    y[j]     = n[j] * cos(a) - n[j+F] * sin(a)
    y[j + F] = n[j+F] * cos(a) + n[j] * sin(a)
  computed in float32 and rounded once to x.dtype (the unfused model rounded the norm's output to
  x.dtype before the rotation; the fused op does not, which is at least as accurate).
  The public op casts norm_w to x.dtype first (the kernel takes one dtype; the gradient flows back
  through the cast, so the weight gradient arrives in norm_w's own dtype).

Backward (fp32), with R(a) the rotation above (R(a)^T = R(-a)):
  rotation only: dx = R(-a) dy   (the forward kernel run with `inverse`)
  norm:          g = R(-a) dy, rstd = rsqrt(mean_K(x^2) + eps) (recomputed from x), xhat = x * rstd
                 dx = rstd * (g*w - xhat * mean_K(g*w*xhat)),  dw = sum over all rows of g * xhat
  positions, inv_freq and the tables get no gradient (treated as constants).

Implementations: `rope_ref` (pure jnp, autodiff-able; the reference tests compare against), the
FFI kernels `surogate_rope_fwd/bwd` (kernels/rope_fwd.cu, rope_bwd.cu via ffi/rope.cc), and the public `rope`, a
`jax.custom_vjp` picking one of them (see ops/_loader.py for `impl`), run per data shard through
`on_shards` (x, positions and tables split along axis 0; inv_freq and norm_w replicated; the
weight gradient summed). The output is tagged `checkpoint_name(y, "rope")`.

`rope_qk(q, k, ...)` is the same op for a layer's q [..., Hq, K] and k [..., Hk, K] with shared
angles and one norm weight each: `surogate_rope_qk_fwd/bwd` run both in one kernel launch per
direction (blocks split between the tensors; the backward's two weight-gradient sums in one more
launch), so the small k tensor (8 MB at Qwen3-8B) does not pay a launch ramp of its own. The
models call it.
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

OP = "rope"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
FWD_TARGET = "surogate_rope_fwd"
BWD_TARGET = "surogate_rope_bwd"
QK_FWD_TARGET = "surogate_rope_qk_fwd"  # rope_qk: q and k of a layer in one launch each way
QK_BWD_TARGET = "surogate_rope_qk_bwd"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 1024  # the kernels keep a row in registers (kernels/rope.h rope_max_head_dim)
WS_BLOCKS = 1024


# --- shared formulas (fp32) ---


def _cos_sin(a, b, half):
    """(cos, sin) [..., F] float32 from (positions, inv_freq) or from (cos, sin) tables."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        ang = a.astype(jnp.float32)[..., None] * b.astype(jnp.float32)
        return jnp.cos(ang), jnp.sin(ang)
    return a[..., :half].astype(jnp.float32), b[..., :half].astype(jnp.float32)


def _rotate(xf, c, s):
    """R(a) x over the last axis (rotate half); c, s [..., F] broadcast over the heads axis."""
    half = xf.shape[-1] // 2
    c, s = c[..., None, :], s[..., None, :]
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _normalize(xf, w, eps):
    return xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * w.astype(
        jnp.float32
    )


def rope_ref(
    x: jax.Array,
    positions: jax.Array | None = None,
    inv_freq: jax.Array | None = None,
    *,
    table: tuple[jax.Array, jax.Array] | None = None,
    norm_w: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """Reference RoPE (+ optional per-head RMSNorm first): fp32 math, output in x.dtype.
    Arguments as for `rope`."""
    a, b = (positions, inv_freq) if table is None else table
    c, s = _cos_sin(a, b, x.shape[-1] // 2)
    xf = x.astype(jnp.float32)
    if norm_w is not None:
        xf = _normalize(xf, norm_w, eps)
    return _rotate(xf, c, s).astype(x.dtype)


# --- reference formulas in the kernels' fwd/bwd form (a, b = positions, inv_freq | cos, sin) ---


def _fwd_ref(x, a, b, w, *, eps, norm, inverse):
    c, s = _cos_sin(a, b, x.shape[-1] // 2)
    xf = x.astype(jnp.float32)
    if norm:
        xf = _normalize(xf, w, eps)
    return _rotate(xf, c, -s if inverse else s).astype(x.dtype)


def _bwd_ref(dy, x, a, b, w, *, eps):
    """Backward of the fused norm + rotation: (dx, dw)."""
    c, s = _cos_sin(a, b, x.shape[-1] // 2)
    g = _rotate(dy.astype(jnp.float32), c, -s)
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    xhat = xf * rstd
    gw = g * w.astype(jnp.float32)
    dx = rstd * (gw - xhat * jnp.mean(gw * xhat, axis=-1, keepdims=True))
    dw = jnp.sum((g * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


# --- the CUDA kernels through XLA FFI (w already in x.dtype; a zero-size w when not normed) ---
# vmap_method="broadcast_all": under vmap every operand gets the batch axis in front, so
# inv_freq / w become [V, ...] and the handler runs each batch element's tokens with its own rows
# (and sums dw per batch element), which is exactly the batched semantics.


def _fwd_ffi(x, a, b, w, *, eps, norm, inverse):
    call = jax.ffi.ffi_call(FWD_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all")
    return call(x, a, b, w, eps=np.float32(eps), norm=np.int32(norm), inverse=np.int32(inverse))


def _bwd_ffi(dy, x, a, b, w, *, eps):
    # Third output: fp32 dw partial sums, one row per block of the kernel's grid (at most
    # WS_BLOCKS blocks); XLA frees it right after the call.
    tokens = int(np.prod(x.shape[:-2]))
    ws = jax.ShapeDtypeStruct((max(1, min(tokens, WS_BLOCKS)), x.shape[-1]), jnp.float32)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype), ws)
    call = jax.ffi.ffi_call(BWD_TARGET, out, vmap_method="broadcast_all")
    dx, dw, _ = call(dy.astype(x.dtype), x, a, b, w, eps=np.float32(eps))
    return dx, dw



def _qk_fwd_ffi(q, k, a, b, wq, wk, *, eps, norm, inverse):
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype))
    call = jax.ffi.ffi_call(QK_FWD_TARGET, out, vmap_method="broadcast_all")
    return tuple(call(q, k, a, b, wq, wk, eps=np.float32(eps), norm=np.int32(norm), inverse=np.int32(inverse)))


def _qk_bwd_ffi(dyq, dyk, q, k, a, b, wq, wk, *, eps):
    # ws: both tensors' per-block dw partial sums (rows follow the paired launch's blocks).
    tokens = int(np.prod(q.shape[:-2]))
    ws = jax.ShapeDtypeStruct((max(2, min(2 * tokens, WS_BLOCKS)), q.shape[-1]), jnp.float32)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(wq.shape, wq.dtype), jax.ShapeDtypeStruct(wk.shape, wk.dtype), ws)
    call = jax.ffi.ffi_call(QK_BWD_TARGET, out, vmap_method="broadcast_all")
    dq, dk, dwq, dwk, _ = call(dyq.astype(q.dtype), dyk.astype(k.dtype), q, k, a, b, wq, wk, eps=np.float32(eps))
    return dq, dk, dwq, dwk


def _qk_fwd_ref(q, k, a, b, wq, wk, *, eps, norm, inverse):
    kw = {"eps": eps, "norm": norm, "inverse": inverse}
    return _fwd_ref(q, a, b, wq, **kw), _fwd_ref(k, a, b, wk, **kw)


def _qk_bwd_ref(dyq, dyk, q, k, a, b, wq, wk, *, eps):
    dq, dwq = _bwd_ref(dyq, q, a, b, wq, eps=eps)
    dk, dwk = _bwd_ref(dyk, k, a, b, wk, eps=eps)
    return dq, dk, dwq, dwk


def _by_positions(a) -> bool:
    return bool(jnp.issubdtype(a.dtype, jnp.integer))


# The reference also runs per shard (on_shards) so CPU tests on a multi-device mesh exercise the
# same split/psum wiring as the kernels. Batched (split) operands: x, dy, positions, the tables.
def _fwd(x, a, b, w, *, eps, norm, inverse, impl, mesh):
    kw = {"eps": eps, "norm": norm, "inverse": inverse}
    ref = functools.partial(_fwd_ref, **kw)
    if x.size == 0:
        return ref(x, a, b, w)
    fn = pick(impl, functools.partial(_fwd_ffi, **kw), ref, OP, "fwd")
    (y,) = on_shards(
        lambda *args: (fn(*args),), x, a, b, w, mesh=mesh,
        batched=(True, True, not _by_positions(a), False), out_batched=(True,),
    )
    return y


def _bwd(dy, x, a, b, w, *, eps, impl, mesh):
    ref = functools.partial(_bwd_ref, eps=eps)
    if x.size == 0:
        return ref(dy, x, a, b, w)
    fn = pick(impl, functools.partial(_bwd_ffi, eps=eps), ref, OP, "bwd")
    # dx is per row; dw sums over all rows, so the shards' partial dw are added.
    return on_shards(
        fn, dy, x, a, b, w, mesh=mesh,
        batched=(True, True, True, not _by_positions(a), False), out_batched=(True, False),
        out_summed=(False, True),
    )


def _no_norm_w(x):
    return jnp.zeros((0,), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rope(x, a, b, impl, mesh):
    return _fwd(x, a, b, _no_norm_w(x), eps=0.0, norm=False, inverse=False, impl=impl, mesh=mesh)


def _rope_vjp_fwd(x, a, b, impl, mesh):
    return _rope(x, a, b, impl, mesh), (a, b)


def _rope_vjp_bwd(impl, mesh, res, dy):
    a, b = res
    dx = _fwd(dy, a, b, _no_norm_w(dy), eps=0.0, norm=False, inverse=True, impl=impl, mesh=mesh)
    return dx, None, None


_rope.defvjp(_rope_vjp_fwd, _rope_vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _norm_rope(x, a, b, w, eps, impl, mesh):
    return _fwd(x, a, b, w, eps=eps, norm=True, inverse=False, impl=impl, mesh=mesh)


def _norm_rope_vjp_fwd(x, a, b, w, eps, impl, mesh):
    return _norm_rope(x, a, b, w, eps, impl, mesh), (x, a, b, w)


def _norm_rope_vjp_bwd(eps, impl, mesh, res, dy):
    x, a, b, w = res
    dx, dw = _bwd(dy, x, a, b, w, eps=eps, impl=impl, mesh=mesh)
    return dx, None, None, dw


_norm_rope.defvjp(_norm_rope_vjp_fwd, _norm_rope_vjp_bwd)


def _qk_fwd(q, k, a, b, wq, wk, *, eps, norm, inverse, impl, mesh):
    kw = {"eps": eps, "norm": norm, "inverse": inverse}
    ref = functools.partial(_qk_fwd_ref, **kw)
    if q.size == 0 or k.size == 0:
        return ref(q, k, a, b, wq, wk)
    fn = pick(impl, functools.partial(_qk_fwd_ffi, **kw), ref, OP, "fwd")
    pos = _by_positions(a)
    return on_shards(fn, q, k, a, b, wq, wk, mesh=mesh, batched=(True, True, True, not pos, False, False),
                     out_batched=(True, True))


def _qk_bwd(dyq, dyk, q, k, a, b, wq, wk, *, eps, impl, mesh):
    ref = functools.partial(_qk_bwd_ref, eps=eps)
    if q.size == 0 or k.size == 0:
        return ref(dyq, dyk, q, k, a, b, wq, wk)
    fn = pick(impl, functools.partial(_qk_bwd_ffi, eps=eps), ref, OP, "bwd")
    pos = _by_positions(a)
    return on_shards(
        fn, dyq, dyk, q, k, a, b, wq, wk, mesh=mesh,
        batched=(True, True, True, True, True, not pos, False, False), out_batched=(True, True, False, False),
        out_summed=(False, False, True, True),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rope_qk(q, k, a, b, impl, mesh):
    return _qk_fwd(q, k, a, b, _no_norm_w(q), _no_norm_w(k), eps=0.0, norm=False, inverse=False, impl=impl,
                   mesh=mesh)


def _rope_qk_vjp_fwd(q, k, a, b, impl, mesh):
    return _rope_qk(q, k, a, b, impl, mesh), (a, b)


def _rope_qk_vjp_bwd(impl, mesh, res, dys):
    a, b = res
    dyq, dyk = dys
    dq, dk = _qk_fwd(dyq, dyk, a, b, _no_norm_w(dyq), _no_norm_w(dyk), eps=0.0, norm=False, inverse=True, impl=impl,
                     mesh=mesh)
    return dq, dk, None, None


_rope_qk.defvjp(_rope_qk_vjp_fwd, _rope_qk_vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _norm_rope_qk(q, k, a, b, wq, wk, eps, impl, mesh):
    return _qk_fwd(q, k, a, b, wq, wk, eps=eps, norm=True, inverse=False, impl=impl, mesh=mesh)


def _norm_rope_qk_vjp_fwd(q, k, a, b, wq, wk, eps, impl, mesh):
    return _norm_rope_qk(q, k, a, b, wq, wk, eps, impl, mesh), (q, k, a, b, wq, wk)


def _norm_rope_qk_vjp_bwd(eps, impl, mesh, res, dys):
    q, k, a, b, wq, wk = res
    dq, dk, dwq, dwk = _qk_bwd(dys[0], dys[1], q, k, a, b, wq, wk, eps=eps, impl=impl, mesh=mesh)
    return dq, dk, None, None, dwq, dwk


_norm_rope_qk.defvjp(_norm_rope_qk_vjp_fwd, _norm_rope_qk_vjp_bwd)


def _angles(name, x, positions, inv_freq, table):
    """Validated (a, b) for the kernels: (int32 positions, f32 inv_freq) or (f32 cos, f32 sin)."""
    lead, K = x.shape[:-2], x.shape[-1]
    if table is None:
        if positions is None or inv_freq is None:
            raise ValueError(f"{name}: pass positions and inv_freq, or table=(cos, sin)")
        if positions.shape != lead or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"{name}: positions must be integers of shape {lead}, "
                             f"got {positions.dtype}{positions.shape}")
        if inv_freq.shape != (K // 2,):
            raise ValueError(f"{name}: inv_freq must have shape {(K // 2,)}, got {inv_freq.shape}")
        return positions.astype(jnp.int32), inv_freq.astype(jnp.float32)
    if positions is not None or inv_freq is not None:
        raise ValueError(f"{name}: pass either positions and inv_freq or table, not both")
    cos, sin = table
    if cos.shape != sin.shape or cos.shape[:-1] != lead or cos.ndim != len(lead) + 1 or cos.shape[-1] < K // 2:
        raise ValueError(
            f"{name}: table cos/sin must both have shape {lead} + (S,) with S >= {K // 2}, "
            f"got {cos.shape} and {sin.shape}"
        )
    return cos.astype(jnp.float32), sin.astype(jnp.float32)


def _check_x(name, what, x):
    if x.ndim < 2 or x.shape[-1] % 2:
        raise ValueError(f"{name}: {what} must be [..., heads, head_dim] with an even head_dim, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: {what} must be floating point, got {x.dtype}")


def _check_w(name, what, w, K):
    if w is not None and w.shape != (K,):
        raise ValueError(f"{name}: {what} must have shape {(K,)}, got {w.shape}")


def _impl_for(name, x, impl):
    impl = resolve_impl(impl, OP)
    K = x.shape[-1]
    if impl != "ref" and (x.dtype not in KERNEL_DTYPES or K > MAX_HEAD_DIM):
        if impl == "ffi":
            raise TypeError(
                f"{name}: impl='ffi' supports float32/bfloat16/float16 and head_dim <= {MAX_HEAD_DIM}, "
                f"got {x.dtype}, {K}"
            )
        impl = "ref"
    return impl


def rope(
    x: jax.Array,
    positions: jax.Array | None = None,
    inv_freq: jax.Array | None = None,
    *,
    table: tuple[jax.Array, jax.Array] | None = None,
    norm_w: jax.Array | None = None,
    eps: float = 1e-6,
    impl: str | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> jax.Array:
    """RoPE of x [..., H, K]: angles from `positions` [...] x `inv_freq` [K/2], or from
    `table=(cos, sin)` ([..., S] float32, S >= K/2). With `norm_w` [K], RMSNorm over K (eps) first.

    impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; the environment
    variable SUROGATE_JAX_OPS=ref forces the reference. mesh: tokens are split over its data axes
    (ops/_sharding.py; None: one call on the whole x). Returns x.dtype, tagged
    `checkpoint_name(y, "rope")` for remat policies.
    """
    _check_x("rope", "x", x)
    a, b = _angles("rope", x, positions, inv_freq, table)
    _check_w("rope", "norm_w", norm_w, x.shape[-1])
    impl = _impl_for("rope", x, impl)
    if norm_w is None:
        y = _rope(x, a, b, impl, mesh)
    else:
        y = _norm_rope(x, a, b, norm_w.astype(x.dtype), float(eps), impl, mesh)
    return checkpoint_name(y, "rope")


def rope_qk(
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array | None = None,
    inv_freq: jax.Array | None = None,
    *,
    table: tuple[jax.Array, jax.Array] | None = None,
    norm_wq: jax.Array | None = None,
    norm_wk: jax.Array | None = None,
    eps: float = 1e-6,
    impl: str | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`rope` of a layer's q [..., Hq, K] and k [..., Hk, K] (same leading dims, dtype and K; the
    heads may differ): (rope(q, norm_w=norm_wq), rope(k, norm_w=norm_wk)) with the same angles,
    computed by one kernel launch forward and one (+ the weight gradients' sum) backward, so the
    small k tensor does not pay a launch ramp of its own. Give both norm weights or neither.
    Same impl and mesh rules and checkpoint name ("rope", on both outputs) as `rope`.
    """
    _check_x("rope_qk", "q", q)
    _check_x("rope_qk", "k", k)
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise ValueError(
            f"rope_qk: q {q.dtype}{q.shape} and k {k.dtype}{k.shape} must share dtype, leading dims and head_dim"
        )
    if (norm_wq is None) != (norm_wk is None):
        raise ValueError("rope_qk: pass both norm_wq and norm_wk, or neither")
    a, b = _angles("rope_qk", q, positions, inv_freq, table)
    K = q.shape[-1]
    _check_w("rope_qk", "norm_wq", norm_wq, K)
    _check_w("rope_qk", "norm_wk", norm_wk, K)
    impl = _impl_for("rope_qk", q, impl)
    if norm_wq is None:
        yq, yk = _rope_qk(q, k, a, b, impl, mesh)
    else:
        yq, yk = _norm_rope_qk(q, k, a, b, norm_wq.astype(q.dtype), norm_wk.astype(q.dtype), float(eps), impl, mesh)
    return checkpoint_name(yq, "rope"), checkpoint_name(yk, "rope")
