"""FP8 GEMM with delayed scaling (fp8-hybrid): y = x @ w, E4M3 forward, E5M2 gradients.

Shapes and dtypes:
  x [..., K] (float32 / bfloat16 / float16), w [K, N] (same choices), state: an
  `Fp8MatmulState` (surogate_jax.ops.fp8_formats) with scalar scales -> y [..., N] in `out_dtype`
  (default x.dtype). dx comes back in x.dtype, dw in w.dtype.

Math (s_x, s_w, s_g the state's PREVIOUS scales; Q4 / Q5 = saturating round-to-nearest-even
casts to E4M3 / E5M2, see precision/fp8_formats.quantize):
  forward   xq = Q4(x s_x), wq = Q4(w s_w);  y = (xq @ wq) / (s_x s_w)
  backward  gq = Q5(dy s_g);  dx = (gq @ wq^T) / (s_g s_w);  dw = (xq^T @ gq) / (s_x s_g)
every GEMM accumulating in fp32 and rounding once to its output dtype. The gradient w.r.t. the
state carries this step's amaxes: d(state).x.scale = max|x|, .w.scale = max|w|, .g.scale =
max|dy| (max over all data shards), histories 0; `precision.fp8.update` turns them into the next
state (the module docstring of precision/fp8.py explains this design).

Implementations (`impl`):
  "ref"  pure JAX: the same quantization, dequantized operands and an fp32 dot (the CPU path and
         the reference every test compares with);
  "xla"  the dequantize-dot pattern (convert to f8 -> convert to bf16 -> multiply by the scalar
         dequantization scale -> dot) that XLA's GPU GemmRewriter turns into a cuBLASLt FP8
         custom call (`__cublas$lt$matmul$f8`) on SM89+; XLA pads odd shapes itself. The scale it
         multiplies by is rounded to bf16 (a relative error <= 2^-9 per operand, far below E4M3's
         2^-4 step);
  "ffi"  our kernels: fused cast(+transpose)+amax (kernels/fp8_matmul.cu) feeding cuBLASLt FP8
         GEMMs with device-pointer scales (ffi/fp8_matmul.cc): forward with fast accumulation,
         dgrad and wgrad with split (fp32-promoted) accumulation, as Transformer Engine does.
         Needs K and N to be multiples of 16 (cuBLASLt FP8); M (rows) is free: the transposed
         copies are zero-padded to a multiple of 16 rows.
  None / "auto": on a GPU backend `DEFAULT_GPU_IMPL` ("ffi"; "xla" when the extension is not
         built or K or N is not a multiple of 16), the reference elsewhere (decided at trace time
         from jax.default_backend()).
`SUROGATE_JAX_OPS=ref` (or `ref:fp8_matmul`) forces the reference.

Frozen weights (`fp8_matmul_frozen`, used for the LoRA base by precision/recipe.py): w arrives
already in E4M3 with its own fixed scale (quantized once, current scaling), so the forward skips
the weight cast (the ffi path only transposes the f8 copy to the K-major layout cuBLASLt wants),
and the backward computes dx only: no wgrad GEMM and, on the ffi path, no transposed copy of x.
The ffi path transposes with our own byte-transpose kernel (`surogate_fp8_transpose`) rather than
jnp.transpose: on the H100 (Qwen3-8B LoRA, 2026-11-22) XLA's layout assignment turned the
per-layer jnp.transpose into transposed copies of the WHOLE stacked [L, K, N] cache hoisted out of
the layer scan (12 GB of temporaries at 8B), which a custom call on the per-layer slice prevents.

Known issues (H100 run of 2026-11-22, jax 0.11.2; see precision/fp8_formats.quantize):
  * XLA's GPU compiler folds convert chains (f32 -> f8 -> f32 / bf16 becomes one convert,
    SimplifyFPConversions under the default xla_allow_excess_precision), so before the fix in
    `quantize` the "ref" and "xla" paths on GPU sometimes skipped the FP8 rounding, depending on
    how XLA fused each GEMM: the "ref" path disagreed with float64 numpy by the full FP8 error,
    "xla y" and "ffi dw" (M = 1000) disagreed with "ref" by ~5%. The cuBLASLt handler and the
    quantizer kernels themselves matched bit-exact / dequantized-GEMM references in the same run,
    which is why the ffi wgrad was not changed. `quantize` now ends in an optimization barrier;
    to be confirmed on the GPU.
  * Whether XLA turns the "xla" pattern into FP8 GEMMs is still unconfirmed: that run's
    compiled program had no `__cublas$lt$matmul$f8` call (with the folding above the f8 operands
    had disappeared). tests/gpu/test_fp8_matmul_gpu.py::test_xla_backend_is_rewritten_to_fp8_gemms
    prints the GEMM instructions when it fails. Activations may be sharded along their leading
axis: given `mesh=`, the ffi and ref paths run per data shard through `on_shards` (w replicated, dw psum-ed,
amaxes max-reduced); the xla path is plain XLA and is partitioned by XLA itself. Under jax.vmap
the FFI calls run sequentially per batch element.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._loader import ffi_available, forced_ref, resolve_impl
from surogate_jax.ops._sharding import data_axes, on_shards
from surogate_jax.ops.fp8_formats import (
    E4M3,
    E5M2,
    Fp8MatmulState,
    amax,
    inverse_scale,
    quantize,
)

QUANT_TARGET = "surogate_fp8_quantize"
QUANT_T_TARGET = "surogate_fp8_quantize_t"
TRANSPOSE_TARGET = "surogate_fp8_transpose"
GEMM_TARGET = "surogate_fp8_matmul"
IMPLS = ("auto", "ffi", "xla", "ref")
DEFAULT_GPU_IMPL = "ffi"  # the faster backend on H100 (benchmarks/bench_fp8_matmul.py decides)
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
WORKSPACE_BYTES = 32 << 20  # cuBLASLt workspace (NVIDIA's recommendation for Hopper)
ALIGN = 16  # cuBLASLt FP8: reduction dims / leading dims multiples of 16


class _Cfg(NamedTuple):
    impl: str  # "ref" | "xla" | "ffi"
    out_dtype: jnp.dtype
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    frozen: bool = False  # w is already E4M3 (fp8_matmul_frozen): no weight cast, no dw
    w_nk: bool = False  # frozen w arrives as [N, K] (K-major, e.g. a QLoRA base's HF layout), not [K, N]
    mesh: Mesh | AbstractMesh | None = None  # ref/ffi: rows split over its data axes (on_shards); None: whole


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _scaled_dot_f32(a, b, dims, factor, out_dtype):
    """(f32(a) . f32(b)) * factor, fp32 accumulation, rounded once to out_dtype."""
    acc = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (dims, ((), ())),
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (acc * factor).astype(out_dtype)


def _max_of(v):
    return jnp.max(v) if v.size else jnp.zeros((), jnp.float32)


# ------------------------------------------------------------------------------------------
# Reference (pure JAX): the formulas of the module docstring.


def fp8_matmul_ref(x: jax.Array, w: jax.Array, state: Fp8MatmulState, out_dtype=None) -> jax.Array:
    """Forward formula: ((Q4(x s_x) @ Q4(w s_w)) / (s_x s_w)) in fp32, rounded to out_dtype."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    xq = quantize(x, state.x.scale, E4M3)
    wq = quantize(w, state.w.scale, E4M3)
    f = inverse_scale(state.x.scale) * inverse_scale(state.w.scale)
    return _scaled_dot_f32(xq, wq, ((x.ndim - 1,), (0,)), f, out_dtype)


