"""The quantized frozen base of QLoRA: which format, its parameters, and a projection's GEMM through it.

A projection's base weight W [out, in] (HF layout, `in` the GEMM reduction axis) is stored in one of three formats,
each a module of this package with the same functions (`quantize`, `dequantize`, `param_shapes`):
  nf4  bitsandbytes NF4 with absmax blocks (64..512) and optional double quantization (qlora/nf4.py);
  fp8  E4M3 with one fp32 scale per square tile, HF's fine-grained FP8 (qlora/fp8_block.py);
  fp4  NVFP4 with 16x16 tiles (qlora/fp4.py, the recipe nvfp4's weight quantizer).
Only the seven projections of every decoder layer are quantized; embeddings, lm_head, norms and biases keep the
model dtype (surogate_inventory.md 3.6).

The GEMM (`frozen_matmul`) dequantizes W into the compute dtype (our CUDA kernels on a GPU: ops/nf4_dequantize.py,
ops/tile_dequantize.py) and multiplies; its backward gives dX only (the
base is frozen) and dequantizes again instead of saving W, so no layer's dequantized copy outlives its GEMM: the
activations saved for the backward are those of a plain LoRA step, the base costs its quantized bytes. Under
fp8-hybrid, `frozen_fp8_weight` turns the base straight into the E4M3 weight [out, in] of the frozen FP8 GEMM in
one kernel pass from its codes. The MoE experts' grouped GEMM (`frozen_grouped`) may dequantize selectively
(qlora_selective_expert_dequant): only the experts that received tokens, forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.names import FP8_BLOCK_SIZES, NF4_BLOCK_SIZES
from surogate_jax.ops import grouped_matmul as gm
from surogate_jax.ops._loader import traced_impl
from surogate_jax.ops.grouped_matmul import forward_impl, grouped_matmul
from surogate_jax.ops.nf4_dequantize import OP as NF4_DEQUANTIZE_OP
from surogate_jax.ops.tile_dequantize import OP as TILE_DEQUANTIZE_OP

FORMATS = ("nf4", "fp8", "fp4")
FP4_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class QloraSpec:
    """A QLoRA base format and its knobs (hashable: part of DecoderConfig).

    format: "nf4" | "fp8" | "fp4". block_size: nf4's absmax block (qlora_bnb_block_size) or fp8's square tile
    (qlora_block_size); fp4's tiles are 16x16. double_quant: nf4's second-level absmax quantization.
    four_over_six: fp4's 4/6 block-scale choice. expert_double_quant: nf4's for the MoE experts when it differs
    (a pre-quantized NF4 MoE checkpoint: each expert carries its own second-level offset, which the layer's one
    stacked expert weight cannot, so the experts keep their absmax in fp32, the values bnb dequantizes to)."""

    format: str
    block_size: int = 64
    double_quant: bool = True
    four_over_six: bool = True
    expert_double_quant: bool | None = None

    def experts(self) -> QloraSpec:
        """The spec of the stacked MoE experts' weights."""
        if self.expert_double_quant is None:
            return self
        return dataclasses.replace(self, double_quant=self.expert_double_quant, expert_double_quant=None)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"QLoRA format {self.format!r}: use one of {FORMATS}")
        sizes = {"nf4": NF4_BLOCK_SIZES, "fp8": FP8_BLOCK_SIZES, "fp4": (FP4_BLOCK,)}[self.format]
        if self.block_size not in sizes:
            raise ValueError(f"QLoRA {self.format} block size {self.block_size}: use one of {list(sizes)}")

    @classmethod
    def from_config(cls, lc: Any) -> QloraSpec | None:
        """The spec a `config.LoraConfig` asks for (its qlora_* keys), or None."""
        fmt = lc.qlora_format
        if fmt is None:
            return None
        block = {"nf4": lc.qlora_bnb_block_size, "fp8": lc.qlora_block_size, "fp4": FP4_BLOCK}[fmt]
        return cls(fmt, block, lc.qlora_bnb_double_quant, lc.qlora_four_over_six)

    def describe(self) -> str:
        if self.format == "nf4":
            dq = "on" if self.double_quant else "off"
            if self.expert_double_quant is not None and self.expert_double_quant != self.double_quant:
                dq += f" ({'on' if self.expert_double_quant else 'off'} for the experts)"
            return f"NF4 base, blocks of {self.block_size}, double quantization {dq}"
        if self.format == "fp8":
            return f"FP8 E4M3 base, {self.block_size}x{self.block_size} tiles"
        return f"NVFP4 base, 16x16 tiles, 4/6 {'on' if self.four_over_six else 'off'}"

    def bits_per_weight(self) -> float:
        """Stored bits per base weight, scales included (for memory estimates)."""
        if self.format == "nf4":
            scales = 8 / self.block_size + 32 / (self.block_size * 256) if self.double_quant else 32 / self.block_size
            return 4 + scales
        if self.format == "fp8":
            return 8 + 32 / self.block_size**2
        return 4 + 8 / FP4_BLOCK**2


