"""SwiGLU whose gate and up carry LoRA updates computed inside the kernel.

Shapes and dtypes:
  swiglu_lora(gate_up [..., 2F], xa [..., 2R], lora_b [2, R, F], scale) -> h [..., F]
    gate_up = x @ [W_gate | W_up]      the frozen projections as one GEMM output
    xa      = [x @ A_gate | x @ A_up]   the LoRA down-projections (after any LoRA dropout)
    lora_b  = stack(B_gate, B_up)
    gate = base_g + ((xa_g @ B_gate) * scale).astype(dtype)    (up likewise)
    h = silu(gate) * up                (fp32 math, rounded once)
  One float dtype for all operands (float32 / bfloat16 / float16).

Why: that is what the models' MLP computes under LoRA (`Linear` + `swiglu`). Handed a plain SwiGLU
kernel, XLA must write gate and up (and their gradients' sum) to memory first, which made the
Qwen3-0.6B LoRA step 3% slower than XLA's own fusion (RESULTS.md, thirteenth session). Here the
rank-R products are formed in the kernel, so the [..., F] LoRA outputs are never materialized.

Backward: the kernel gives dgate_up [..., 2F] (= dgate | dup, from the recomputed gate and up);
the LoRA gradients are small GEMMs left to XLA:
  d_xa = dgate_up @ blockdiag(B_gate, B_up)^T * scale,  d_lora_b[i] = (xa_i * scale)^T @ dgate_up_i

Implementations: `swiglu_lora_ref` (pure jnp, the model's unfused formula), the FFI kernels
`surogate_swiglu_lora_fwd/bwd` (kernels/swiglu_lora.cu via ffi/swiglu_lora.cc), and the public
`swiglu_lora`, a `jax.custom_vjp` choosing one (ops/_loader.py; SUROGATE_JAX_OPS=ref:swiglu_lora).
h is tagged `checkpoint_name(h, "swiglu")` like `swiglu`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from surogate_jax.ops._loader import pick, resolve_impl
from surogate_jax.ops._sharding import on_shards
from surogate_jax.ops.swiglu import KERNEL_DTYPES, swiglu_ref

OP = "swiglu_lora"
FWD_TARGET = "surogate_swiglu_lora_fwd"
BWD_TARGET = "surogate_swiglu_lora_bwd"
BWD_SPLIT_TARGET = "surogate_swiglu_lora_bwd_split"


def _gate_and_up(gate_up, xa, lora_b, scale):
    """gate, up with their LoRA updates, rounded like the model's Linear."""
    F, R = gate_up.shape[-1] // 2, lora_b.shape[1]
    dtype = gate_up.dtype

    def one(base, x, b):
        return base + (jnp.dot(x, b) * scale).astype(dtype)

    return (one(gate_up[..., :F], xa[..., :R], lora_b[0]), one(gate_up[..., F:], xa[..., R:], lora_b[1]))


def swiglu_lora_ref(gate_up: jax.Array, xa: jax.Array, lora_b: jax.Array, scale: float) -> jax.Array:
    """Reference: the model's unfused Linear + LoRA adds, then `swiglu_ref`."""
    return swiglu_ref(*_gate_and_up(gate_up, xa, lora_b, scale))


# --- the kernel passes (fwd: h; bwd: dgate_up), reference and FFI forms ---


def _fwd_ref(gate_up, xa, lora_b, scale):
    return swiglu_lora_ref(gate_up, xa, lora_b, scale)


def _bwd_ref(dh, gate_up, xa, lora_b, scale):
    gate, up = _gate_and_up(gate_up, xa, lora_b, scale)
    g, u, d = (a.astype(jnp.float32) for a in (gate, up, dh))
    s = jax.nn.sigmoid(g)
    dgate = d * u * s * (1.0 + g * (1.0 - s))
    dup = d * g * s
    return jnp.concatenate([dgate, dup], axis=-1).astype(gate_up.dtype)


def _bwd_split_ref(dh, dh2, gate_up, xa, lora_b, scale):
    """h used twice (split_output): its two gradients summed and rounded like autodiff's add."""
    d = (dh.astype(jnp.float32) + dh2.astype(jnp.float32)).astype(gate_up.dtype)
    return _bwd_ref(d, gate_up, xa, lora_b, scale)


# lora_b has no row axis, so vmap cannot broadcast it with the rows: a batched call runs one
# kernel per batch element ("sequential"); the models never vmap this op.
def _fwd_ffi(gate_up, xa, lora_b, scale):
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    call = jax.ffi.ffi_call(FWD_TARGET, jax.ShapeDtypeStruct(shape, gate_up.dtype), vmap_method="sequential")
    return call(gate_up, xa, lora_b, scale=np.float32(scale))


def _bwd_ffi(dh, gate_up, xa, lora_b, scale):
    call = jax.ffi.ffi_call(BWD_TARGET, jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
                            vmap_method="sequential")
    return call(dh.astype(gate_up.dtype), gate_up, xa, lora_b, scale=np.float32(scale))


def _bwd_split_ffi(dh, dh2, gate_up, xa, lora_b, scale):
    call = jax.ffi.ffi_call(BWD_SPLIT_TARGET, jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
                            vmap_method="sequential")
    return call(dh.astype(gate_up.dtype), dh2.astype(gate_up.dtype), gate_up, xa, lora_b, scale=np.float32(scale))