def fp8_matmul_grads_ref(x, w, dy, state: Fp8MatmulState):
    """Backward formulas: (dx in x.dtype, dw in w.dtype, amaxes {"x", "w", "g"})."""
    xq = quantize(x, state.x.scale, E4M3).reshape(-1, x.shape[-1])
    wq = quantize(w, state.w.scale, E4M3)
    gq = quantize(dy, state.g.scale, E5M2).reshape(-1, w.shape[1])
    ix, iw, ig = (inverse_scale(s) for s in (state.x.scale, state.w.scale, state.g.scale))
    dx = _scaled_dot_f32(gq, wq, ((1,), (1,)), ig * iw, x.dtype).reshape(x.shape)
    dw = _scaled_dot_f32(xq, gq, ((0,), (0,)), ix * ig, w.dtype)
    return dx, dw, {"x": amax(x), "w": amax(w), "g": amax(dy)}


def _w_q(w, scales, cfg):
    """(E4M3 weight, its observed amax): cast with the delayed scale, or the frozen cache as is
    (whose amax is not observed: the cache has its own fixed scale)."""
    if cfg.frozen:
        return w, jnp.zeros((), jnp.float32)
    return quantize(w, scales[1], E4M3), amax(w)


def _fwd_ref(x2, w, scales, cfg):
    wq, amax_w = _w_q(w, scales, cfg)
    inv = inverse_scale(scales)

    def local(x2, wq, inv, scales):
        xq = quantize(x2, scales[0], E4M3)
        y = _scaled_dot_f32(xq, wq, ((1,), (1 if cfg.w_nk else 0,)), inv[0] * inv[1], cfg.out_dtype)
        return y, xq, amax(x2)[None]

    y, xq, ax = on_shards(local, x2, wq, inv, scales, mesh=cfg.mesh, batched=(True, False, False, False),
                          out_batched=(True, True, True))
    return y, (xq, wq, scales, jnp.stack([_max_of(ax), amax_w]))