_MODULES = {"nf4": "nf4", "fp8": "fp8_block", "fp4": "fp4"}
_DEQUANTIZE_OPS = {"nf4": NF4_DEQUANTIZE_OP, "fp8": TILE_DEQUANTIZE_OP, "fp4": TILE_DEQUANTIZE_OP}  # each format's op


def format_module(fmt: str):
    """The format's module, imported on first use (fp4 pulls in the NVFP4 op)."""
    return importlib.import_module(f"surogate_jax.qlora.{_MODULES[fmt]}")


def _kw(spec: QloraSpec) -> dict:
    if spec.format == "nf4":
        return {"block_size": spec.block_size, "double_quant": spec.double_quant}
    if spec.format == "fp8":
        return {"block_size": spec.block_size}
    return {}


def param_shapes(spec: QloraSpec, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one weight's parameters (shape: the weight's [out, in])."""
    return format_module(spec.format).param_shapes(tuple(shape), **_kw(spec))


def param_names(spec: QloraSpec) -> tuple[str, ...]:
    return tuple(sorted(param_shapes(spec, (FP4_BLOCK, FP4_BLOCK))))


def quantize(spec: QloraSpec, w: jax.Array) -> dict[str, jax.Array]:
    """w [out, in] (any float dtype) -> the format's parameters (jnp, jit-able)."""
    kw = _kw(spec)
    if spec.format == "fp4":
        kw = {"four_over_six": spec.four_over_six}
    return format_module(spec.format).quantize(w, **kw)


def dequantize(spec: QloraSpec, params: Mapping[str, jax.Array], shape: tuple[int, int], dtype: Any, *,
               mesh=None, group_sizes=None) -> jax.Array:
    """The weight [out, in] in `dtype` (fp32 math, one rounding). mesh: the devices NF4's kernel runs on.
    group_sizes int32 [E]: the weight is E stacked experts and those without rows may be left unspecified (see
    `expert_weights`)."""
    return format_module(spec.format).dequantize(params, tuple(shape), dtype=dtype, mesh=mesh,
                                                 group_sizes=group_sizes, **_kw(spec))


def _zero_cotangent(a: jax.Array):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