def _run(impl, ffi, ref, phase, scale, *args):
    """One pass per data shard: every operand but lora_b (the last) is split along its rows."""
    ffi, ref = (functools.partial(f, scale=scale) for f in (ffi, ref))  # static, not an operand
    if any(a.size == 0 for a in args):
        return ref(*args)
    fn = pick(impl, ffi, ref, OP, phase)
    split = all(a.ndim >= 2 for a in args[:-1])
    batched = (split,) * (len(args) - 1) + (False,)
    (out,) = on_shards(lambda *a: (fn(*a),), *args, batched=batched, out_batched=(split,))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _swiglu_lora(gate_up, xa, lora_b, scale, impl):
    return _run(impl, _fwd_ffi, _fwd_ref, "fwd", scale, gate_up, xa, lora_b)


def _vjp_fwd(gate_up, xa, lora_b, scale, impl):
    return _swiglu_lora(gate_up, xa, lora_b, scale, impl), (gate_up, xa, lora_b)


def _factor_grads(dgu, xa, lora_b, scale):
    """The LoRA factors' gradients as two GEMMs over the whole dgate_up (no slice or scaled copy
    of it: in the train step those cost a [rows, 4F] pass per layer): the scale goes on the small
    operands, and the two halves' products come from block matrices (half the FLOPs are zeros,
    ~1 GFLOP at Qwen3-0.6B, nothing next to the pass it avoids)."""
    R, F = lora_b.shape[1], lora_b.shape[2]
    dtype = dgu.dtype
    bs = (lora_b * scale).astype(dtype)                                  # [2, R, F]
    zero = jnp.zeros((F, R), dtype)
    mt = jnp.block([[bs[0].T, zero], [zero, bs[1].T]])                   # [2F, 2R]
    d_xa = jnp.dot(dgu, mt)                                              # [..., 2R]
    xs = (xa * scale).astype(dtype).reshape(-1, 2 * R)
    full = jnp.dot(xs.T, dgu.reshape(-1, 2 * F))                         # [2R, 2F]
    d_b = jnp.stack([full[:R, :F], full[R:, F:]])
    return dgu, d_xa.astype(xa.dtype), d_b.astype(lora_b.dtype)


def _vjp_bwd(scale, impl, res, dh):
    gate_up, xa, lora_b = res
    dgu = _run(impl, _bwd_ffi, _bwd_ref, "bwd", scale, dh, gate_up, xa, lora_b)
    return _factor_grads(dgu, xa, lora_b, scale)


_swiglu_lora.defvjp(_vjp_fwd, _vjp_bwd)


# split_output: h returned twice, for two consumers (the down projection's frozen GEMM and its
# LoRA), so their gradients reach the kernel as two operands instead of a materialized sum.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _swiglu_lora_split(gate_up, xa, lora_b, scale, impl):
    h = _swiglu_lora(gate_up, xa, lora_b, scale, impl)
    return h, h


def _split_vjp_fwd(gate_up, xa, lora_b, scale, impl):
    return _swiglu_lora_split(gate_up, xa, lora_b, scale, impl), (gate_up, xa, lora_b)


def _split_vjp_bwd(scale, impl, res, cts):
    gate_up, xa, lora_b = res
    dh, dh2 = cts
    dgu = _run(impl, _bwd_split_ffi, _bwd_split_ref, "bwd", scale, dh, dh2, gate_up, xa, lora_b)
    return _factor_grads(dgu, xa, lora_b, scale)


_swiglu_lora_split.defvjp(_split_vjp_fwd, _split_vjp_bwd)


def swiglu_lora(gate_up: jax.Array, xa: jax.Array, lora_b: jax.Array, scale: float, *,
                impl: str | None = None, split_output: bool = False):
    """silu(gate) * up with gate, up = gate_up's halves plus their LoRA updates (module docstring).

    gate_up [..., 2F], xa [..., 2R], lora_b [2, R, F], one float dtype; scale: LoRA alpha / r.
    impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; the environment
    variable SUROGATE_JAX_OPS=ref forces the reference. Tagged `checkpoint_name(h, "swiglu")`.
    split_output: return (h, h), the same values for two consumers; their gradients then enter
    the backward kernel separately (no [..., F] add pass for autodiff's sum of them).
    """
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_lora: gate_up's last dimension must be even (2F), got {gate_up.shape}")
    F = gate_up.shape[-1] // 2
    if lora_b.ndim != 3 or lora_b.shape[0] != 2 or lora_b.shape[2] != F or lora_b.shape[1] < 1:
        raise ValueError(f"swiglu_lora: lora_b must be [2, R, {F}] (B_gate, B_up), got {lora_b.shape}")
    R = lora_b.shape[1]
    if xa.shape != (*gate_up.shape[:-1], 2 * R):
        raise ValueError(f"swiglu_lora: xa must be {(*gate_up.shape[:-1], 2 * R)} (gate_up's rows, 2R), got {xa.shape}")
    dtype = gate_up.dtype
    if not jnp.issubdtype(dtype, jnp.floating) or xa.dtype != dtype or lora_b.dtype != dtype:
        raise TypeError(f"swiglu_lora: gate_up, xa, lora_b must share one float dtype, got "
                        f"{gate_up.dtype}, {xa.dtype}, {lora_b.dtype}")
    impl = resolve_impl(impl, OP)
    if impl != "ref" and dtype not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"swiglu_lora: impl='ffi' supports float32/bfloat16/float16, got {dtype}")
        impl = "ref"
    if split_output:
        h, h2 = _swiglu_lora_split(gate_up, xa, lora_b, float(scale), impl)
        return checkpoint_name(h, "swiglu"), checkpoint_name(h2, "swiglu")
    h = _swiglu_lora(gate_up, xa, lora_b, float(scale), impl)
    return checkpoint_name(h, "swiglu")
