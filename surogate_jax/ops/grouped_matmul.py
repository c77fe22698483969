"""Grouped matmul of MoE experts: rows sorted by expert, every row times its own expert's matrix.

Shapes and dtypes:
  grouped_matmul(x [N, K], w [E, K, M], group_sizes [E] int) -> y [N, M]
  y[r] = x[r] @ w[e] for the rows r of group e (transpose_w: w [E, M, K], the HF [out, in] layout, y[r] = x[r] @
  w[e]^T, what a dequantized frozen base comes as); the groups are consecutive runs in expert order
  (group e starts at sum(group_sizes[:e])); rows past sum(group_sizes) belong to no expert and are zero.
  x and w share one float dtype; the products accumulate in fp32 and y is rounded once to that dtype.

Backward (group_sizes get no gradient):
  dx[r] = dy[r] @ w[e]^T          (the same grouped GEMM, w read transposed)
  dw[e] = x_e^T @ dy_e            (a GEMM whose contraction runs over group e's rows; 0 for an empty group;
                                   transpose_w: dy_e^T @ x_e)

Implementations: `grouped_matmul_ref` (jax.lax.ragged_dot with fp32 accumulation), the FFI kernels
`surogate_grouped_matmul` / `surogate_grouped_matmul_dw` (kernels/grouped_matmul.cu via ffi/grouped_matmul.cc:
bf16, K and M multiples of 8; the sizes stay on the device), and the public `grouped_matmul`, a `jax.custom_vjp`
that picks one (ops/_loader.py). Why a kernel: XLA lowers ragged_dot on the GPU machine's jax 0.11.2 to a
zero-padded dense dot, 83x slower than one GEMM of the same FLOPs at Qwen3-30B-A3B's shapes
(benchmarks/bench_grouped_matmul.py). The op is row-local per group but not per row: callers that split rows over
devices run it inside their own per-shard region (models/moe.py), so it takes no mesh.

FP8 (the fp8-hybrid recipe on MoE experts), current scaling per tensor (s = fmt_max / max|t|; Q4 / Q5 saturating
round-to-nearest-even casts to E4M3 / E5M2, ops/fp8_formats.quantize):
  grouped_matmul_fp8_frozen(x [N, K], wq E4M3 [E, M, K], w_scale f32 [E], group_sizes) -> y [N, M] in x's dtype
      a frozen weight already in E4M3 (wq = Q4(w s_w[e]), HF [out, in] layout): y = (Q4(x s_x) @ wq[e]^T) /
      (s_x s_w[e]); backward dx = (Q5(dy s_g) @ wq[e]) / (s_g s_w[e]), no gradient for wq
  grouped_matmul_fp8(x [N, K], w [E, K, M], group_sizes) -> y [N, M]
      a trained weight, quantized per call with one scale per expert: the forward and dx as above; dw[e] =
      x_e^T @ dy_e from the unquantized x and dy (the bf16 weight-gradient kernel: it has no FP8 form)
Every product of two fp8 values is exact in fp32 and sums accumulate in fp32, so the reference (ragged_dot of the
quantized values in fp32) and the kernel (`surogate_grouped_matmul_fp8`: fp8 mma.sync, SM89+, K and M multiples
of 16) differ only in summation order. dx reads the weight K-major per row of dx: the kernel takes the byte
transpose of the whole [E * M, K] weight ([K, E, M], ops/fp8_matmul's transpose kernel) rather than a per-expert copy.
Speed (H200, 30B-A3B's up-projection, benchmarks/bench_grouped_matmul.py, commit 4d05255): the fp8 kernel alone
runs 0.85-0.92x the bf16 one (0.435 vs 0.370 ms: Hopper's fp8 mma.sync is no faster than its bf16 mma.sync; wgmma
would be needed), and with the per-call amax and cast of x (dy) the forward (dx) is 0.74x (0.61x) of the bf16 op:
FP8 here buys the recipe's numerics and the halved frozen experts, not speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops import fp8_formats
from surogate_jax.ops._loader import pick, resolve_impl, traced_impl

OP = "grouped_matmul"
FWD_TARGET = "surogate_grouped_matmul"
DW_TARGET = "surogate_grouped_matmul_dw"
FP8_TARGET = "surogate_grouped_matmul_fp8"


def grouped_matmul_ref(x: jax.Array, w: jax.Array, group_sizes: jax.Array, transpose_w: bool = False) -> jax.Array:
    """Reference: ragged_dot in fp32, rounded to x's dtype."""
    w = jnp.swapaxes(w, 1, 2) if transpose_w else w
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _offsets(group_sizes):
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])