def _bwd_ref(res, dy, cfg):
    xq, wq, scales, amax_xw = res
    inv = inverse_scale(scales)
    dw_dtype = jnp.float32  # per-shard partial sums stay fp32 until the psum
    if cfg.frozen:
        def local_dx(dy, wq, inv, scales):
            gq = quantize(dy, scales[2], E5M2)
            # an [N, K] weight is transposed to [K, N] first (the barrier keeps it a copy), so dx is the very dot
            # of the [K, N] layout: XLA:CPU's loop order, and so the fp32 sums, do not depend on the cache layout
            w_kn = jax.lax.optimization_barrier(wq.T) if cfg.w_nk else wq
            return _scaled_dot_f32(gq, w_kn, ((1,), (1,)), inv[2] * inv[1], cfg.x_dtype), amax(dy)[None]

        dx, ag = on_shards(local_dx, dy, wq, inv, scales, mesh=cfg.mesh, batched=(True, False, False, False),
                           out_batched=(True, True))
        return dx, None, jnp.concatenate([amax_xw, _max_of(ag)[None]])

    def local(dy, xq, wq, inv, scales):
        gq = quantize(dy, scales[2], E5M2)
        dx = _scaled_dot_f32(gq, wq, ((1,), (1,)), inv[2] * inv[1], cfg.x_dtype)
        dw = _scaled_dot_f32(xq, gq, ((0,), (0,)), inv[0] * inv[2], dw_dtype)
        return dx, dw, amax(dy)[None]

    dx, dw, ag = on_shards(local, dy, xq, wq, inv, scales, mesh=cfg.mesh, batched=(True, True, False, False, False),
                           out_batched=(True, False, True), out_summed=(False, True, False))
    return dx, dw.astype(cfg.w_dtype), jnp.concatenate([amax_xw, _max_of(ag)[None]])


# ------------------------------------------------------------------------------------------
# "xla": the dequantize-dot pattern for XLA's FP8 GEMM rewriter.


def _dequant_bf16(q, scale):
    # convert(f8 -> bf16) * broadcast(scalar): the operand pattern GemmRewriter folds into the GEMM
    return q.astype(jnp.bfloat16) * inverse_scale(scale).astype(jnp.bfloat16)


def _fwd_xla(x2, w, scales, cfg):
    xq = quantize(x2, scales[0], E4M3)
    wq, amax_w = _w_q(w, scales, cfg)
    y = jax.lax.dot_general(_dequant_bf16(xq, scales[0]), _dequant_bf16(wq, scales[1]),
                            (((1,), (1 if cfg.w_nk else 0,)), ((), ())), preferred_element_type=cfg.out_dtype)
    return y, (xq, wq, scales, jnp.stack([amax(x2), amax_w]))


