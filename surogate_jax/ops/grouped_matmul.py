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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops._loader import pick, resolve_impl, traced_impl

OP = "grouped_matmul"
FWD_TARGET = "surogate_grouped_matmul"
DW_TARGET = "surogate_grouped_matmul_dw"


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