def _fwd_ffi(x, w, group_sizes, w_nk: bool = False):
    m = w.shape[1] if w_nk else w.shape[2]
    call = jax.ffi.ffi_call(FWD_TARGET, jax.ShapeDtypeStruct((x.shape[0], m), x.dtype), vmap_method="sequential")
    return call(x, w, _offsets(group_sizes), w_nk=w_nk)


def _dw_ffi(x, dy, group_sizes, num_experts: int):
    out = jax.ShapeDtypeStruct((num_experts, x.shape[1], dy.shape[1]), x.dtype)
    return jax.ffi.ffi_call(DW_TARGET, out, vmap_method="sequential")(x, dy, _offsets(group_sizes))


def _bwd_ref(x, w, group_sizes, dy, transpose_w=False):
    dx, dw = jax.vjp(lambda a, b: grouped_matmul_ref(a, b, group_sizes, transpose_w), x, w)[1](dy)
    return dx, dw


def _bwd_ffi(x, w, group_sizes, dy, transpose_w=False):
    dx = _fwd_ffi(dy, w, group_sizes, w_nk=not transpose_w)
    dw = _dw_ffi(dy, x, group_sizes, w.shape[0]) if transpose_w else _dw_ffi(x, dy, group_sizes, w.shape[0])
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(x, w, group_sizes, impl, transpose_w):
    fwd = pick(impl, functools.partial(_fwd_ffi, w_nk=transpose_w),
               functools.partial(grouped_matmul_ref, transpose_w=transpose_w), OP, "fwd")
    return fwd(x, w, group_sizes)


def _vjp_fwd(x, w, group_sizes, impl, transpose_w):
    return _grouped_matmul(x, w, group_sizes, impl, transpose_w), (x, w, group_sizes)


def _vjp_bwd(impl, transpose_w, res, dy):
    x, w, group_sizes = res
    bwd = pick(impl, functools.partial(_bwd_ffi, transpose_w=transpose_w),
               functools.partial(_bwd_ref, transpose_w=transpose_w), OP, "bwd")
    dx, dw = bwd(x, w, group_sizes, dy.astype(x.dtype))
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped_matmul.defvjp(_vjp_fwd, _vjp_bwd)


def kernel_applies(x_shape, w_shape, dtype) -> bool:
    """Whether the CUDA kernel takes these operands (bf16; K and M multiples of 8; w [E, K, M] or [E, M, K])."""
    return jnp.dtype(dtype) == jnp.bfloat16 and all(d % 8 == 0 for d in (x_shape[1], w_shape[1], w_shape[2]))


def forward_impl(x_shape, w_shape, dtype) -> str:
    """What `grouped_matmul(impl=None)` traces for these operands' forward: "ref" (ragged_dot, which XLA may lower to a
    dense dot reading every group's weights), or "auto" / "ffi" (the kernel on CUDA: it reads only the weights of
    groups that have rows)."""
    impl = traced_impl(None, OP, "fwd")
    return impl if impl != "ref" and kernel_applies(x_shape, w_shape, dtype) else "ref"


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_w: bool = False,
                   impl: str | None = None) -> jax.Array:
    """y [N, M] = each row of x [N, K] times its group's w [E, K, M] (transpose_w: w [E, M, K], y = x @ w[e]^T);
    group_sizes [E] (int, on the device).

    impl: None/"auto" (the CUDA kernel on GPU where `kernel_applies`, else the reference), "ffi" or "ref";
    SUROGATE_JAX_OPS=ref forces the reference.
    """
    k_axis = 2 if transpose_w else 1
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[k_axis] or group_sizes.shape != w.shape[:1]:
        layout = "[E, M, K]" if transpose_w else "[E, K, M]"
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape} do not agree "
                         f"(x [N, K], w {layout}, group_sizes [E])")
    dtype = jnp.result_type(x, w)
    impl = resolve_impl(impl, OP)
    if impl != "ref" and not kernel_applies(x.shape, w.shape, dtype):
        if impl == "ffi":
            raise TypeError(f"grouped_matmul: impl='ffi' needs bfloat16 with K, M multiples of 8; got {dtype}, "
                            f"x {x.shape}, w {w.shape}")
        impl = "ref"
    return _grouped_matmul(x.astype(dtype), w.astype(dtype), group_sizes, impl, transpose_w)