def _bwd_xla(res, dy, cfg):
    xq, wq, scales, amax_xw = res
    gq = quantize(dy, scales[2], E5M2)
    g = _dequant_bf16(gq, scales[2])
    dx = jax.lax.dot_general(g, _dequant_bf16(wq, scales[1]), (((1,), (0 if cfg.w_nk else 1,)), ((), ())),
                             preferred_element_type=cfg.x_dtype)
    if cfg.frozen:
        return dx, None, jnp.concatenate([amax_xw, amax(dy)[None]])
    dw = jax.lax.dot_general(_dequant_bf16(xq, scales[0]), g, (((0,), (0,)), ((), ())),
                             preferred_element_type=cfg.w_dtype)
    return dx, dw, jnp.concatenate([amax_xw, amax(dy)[None]])


# ------------------------------------------------------------------------------------------
# "ffi": fused quantizers + cuBLASLt through XLA FFI.


def _quantize_ffi(x2, scale, dtype, transposed: bool):
    """(q [R, C], qt [C, round_up(R, 16)] or None, amax f32[]) of x2 [R, C]."""
    rows, cols = x2.shape
    q = jax.ShapeDtypeStruct(x2.shape, dtype)
    a = jax.ShapeDtypeStruct((), jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    if not transposed:
        q_, a_ = jax.ffi.ffi_call(QUANT_TARGET, (q, a), vmap_method="sequential")(x2, scale)
        return q_, None, a_
    qt = jax.ShapeDtypeStruct((cols, _round_up(rows, ALIGN)), dtype)
    return jax.ffi.ffi_call(QUANT_T_TARGET, (q, qt, a), vmap_method="sequential")(x2, scale)


def _transpose_ffi(x2, ld_t: int | None = None):
    """qt [C, ld_t] with qt[c, r] = x2[r, c] and zeros for r >= R, for an fp8 x2 [R, C] (either
    format; bytes copied as they are). ld_t defaults to R. Our kernel, not jnp.transpose, so that
    XLA cannot hoist the transpose out of a layer scan (module docstring, "Frozen weights")."""
    rows, cols = x2.shape
    ld_t = rows if ld_t is None else int(ld_t)
    if ld_t < rows:
        raise ValueError(f"_transpose_ffi: ld_t={ld_t} < rows={rows}")
    out = jax.ShapeDtypeStruct((cols, ld_t), x2.dtype)
    return jax.ffi.ffi_call(TRANSPOSE_TARGET, out, vmap_method="sequential")(x2)


def _gemm_ffi(a, b, a_inv, b_inv, out_dtype, fast_accum: bool):
    """d [M, N] = (a [M, K] a_inv) (b [N, K] b_inv)^T through cuBLASLt (fp32 accumulation)."""
    m = math.prod(a.shape[:-1])
    n = math.prod(b.shape[:-1])
    out = (jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8))
    d, _ = jax.ffi.ffi_call(GEMM_TARGET, out, vmap_method="sequential")(
        a, b, jnp.asarray(a_inv, jnp.float32), jnp.asarray(b_inv, jnp.float32),
        fast_accum=np.int32(1 if fast_accum else 0))
    return d


def _fwd_ffi(x2, w, scales, cfg):
    inv = inverse_scale(scales)
    if cfg.frozen:  # the cached E4M3 weight [K, N]; the forward GEMM wants it K-major: one f8 transpose
        wq_t = w if cfg.w_nk else _transpose_ffi(w)  # wq_t [N, K]
        wq, amax_w = w, jnp.zeros((), jnp.float32)  # the residual is w as given
    else:
        wq, wq_t, amax_w = _quantize_ffi(w, scales[1], E4M3, transposed=True)  # wq_t [N, K]

    def local(x2, wq_t, inv, scales):
        if cfg.frozen:  # no wgrad: the transposed copy of x is not needed
            xq, _, ax = _quantize_ffi(x2, scales[0], E4M3, transposed=False)
            xq_t = jnp.zeros((1, 1), E4M3)
        else:
            xq, xq_t, ax = _quantize_ffi(x2, scales[0], E4M3, transposed=True)  # xq_t [K, Mp]
        y = _gemm_ffi(xq, wq_t, inv[0], inv[1], cfg.out_dtype, fast_accum=True)
        return y, xq_t[None], ax[None]

    y, xq_t, ax = on_shards(local, x2, wq_t, inv, scales, mesh=cfg.mesh, batched=(True, False, False, False),
                            out_batched=(True, True, True))
    return y, (xq_t, wq, scales, jnp.stack([jnp.max(ax), amax_w]))


