"""SwiGLU whose gate and up carry LoRA updates computed inside the kernel.

Shapes and dtypes:
  swiglu_lora(gate_up, xa [..., 2R], lora_b [2, R, F], scale) -> h [..., F]
    gate_up = x @ [W_gate | W_up]  [..., 2F]   the frozen projections as one GEMM output, or
              (x @ W_gate, x @ W_up)           as two [..., F] outputs (no concatenated weight)
    xa      = [x @ A_gate | x @ A_up]   the LoRA down-projections (after any LoRA dropout)
    lora_b  = stack(B_gate, B_up)
    gate = base_g + ((xa_g @ B_gate) * scale).astype(dtype)    (up likewise)
    h = silu(gate) * up                (fp32 math, rounded once)
  One float dtype for all operands (float32 / bfloat16 / float16).

Why: that is what the models' MLP computes under LoRA (`Linear` + `swiglu`). Handed a plain SwiGLU
kernel, XLA must write gate and up (and their gradients' sum) to memory first, which made the
Qwen3-0.6B LoRA step 3% slower than XLA's own fusion. Here the
rank-R products are formed in the kernel, so the [..., F] LoRA outputs are never materialized.
The two-operand form exists because one GEMM output needs the two frozen kernels concatenated
every step, which at Qwen3-8B cost more than the op saves (models/llamalike.py).

Backward: the kernel gives the base's gradient in the base's form (dgate_up [..., 2F], or dgate
and dup) from the recomputed gate and up; the LoRA gradients are small GEMMs left to XLA:
  d_xa_i = dgate_i @ B_i^T * scale,  d_lora_b[i] = (xa_i * scale)^T @ dgate_i   (i: gate, up)

Implementations: `swiglu_lora_ref` (pure jnp, the model's unfused formula), the FFI kernels
`surogate_swiglu_lora[_sep]_fwd/bwd` (kernels/swiglu_lora.cu via ffi/swiglu_lora.cc), and the
public `swiglu_lora`, a `jax.custom_vjp` choosing one (ops/_loader.py; SUROGATE_JAX_OPS=ref:swiglu_lora).
h is tagged `checkpoint_name(h, "swiglu")` like `swiglu`'s.
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
from surogate_jax.ops.swiglu import KERNEL_DTYPES, swiglu_ref
from surogate_jax.ops.swiglu import _bwd_ref as swiglu_bwd_ref

OP = "swiglu_lora"
FWD_TARGET = "surogate_swiglu_lora_fwd"
BWD_TARGET = "surogate_swiglu_lora_bwd"
BWD_SPLIT_TARGET = "surogate_swiglu_lora_bwd_split"
SEP_FWD_TARGET = "surogate_swiglu_lora_sep_fwd"
SEP_BWD_TARGET = "surogate_swiglu_lora_sep_bwd"
SEP_BWD_SPLIT_TARGET = "surogate_swiglu_lora_sep_bwd_split"

# Inside this module the base is always a tuple: (gate_up,) packed or (gate, up) separate.


def _h_shape(base):
    """h's shape [..., F] for a packed ([..., 2F]) or (gate, up) base."""
    lead, last = base[0].shape[:-1], base[0].shape[-1]
    return (*lead, last if len(base) == 2 else last // 2)


def _halves(base):
    """(gate, up) views of the base, without LoRA."""
    if len(base) == 2:
        return base
    F = base[0].shape[-1] // 2
    return base[0][..., :F], base[0][..., F:]


def _gate_and_up(base, xa, lora_b, scale):
    """gate, up with their LoRA updates, rounded like the model's Linear."""
    R = lora_b.shape[1]
    dtype = base[0].dtype

    def one(b, x, w):
        return b + (jnp.dot(x, w) * scale).astype(dtype)

    g, u = _halves(base)
    return one(g, xa[..., :R], lora_b[0]), one(u, xa[..., R:], lora_b[1])


def swiglu_lora_ref(gate_up, xa: jax.Array, lora_b: jax.Array, scale: float) -> jax.Array:
    """Reference: the model's unfused Linear + LoRA adds, then `swiglu_ref` (gate_up: one array
    [..., 2F] or a (gate, up) pair)."""
    base = tuple(gate_up) if isinstance(gate_up, (tuple, list)) else (gate_up,)
    return swiglu_ref(*_gate_and_up(base, xa, lora_b, scale))


# --- the kernel passes, reference and FFI forms: (dhs, base, xa, lora_b) -> tuple of outputs.
# dhs: () forward, (dh,) backward, (dh, dh2) split backward. Backward outputs follow the base:
# (dgate_up,) or (dgate, dup).


def _pass_ref(dhs, base, xa, lora_b, *, scale):
    gate, up = _gate_and_up(base, xa, lora_b, scale)
    dtype = base[0].dtype
    if not dhs:
        return (swiglu_ref(gate, up),)
    d = dhs[0]
    if len(dhs) == 2:  # h used twice (split_output): the sum rounded like autodiff's add
        d = (d.astype(jnp.float32) + dhs[1].astype(jnp.float32)).astype(dtype)
    dgate, dup = swiglu_bwd_ref(d, gate, up)
    return (dgate, dup) if len(base) == 2 else (jnp.concatenate([dgate, dup], axis=-1),)


_TARGETS = {(0, 1): FWD_TARGET, (1, 1): BWD_TARGET, (2, 1): BWD_SPLIT_TARGET,
            (0, 2): SEP_FWD_TARGET, (1, 2): SEP_BWD_TARGET, (2, 2): SEP_BWD_SPLIT_TARGET}


# lora_b has no row axis, so vmap cannot broadcast it with the rows: a batched call runs one
# kernel per batch element ("sequential"); the models never vmap this op.
def _pass_ffi(dhs, base, xa, lora_b, *, scale):
    dtype = base[0].dtype
    if dhs:  # the base's gradient, in the base's form
        outs = tuple(jax.ShapeDtypeStruct(b.shape, dtype) for b in base)
    else:  # h [..., F]
        outs = (jax.ShapeDtypeStruct(_h_shape(base), dtype),)
    call = jax.ffi.ffi_call(_TARGETS[len(dhs), len(base)], outs, vmap_method="sequential")
    return tuple(call(*(d.astype(dtype) for d in dhs), *base, xa, lora_b, scale=np.float32(scale)))


def _run(impl, mesh, phase, scale, dhs, base, xa, lora_b):
    """One pass per data shard: every operand but lora_b is split along its rows."""
    ffi, ref = (functools.partial(f, scale=scale) for f in (_pass_ffi, _pass_ref))  # static
    nd, nb = len(dhs), len(base)
    args = (*dhs, *base, xa, lora_b)
    fn = ref if any(a.size == 0 for a in args) else pick(impl, ffi, ref, OP, phase)
    n_out = nb if dhs else 1

    def call(*a):
        return tuple(fn(a[:nd], a[nd:nd + nb], a[-2], a[-1]))

    split = all(a.ndim >= 2 for a in args[:-1])
    batched = (split,) * (len(args) - 1) + (False,)
    return on_shards(call, *args, mesh=mesh, batched=batched, out_batched=(split,) * n_out)


def _factor_grads(dbase, xa, lora_b, scale):
    """The LoRA factors' gradients as GEMMs over the whole base gradient (no slice or scaled
    copy of it: in the train step those cost a [rows, 4F] pass per layer); the scale goes on the
    small operands. Packed, the two halves' products come from block matrices (half the FLOPs
    are zeros, ~1 GFLOP at Qwen3-0.6B, nothing next to the pass it avoids)."""
    R, F = lora_b.shape[1], lora_b.shape[2]
    dtype = dbase[0].dtype
    bs = (lora_b * scale).astype(dtype)                                  # [2, R, F]
    xs = (xa * scale).astype(dtype).reshape(-1, 2 * R)
    if len(dbase) == 2:
        dg, du = dbase
        d_xa = jnp.concatenate([jnp.dot(dg, bs[0].T), jnp.dot(du, bs[1].T)], axis=-1)
        d_b = jnp.stack([jnp.dot(xs[:, :R].T, dg.reshape(-1, F)), jnp.dot(xs[:, R:].T, du.reshape(-1, F))])
    else:
        (dgu,) = dbase
        zero = jnp.zeros((F, R), dtype)
        mt = jnp.block([[bs[0].T, zero], [zero, bs[1].T]])               # [2F, 2R]
        d_xa = jnp.dot(dgu, mt)                                          # [..., 2R]
        full = jnp.dot(xs.T, dgu.reshape(-1, 2 * F))                     # [2R, 2F]
        d_b = jnp.stack([full[:R, :F], full[R:, F:]])
    return dbase, d_xa.astype(xa.dtype), d_b.astype(lora_b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _swiglu_lora(base, xa, lora_b, scale, impl, mesh):
    (h,) = _run(impl, mesh, "fwd", scale, (), base, xa, lora_b)
    return h


def _vjp_fwd(base, xa, lora_b, scale, impl, mesh):
    return _swiglu_lora(base, xa, lora_b, scale, impl, mesh), (base, xa, lora_b)


def _vjp_bwd(scale, impl, mesh, res, dh):
    base, xa, lora_b = res
    return _factor_grads(_run(impl, mesh, "bwd", scale, (dh,), base, xa, lora_b), xa, lora_b, scale)


_swiglu_lora.defvjp(_vjp_fwd, _vjp_bwd)


# split_output: h returned twice, for two consumers (the down projection's frozen GEMM and its
# LoRA), so their gradients reach the kernel as two operands instead of a materialized sum.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _swiglu_lora_split(base, xa, lora_b, scale, impl, mesh):
    h = _swiglu_lora(base, xa, lora_b, scale, impl, mesh)
    return h, h


def _split_vjp_fwd(base, xa, lora_b, scale, impl, mesh):
    return _swiglu_lora_split(base, xa, lora_b, scale, impl, mesh), (base, xa, lora_b)


def _split_vjp_bwd(scale, impl, mesh, res, cts):
    base, xa, lora_b = res
    return _factor_grads(_run(impl, mesh, "bwd", scale, tuple(cts), base, xa, lora_b), xa, lora_b, scale)


_swiglu_lora_split.defvjp(_split_vjp_fwd, _split_vjp_bwd)


def swiglu_lora(gate_up, xa: jax.Array, lora_b: jax.Array, scale: float, *,
                impl: str | None = None, split_output: bool = False, mesh: Mesh | AbstractMesh | None = None):
    """silu(gate) * up with gate, up = the base GEMM output(s) plus their LoRA updates (module docstring).

    gate_up: one array [..., 2F] (gate | up) or a (gate, up) pair of [..., F] arrays; xa [..., 2R];
    lora_b [2, R, F]; one float dtype; scale: LoRA alpha / r. The gradient of gate_up comes in
    the same form. impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref";
    the environment variable SUROGATE_JAX_OPS=ref forces the reference. Tagged
    `checkpoint_name(h, "swiglu")`. mesh: rows are split over its data axes (ops/_sharding.py;
    None: one call on the whole input).
    split_output: return (h, h), the same values for two consumers; their gradients then enter
    the backward kernel separately (no [..., F] add pass for autodiff's sum of them).
    """
    pair = isinstance(gate_up, (tuple, list))
    if pair:
        if len(gate_up) != 2 or gate_up[0].shape != gate_up[1].shape or gate_up[0].ndim < 1:
            raise ValueError(f"swiglu_lora: (gate, up) must be two arrays of one shape [..., F], got "
                             f"{[getattr(a, 'shape', a) for a in gate_up]}")
        base = tuple(gate_up)
        F = base[0].shape[-1]
    else:
        if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
            raise ValueError(f"swiglu_lora: gate_up's last dimension must be even (2F), got {gate_up.shape}")
        base = (gate_up,)
        F = gate_up.shape[-1] // 2
    lead = base[0].shape[:-1]
    if lora_b.ndim != 3 or lora_b.shape[0] != 2 or lora_b.shape[2] != F or lora_b.shape[1] < 1:
        raise ValueError(f"swiglu_lora: lora_b must be [2, R, {F}] (B_gate, B_up), got {lora_b.shape}")
    R = lora_b.shape[1]
    if xa.shape != (*lead, 2 * R):
        raise ValueError(f"swiglu_lora: xa must be {(*lead, 2 * R)} (the base's rows, 2R), got {xa.shape}")
    dtype = base[0].dtype
    if (not jnp.issubdtype(dtype, jnp.floating) or any(b.dtype != dtype for b in base)
            or xa.dtype != dtype or lora_b.dtype != dtype):
        raise TypeError(f"swiglu_lora: {'gate, up' if pair else 'gate_up'}, xa, lora_b must share one float "
                        f"dtype, got {', '.join(str(a.dtype) for a in (*base, xa, lora_b))}")
    impl = resolve_impl(impl, OP)
    if impl != "ref" and dtype not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"swiglu_lora: impl='ffi' supports float32/bfloat16/float16, got {dtype}")
        impl = "ref"
    if split_output:
        h, h2 = _swiglu_lora_split(base, xa, lora_b, float(scale), impl, mesh)
        return checkpoint_name(h, "swiglu"), checkpoint_name(h2, "swiglu")
    h = _swiglu_lora(base, xa, lora_b, float(scale), impl, mesh)
    return checkpoint_name(h, "swiglu")