# ------------------------------------------------------------------------------------------------
# FP8


def _fp8_gemm_ref(xq, wq, group_sizes, x_inv, w_inv, w_nek=False):
    """y [N, M] = (xq @ wq[e]^T) * x_inv * w_inv[e] in fp32, rounded to bf16; wq [E, M, K] (w_nek: [M, E, K])."""
    w = jnp.transpose(wq, (1, 0, 2)) if w_nek else wq
    y = jax.lax.ragged_dot(xq.astype(jnp.float32), jnp.swapaxes(w.astype(jnp.float32), 1, 2),
                           group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    row_expert = jnp.repeat(jnp.arange(w.shape[0]), group_sizes, total_repeat_length=xq.shape[0])
    return (y * (x_inv * w_inv[row_expert])[:, None]).astype(jnp.bfloat16)


def _fp8_gemm_ffi(xq, wq, group_sizes, x_inv, w_inv, w_nek=False):
    m = wq.shape[0] if w_nek else wq.shape[1]
    call = jax.ffi.ffi_call(FP8_TARGET, jax.ShapeDtypeStruct((xq.shape[0], m), jnp.bfloat16),
                            vmap_method="sequential")
    return call(xq, wq, _offsets(group_sizes), jnp.asarray(x_inv, jnp.float32).reshape(()),
                w_inv.astype(jnp.float32), w_nek=w_nek)


def _transposed(wq, impl):
    """wq [E, M, K] -> [K, E, M] (wq^T per expert, K-major for dx's GEMM)."""
    E, M, K = wq.shape
    if impl == "ref":
        return jnp.transpose(wq, (2, 0, 1))
    from surogate_jax.ops.fp8_matmul import _transpose_ffi

    def ffi(w):
        return _transpose_ffi(w.reshape(E * M, K)).reshape(K, E, M)

    return pick(impl, ffi, lambda w: jnp.transpose(w, (2, 0, 1)), OP, "bwd")(wq)


def _quantized(t, fmt):
    """(Q(t s), 1 / s) with s = fmt_max / max|t| (1 for an all-zero or non-finite tensor)."""
    s = fp8_formats.current_scale(fp8_formats.amax(t), fmt)
    return fp8_formats.quantize(t, s, fmt), 1.0 / s


def fp8_forward(x, wq, w_scale, group_sizes, impl):
    """y [N, M] (x's dtype) = x [N, K] times each row's frozen E4M3 wq [E, M, K] / w_scale (impl resolved)."""
    xq, x_inv = _quantized(x, fp8_formats.E4M3)
    gemm = pick(impl, _fp8_gemm_ffi, _fp8_gemm_ref, OP, "fwd")
    return gemm(xq, wq, group_sizes, x_inv, 1.0 / w_scale).astype(x.dtype)


def fp8_input_grad(dy, wq, w_scale, group_sizes, impl, dtype, *, wq_kn=None):
    """dx [N, K] in dtype = Q5(dy) times each row's wq[e] / w_scale (wq [E, M, K]; wq_kn: the same values already
    [E, K, M], read directly instead of transposing wq)."""
    gq, g_inv = _quantized(dy, fp8_formats.E5M2)
    nek = wq_kn is None
    gemm = pick(impl, functools.partial(_fp8_gemm_ffi, w_nek=nek), functools.partial(_fp8_gemm_ref, w_nek=nek), OP,
                "bwd")
    w = _transposed(wq, impl) if nek else wq_kn
    return gemm(gq, w, group_sizes, g_inv, 1.0 / w_scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_frozen(x, wq, w_scale, group_sizes, impl):
    return fp8_forward(x, wq, w_scale, group_sizes, impl)


def _fp8_frozen_fwd(x, wq, w_scale, group_sizes, impl):
    return fp8_forward(x, wq, w_scale, group_sizes, impl), (wq, w_scale, group_sizes)


def _fp8_frozen_bwd(impl, res, dy):
    wq, w_scale, group_sizes = res
    dx = fp8_input_grad(dy, wq, w_scale, group_sizes, impl, dy.dtype)  # y and so dy are in x's dtype
    return dx, jnp.zeros_like(wq), jnp.zeros_like(w_scale), np.zeros(group_sizes.shape, jax.dtypes.float0)


_fp8_frozen.defvjp(_fp8_frozen_fwd, _fp8_frozen_bwd)


def expert_scales(w: jax.Array, axes=(1, 2)) -> jax.Array:
    """E4M3 current scales of a stacked weight over `axes` (default: per expert of w [E, ...]; 448 / max|w_e|)."""
    return fp8_formats.current_scale(fp8_formats.amax(w, axis=axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_trained(x, w, group_sizes, impl):
    s = expert_scales(w)
    wq = fp8_formats.quantize(jnp.swapaxes(w, 1, 2), s[:, None, None], fp8_formats.E4M3)
    return fp8_forward(x, wq, s, group_sizes, impl)


def _fp8_trained_fwd(x, w, group_sizes, impl):
    return _fp8_trained(x, w, group_sizes, impl), (x, w, group_sizes)


def _fp8_trained_bwd(impl, res, dy):
    x, w, group_sizes = res
    s = expert_scales(w)
    wq_kn = fp8_formats.quantize(w, s[:, None, None], fp8_formats.E4M3)  # [E, K, M]: dx's operand as it is
    dx = fp8_input_grad(dy, None, s, group_sizes, impl, x.dtype, wq_kn=wq_kn)
    dw_fn = pick(impl, lambda a, g, gs: _dw_ffi(a, g, gs, w.shape[0]),
                 lambda a, g, gs: jax.vjp(lambda b: grouped_matmul_ref(a, b, gs), w)[1](g)[0], OP, "bwd")
    dw = dw_fn(x, dy.astype(x.dtype), group_sizes)
    return dx, dw.astype(w.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


_fp8_trained.defvjp(_fp8_trained_fwd, _fp8_trained_bwd)


def fp8_kernel_applies(x_shape, m: int) -> bool:
    """Whether the FP8 kernel takes these operands: K and M multiples of 16 (the forward contracts K, dx M)."""
    return x_shape[1] % 16 == 0 and m % 16 == 0


def resolve_fp8_impl(impl: str | None, x_shape, m: int) -> str:
    """The impl the FP8 forms trace for x [N, K] and M outputs ("ref" where the kernel does not apply)."""
    impl = resolve_impl(impl, OP)
    if impl != "ref" and not fp8_kernel_applies(x_shape, m):
        if impl == "ffi":
            raise TypeError(f"grouped_matmul_fp8: impl='ffi' needs K and M multiples of 16; got x {x_shape}, "
                            f"M {m}")
        impl = "ref"
    return impl


def grouped_matmul_fp8_frozen(x: jax.Array, wq: jax.Array, w_scale: jax.Array, group_sizes: jax.Array, *,
                              impl: str | None = None) -> jax.Array:
    """y [N, M] = each row of x [N, K] times its group's frozen E4M3 weight wq [E, M, K] (HF layout, values w *
    w_scale[e]), x quantized to E4M3 with current scaling; backward dx only (module docstring). impl as
    `grouped_matmul`."""
    if x.ndim != 2 or wq.ndim != 3 or x.shape[1] != wq.shape[2] or group_sizes.shape != wq.shape[:1] \
            or w_scale.shape != wq.shape[:1] or wq.dtype != jnp.dtype(fp8_formats.E4M3):
        raise ValueError(f"grouped_matmul_fp8_frozen: x {x.shape}, wq {wq.shape} {wq.dtype}, w_scale {w_scale.shape},"
                         f" group_sizes {group_sizes.shape} do not agree (x [N, K], wq float8_e4m3fn [E, M, K], "
                         "w_scale and group_sizes [E])")
    return _fp8_frozen(x, wq, w_scale.astype(jnp.float32), group_sizes, resolve_fp8_impl(impl, x.shape, wq.shape[1]))


def grouped_matmul_fp8(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str | None = None) -> jax.Array:
    """y [N, M] = each row of x [N, K] times its group's w [E, K, M], both quantized to E4M3 per call (per-expert
    scales for w); dx in FP8 (dy to E5M2), dw from the unquantized x and dy (module docstring)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != w.shape[:1]:
        raise ValueError(f"grouped_matmul_fp8: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape} do not "
                         "agree (x [N, K], w [E, K, M], group_sizes [E])")
    return _fp8_trained(x, w.astype(x.dtype), group_sizes, resolve_fp8_impl(impl, x.shape, w.shape[2]))