def _bwd_ffi(res, dy, cfg):
    xq_t, wq, scales, amax_xw = res
    inv = inverse_scale(scales)
    dw_dtype = jnp.float32 if data_axes(cfg.mesh) else cfg.w_dtype  # fp32 partials when psum-ed
    if cfg.frozen:
        def local_dx(dy, wq, inv, scales):
            gq, _, ag = _quantize_ffi(dy, scales[2], E5M2, transposed=False)
            return _gemm_ffi(gq, wq, inv[2], inv[1], cfg.x_dtype, fast_accum=False), ag[None]

        if cfg.w_nk:  # dx = gq @ w wants w [N, K] as the GEMM's [K, N] operand: transposed here, not saved
            wq = _transpose_ffi(wq)
        dx, ag = on_shards(local_dx, dy, wq, inv, scales, mesh=cfg.mesh, batched=(True, False, False, False),
                           out_batched=(True, True))
        return dx, None, jnp.concatenate([amax_xw, jnp.max(ag)[None]])

    def local(dy, xq_t, wq, inv, scales):
        gq, gq_t, ag = _quantize_ffi(dy, scales[2], E5M2, transposed=True)  # gq_t [N, Mp]
        dx = _gemm_ffi(gq, wq, inv[2], inv[1], cfg.x_dtype, fast_accum=False)  # [M, K]
        dw = _gemm_ffi(xq_t[0], gq_t, inv[0], inv[2], dw_dtype, fast_accum=False)  # [K, N]
        return dx, dw, ag[None]

    dx, dw, ag = on_shards(local, dy, xq_t, wq, inv, scales, mesh=cfg.mesh, batched=(True, True, False, False, False),
                           out_batched=(True, False, True), out_summed=(False, True, False))
    return dx, dw.astype(cfg.w_dtype), jnp.concatenate([amax_xw, jnp.max(ag)[None]])


_FWD = {"ref": _fwd_ref, "xla": _fwd_xla, "ffi": _fwd_ffi}
_BWD = {"ref": _bwd_ref, "xla": _bwd_xla, "ffi": _bwd_ffi}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_mm(x2, w, scales, cfg):
    return _FWD[cfg.impl](x2, w, scales, cfg)[0]


def _fp8_mm_fwd(x2, w, scales, cfg):
    return _FWD[cfg.impl](x2, w, scales, cfg)


def _fp8_mm_bwd(cfg, res, dy):
    return _BWD[cfg.impl](res, dy, cfg)


_fp8_mm.defvjp(_fp8_mm_fwd, _fp8_mm_bwd)


# ------------------------------------------------------------------------------------------
# Public op.


def _forced_ref() -> bool:
    """SUROGATE_JAX_OPS=ref or ref:fp8_matmul (the same switch as every other op's)."""
    return forced_ref("fp8_matmul")


def resolve_fp8_impl(impl: str | None, k: int | None = None, n: int | None = None) -> str:
    """The backend ("ref" / "xla" / "ffi") a call with these GEMM dims traces."""
    impl = "auto" if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"fp8_matmul: impl must be one of {IMPLS} or None, got {impl!r}")
    if _forced_ref() or impl == "ref":
        return "ref"
    aligned = k is None or (k % ALIGN == 0 and n % ALIGN == 0)
    if impl == "ffi":
        resolve_impl("ffi")  # raises when the extension is unavailable
        if not aligned:
            raise ValueError(f"fp8_matmul: impl='ffi' (cuBLASLt FP8) needs K and N to be multiples of "
                             f"{ALIGN}, got K={k}, N={n}; use impl='xla' (XLA pads) for such shapes")
        return "ffi"
    if impl == "xla":
        return "xla"
    if jax.default_backend() != "gpu":
        return "ref"
    if DEFAULT_GPU_IMPL == "ffi" and aligned and ffi_available():
        return "ffi"
    return "xla"