def _plain_dot(x, kernel, in_dims: int, dtype):
    """x [..., in...] @ kernel [in..., out...] exactly as the model's plain projection computes it."""
    contract = (tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims)))
    return jax.lax.dot_general(x.astype(dtype), kernel, (contract, ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _frozen(x, params, spec, dims, dtype, mesh):
    in_shape, out_shape, _ = dims
    return _plain_dot(x, base_kernel(spec, params, in_shape, out_shape, dtype, mesh=mesh), len(in_shape), dtype)


def _frozen_fwd(x, params, spec, dims, dtype, mesh):
    return _frozen(x, params, spec, dims, dtype, mesh), params  # W is dequantized again in the backward, never saved


def _frozen_bwd(spec, dims, dtype, mesh, params, dy):
    in_shape, out_shape, x_dtype = dims
    kernel = base_kernel(spec, params, in_shape, out_shape, dtype, mesh=mesh)
    x_sds = jax.ShapeDtypeStruct((*dy.shape[:dy.ndim - len(out_shape)], *in_shape), x_dtype)
    (dx,) = jax.linear_transpose(lambda x: _plain_dot(x, kernel, len(in_shape), dtype), x_sds)(dy)
    return dx, jax.tree.map(_zero_cotangent, params)


_frozen.defvjp(_frozen_fwd, _frozen_bwd)


def frozen_matmul(spec: QloraSpec, x: jax.Array, params: Mapping[str, jax.Array], *, in_dims: int,
                  out_shape: tuple[int, ...], dtype: Any, mesh=None) -> jax.Array:
    """y [..., out...] = x [..., in...] @ W^T in `dtype`, W [prod(out), prod(in)] = dequantize(params): the plain
    projection's dot expression over the dequantized kernel, its dX the transpose of that expression. The backward
    dequantizes again (W is never saved) and gives no gradient for the base."""
    in_shape = tuple(x.shape[x.ndim - in_dims:])
    return _frozen(x, dict(params), spec, (in_shape, tuple(out_shape), jnp.dtype(x.dtype)), jnp.dtype(dtype), mesh)


def expert_weights(spec: QloraSpec, params: Mapping[str, jax.Array], shape: tuple[int, int, int], dtype: Any, *,
                   mesh=None, group_sizes=None) -> jax.Array:
    """A stacked MoE projection [E, out, in] (HF layout per expert) in `dtype`: the experts are quantized as one
    [E * out, in] weight (blocks and tiles never straddle two experts: `in` and `out` are multiples of them).
    group_sizes int32 [E] (the experts' token rows, on the device): a selective dequantization, experts without rows
    zeros from the reference ops and left UNSPECIFIED by the kernels (only for a consumer that never reads them:
    `selective_applies`)."""
    E, out, inp = shape
    return dequantize(spec, params, (E * out, inp), dtype, mesh=mesh, group_sizes=group_sizes).reshape(E, out, inp)


def selective_applies(spec: QloraSpec, x_shape: tuple[int, int], shape: tuple[int, int, int], dtype: Any) -> bool:
    """Whether the grouped GEMM of rows x [N, K] with the experts [E, out, in] may take a selective dequantization
    (`_safe_for`: is that GEMM the reference?)."""
    return _safe_for(spec, forward_impl(x_shape, shape, dtype) == "ref")


def _safe_for(spec: QloraSpec, gemm_is_ref: bool) -> bool:
    """Our GEMM kernels never read an expert without rows and the reference dequantization zeroes them: only a
    reference GEMM (ragged_dot, which may read every expert) after the dequantization kernel must not take it."""
    return not gemm_is_ref or traced_impl(None, _DEQUANTIZE_OPS[spec.format]) == "ref"


def _selected(sizes, use: bool):
    """The group sizes a selective dequantization takes, or None (every expert)."""
    return sizes.astype(jnp.int32) if use else None


def splits_by_expert(spec: QloraSpec, shape: tuple[int, int, int]) -> bool:
    """Whether the stacked experts' quantized parts [E * out, in] are the experts' own parts end to end (every
    non-scalar part E times one expert's along its first axis; scalars shared): then E / ep consecutive experts'
    slices of each part are those experts' weight, which expert parallelism relies on."""
    E, out, inp = shape
    whole, one = param_shapes(spec, (E * out, inp)), param_shapes(spec, (out, inp))
    return all(w.shape == () or (w.shape[0] == E * one[k].shape[0] and w.shape[1:] == one[k].shape[1:])
               for k, w in whole.items())


def _grouped_weights(x_shape, params, sizes, spec, shape, dtype, selective):
    """The experts [E, out, in] a grouped GEMM over rows x_shape reads: when selective (and `selective_applies`)
    only those with rows, else all."""
    use = selective and selective_applies(spec, x_shape, shape, dtype)
    return expert_weights(spec, params, shape, dtype, group_sizes=_selected(sizes, use))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _frozen_grouped(x, params, sizes, spec, shape, dtype, selective):
    w = _grouped_weights(x.shape, params, sizes, spec, shape, dtype, selective)
    return grouped_matmul(x, w, sizes, transpose_w=True)


def _frozen_grouped_fwd(x, params, sizes, spec, shape, dtype, selective):
    y = _frozen_grouped(x, params, sizes, spec, shape, dtype, selective)
    return y, (params, sizes)  # the experts are not saved


def _frozen_grouped_bwd(spec, shape, dtype, selective, res, dy):
    params, sizes = res
    dy = dy.astype(dtype)
    dx = grouped_matmul(dy, _grouped_weights(dy.shape, params, sizes, spec, shape, dtype, selective), sizes)
    return dx, jax.tree.map(_zero_cotangent, params), _zero_cotangent(sizes)


_frozen_grouped.defvjp(_frozen_grouped_fwd, _frozen_grouped_bwd)


def frozen_grouped_matmul(spec: QloraSpec, x: jax.Array, params: Mapping[str, jax.Array], group_sizes: jax.Array, *,
                          shape: tuple[int, int, int], dtype: Any, selective: bool = False) -> jax.Array:
    """The MoE experts' frozen projection through a quantized base: rows of x [N, in] sorted by expert (group_sizes
    [E]) times their expert's dequantized W_e^T, W [E, out, in] = `expert_weights`; y [N, out] in `dtype`. As
    `frozen_matmul`, the backward dequantizes again (a layer's bf16 experts never outlive their GEMM) and gives dX
    only. selective (qlora_selective_expert_dequant): forward and backward dequantize only the experts with rows
    (group_sizes > 0) where `selective_applies`, else every expert; the result is the same."""
    return _frozen_grouped(x.astype(dtype), dict(params), group_sizes, spec, tuple(shape), jnp.dtype(dtype),
                           bool(selective))


def expert_fp8_weights(spec: QloraSpec, params: Mapping[str, jax.Array], shape: tuple[int, int, int],
                       dtype: Any, group_sizes=None) -> tuple[jax.Array, jax.Array]:
    """(E4M3 [E, out, in], scales [E]) of a stacked MoE projection under fp8-hybrid: `frozen_fp8_weight` of the
    [E * out, in] weight (one scale for the layer's experts, repeated per expert); group_sizes: a selective
    dequantization, as `expert_weights`."""
    E, out, inp = shape
    wq, scale = frozen_fp8_weight(spec, params, (E * out, inp), dtype, group_sizes=group_sizes)
    return wq.reshape(E, out, inp), jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (E,))


def _fp8_grouped_weights(params, sizes, spec, shape, dtype, impl, selective):
    """`expert_fp8_weights` for the FP8 grouped GEMM of impl: selective where that GEMM is our kernel (it never
    reads an expert without rows) or the dequantization is the reference (zeros there)."""
    use = selective and _safe_for(spec, impl == "ref")
    return expert_fp8_weights(spec, params, shape, dtype, group_sizes=_selected(sizes, use))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _frozen_grouped_fp8(x, params, sizes, spec, shape, dtype, impl, selective):
    wq, scale = _fp8_grouped_weights(params, sizes, spec, shape, dtype, impl, selective)
    return gm.fp8_forward(x, wq, scale, sizes, impl)


def _frozen_grouped_fp8_fwd(x, params, sizes, spec, shape, dtype, impl, selective):
    return _frozen_grouped_fp8(x, params, sizes, spec, shape, dtype, impl, selective), (params, sizes)


def _frozen_grouped_fp8_bwd(spec, shape, dtype, impl, selective, res, dy):
    params, sizes = res
    wq, scale = _fp8_grouped_weights(params, sizes, spec, shape, dtype, impl, selective)  # again, not saved
    dx = gm.fp8_input_grad(dy, wq, scale, sizes, impl, dtype)
    return dx, jax.tree.map(_zero_cotangent, params), _zero_cotangent(sizes)


_frozen_grouped_fp8.defvjp(_frozen_grouped_fp8_fwd, _frozen_grouped_fp8_bwd)


def frozen_grouped(spec: QloraSpec, params: Mapping[str, jax.Array], *, shape: tuple[int, int, int],
                   dtype: Any, selective: bool = False, fp8: bool = False,
                   fp8_impl: str | None = None) -> jax.tree_util.Partial:
    """`frozen_grouped_matmul` bound to one projection's quantized parts: (x, group_sizes) -> y, a pytree whose leaves
    are the parts (it passes through `jax.lax.cond` and `jax.custom_vjp` as operands, not as captured constants).
    fp8 (the fp8-hybrid recipe): the experts go from their codes to E4M3 (`expert_fp8_weights`) and the GEMMs run in
    FP8 (ops.grouped_matmul.grouped_matmul_fp8_frozen's math), again dequantizing in the backward; fp8_impl: its
    impl."""
    if fp8:
        return jax.tree_util.Partial(functools.partial(_apply_frozen_grouped_fp8, spec, tuple(shape),
                                                       jnp.dtype(dtype), fp8_impl, bool(selective)), dict(params))
    fn = functools.partial(_apply_frozen_grouped, spec, tuple(shape), jnp.dtype(dtype), bool(selective))
    return jax.tree_util.Partial(fn, dict(params))


def _apply_frozen_grouped_fp8(spec, shape, dtype, impl, selective, params, x, group_sizes):
    impl = gm.resolve_fp8_impl(impl, x.shape, shape[1])
    return _frozen_grouped_fp8(x.astype(dtype), dict(params), group_sizes, spec, shape, dtype, impl, selective)


def _apply_frozen_grouped(spec, shape, dtype, selective, params, x, group_sizes):
    return frozen_grouped_matmul(spec, x, params, group_sizes, shape=shape, dtype=dtype, selective=selective)


def frozen_fp8_weight(spec: QloraSpec, params: Mapping[str, jax.Array], shape: tuple[int, int], dtype: Any, *,
                      mesh=None, group_sizes=None) -> tuple[jax.Array, jax.Array]:
    """(wq float8_e4m3fn [out, in], scale f32 []): what fp8-hybrid's frozen cache makes of the weight dequantized in
    `dtype` (precision.recipe.cache_kernel: current scaling, scale = 448 / max|W|), in the HF layout its forward GEMM
    reads. Every format goes from its codes to E4M3 in one kernel pass (ops.nf4_dequantize, ops.tile_dequantize)
    and takes max|W| from its block absmaxes (NF4) or each tile's largest code (FP8, NVFP4), bit for bit the
    quantization of the dequantized weight. group_sizes: stacked experts' rows, as `expert_weights`."""
    return format_module(spec.format).fp8_weight(params, tuple(shape), dtype=dtype, mesh=mesh,
                                                 group_sizes=group_sizes, **_kw(spec))


def base_kernel(spec: QloraSpec, params: Mapping[str, jax.Array], in_shape: tuple[int, ...],
                out_shape: tuple[int, ...], dtype: Any, *, mesh=None) -> jax.Array:
    """The dequantized weight in our kernel layout [in..., out...] (for merging adapters and exports)."""
    w = dequantize(spec, params, (math.prod(out_shape), math.prod(in_shape)), dtype, mesh=mesh)
    return w.T.reshape(*in_shape, *out_shape)