def fp8_matmul(x: jax.Array, w: jax.Array, state: Fp8MatmulState, *, impl: str | None = None,
               out_dtype=None, mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """y [..., N] = x [..., K] @ w [K, N] in FP8 with delayed scaling (see the module docstring).

    Differentiate w.r.t. `state` too to get this step's amaxes (precision.fp8.update). mesh: the
    ref and ffi paths split x's rows over its data axes (ops/_sharding.py; None: one call). The
    output is tagged `checkpoint_name(y, "fp8_matmul")` for remat policies.
    """
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul: need x [..., K] and w [K, N], got x {x.shape} and w {w.shape}")
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) not in KERNEL_DTYPES:
            raise TypeError(f"fp8_matmul: {name} must be float32, bfloat16 or float16, got {a.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"fp8_matmul: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    for t in ("x", "w", "g"):
        if jnp.shape(getattr(state, t).scale) != ():
            raise ValueError(f"fp8_matmul: state.{t}.scale must be a scalar (index stacked states "
                             f"per layer first), got shape {jnp.shape(getattr(state, t).scale)}")
    k, n = w.shape
    resolved = resolve_fp8_impl(impl, k, n)
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0 or n == 0 or k == 0:
        resolved = "ref"
    scales = jnp.stack([state.x.scale, state.w.scale, state.g.scale]).astype(jnp.float32)
    cfg = _Cfg(resolved, out_dtype, jnp.dtype(x.dtype), jnp.dtype(w.dtype), mesh=mesh)
    y = _fp8_mm(x2, w, scales, cfg).reshape(*x.shape[:-1], n)
    return checkpoint_name(y, "fp8_matmul")


def fp8_matmul_frozen(x: jax.Array, wq: jax.Array, w_scale: jax.Array, state: Fp8MatmulState, *,
                      impl: str | None = None, out_dtype=None, mesh: Mesh | AbstractMesh | None = None,
                      w_layout: str = "kn") -> jax.Array:
    """y [..., N] = x [..., K] @ (wq / w_scale) for a FROZEN weight cached in E4M3.

    wq: float8_e4m3fn [K, N] quantized once (q = saturate(w * w_scale), e.g. current scaling
    w_scale = 448 / max|w|, precision.recipe.cache_frozen_weights); w_scale: f32 scalar. The
    activation x and the gradient dY use the delayed scales of `state` exactly as in
    `fp8_matmul`; the weight is neither cast (its state.w is unused, its observed amax reported
    as 0) nor differentiated: the backward computes dx only (no wgrad GEMM and on the ffi path no
    transposed copy of x). dx comes back in x.dtype. mesh: as for `fp8_matmul`.
    w_layout "nk": wq is [N, K] instead (a QLoRA base dequantized in its HF layout), the forward GEMM's own
    K-major layout: the ffi path transposes it only in the backward, for dx."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"fp8_matmul_frozen: w_layout must be 'kn' or 'nk', got {w_layout!r}")
    nk = w_layout == "nk"
    if wq.ndim != 2 or x.ndim < 1 or x.shape[-1] != wq.shape[1 if nk else 0]:
        want = "wq [N, K]" if nk else "wq [K, N]"
        raise ValueError(f"fp8_matmul_frozen: need x [..., K] and {want}, got x {x.shape} and wq {wq.shape}")
    if jnp.dtype(wq.dtype) != jnp.dtype(E4M3):
        raise TypeError(f"fp8_matmul_frozen: wq must be float8_e4m3fn (pre-quantized), got {wq.dtype}")
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        raise TypeError(f"fp8_matmul_frozen: x must be float32, bfloat16 or float16, got {x.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"fp8_matmul_frozen: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if jnp.shape(w_scale) != ():
        raise ValueError(f"fp8_matmul_frozen: w_scale must be a scalar, got shape {jnp.shape(w_scale)}")
    n, k = wq.shape if nk else wq.shape[::-1]
    resolved = resolve_fp8_impl(impl, k, n)
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0 or n == 0 or k == 0:
        resolved = "ref"
    scales = jnp.stack([jnp.asarray(state.x.scale, jnp.float32), jnp.asarray(w_scale, jnp.float32),
                        jnp.asarray(state.g.scale, jnp.float32)])
    cfg = _Cfg(resolved, out_dtype, jnp.dtype(x.dtype), jnp.dtype(E4M3), frozen=True, mesh=mesh, w_nk=nk)
    y = _fp8_mm(x2, wq, scales, cfg).reshape(*x.shape[:-1], n)
    return checkpoint_name(y, "fp8_matmul")
