"""SwiGLU: h = silu(gate) * up = gate * sigmoid(gate) * up, element-wise.

Shapes and dtypes:
  swiglu(gate [..., F], up [..., F]) -> h [..., F]
  swiglu_packed(gate_up [..., 2F]) -> h [..., F]   (gate = gate_up[..., :F], up = gate_up[..., F:])
  float32 / bfloat16 / float16; gate and up are promoted to one dtype. The math is float32 and h is
  rounded once to that dtype (what `(silu(g.f32) * u.f32).astype(dtype)` gives).

Backward (fp32, s = sigmoid(gate)):
  dgate = dh * up * s * (1 + gate * (1 - s))
  dup   = dh * gate * s          (= dh * silu(gate))

Implementations: `swiglu_ref` (pure jnp, autodiff-able), the FFI kernels `surogate_swiglu_*`
(kernels/swiglu.cu via ffi/swiglu.cc), and the public `swiglu` / `swiglu_packed`, each a
`jax.custom_vjp` picking one of them (see ops/_loader.py for `impl`). Outputs are tagged
`checkpoint_name(h, "swiglu")` for remat policies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._loader import pick, resolve_impl
from surogate_jax.ops._sharding import on_shards

OP = "swiglu"  # the name SUROGATE_JAX_OPS=ref:<op> and impl resolution use
FWD_TARGET = "surogate_swiglu_fwd"
BWD_TARGET = "surogate_swiglu_bwd"
PACKED_FWD_TARGET = "surogate_swiglu_packed_fwd"
PACKED_BWD_TARGET = "surogate_swiglu_packed_bwd"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def swiglu_ref(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Reference SwiGLU: fp32 math, output in the inputs' (common) dtype."""
    dtype = jnp.result_type(gate, up)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


# --- reference formulas in the kernels' fwd/bwd form ---


def _fwd_ref(gate, up):
    return swiglu_ref(gate, up)


def _bwd_ref(dh, gate, up):
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    d = dh.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    dgate = d * u * s * (1.0 + g * (1.0 - s))
    dup = d * g * s
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


def _packed_fwd_ref(gate_up):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return _fwd_ref(gate, up)


def _packed_bwd_ref(dh, gate_up):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jnp.concatenate(_bwd_ref(dh, gate, up), axis=-1)


# --- the CUDA kernels through XLA FFI (one dtype for every operand) ---
# The op is element-wise, so under vmap "broadcast_all" (every operand gets the batch axis in
# front) is exact: the handler sees more rows.


def _fwd_ffi(gate, up):
    call = jax.ffi.ffi_call(FWD_TARGET, jax.ShapeDtypeStruct(gate.shape, gate.dtype),
                            vmap_method="broadcast_all")
    return call(gate, up)


def _bwd_ffi(dh, gate, up):
    out = (jax.ShapeDtypeStruct(gate.shape, gate.dtype),) * 2
    call = jax.ffi.ffi_call(BWD_TARGET, out, vmap_method="broadcast_all")
    return tuple(call(dh.astype(gate.dtype), gate, up))


def _packed_fwd_ffi(gate_up):
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    call = jax.ffi.ffi_call(PACKED_FWD_TARGET, jax.ShapeDtypeStruct(shape, gate_up.dtype),
                            vmap_method="broadcast_all")
    return call(gate_up)


def _packed_bwd_ffi(dh, gate_up):
    call = jax.ffi.ffi_call(PACKED_BWD_TARGET, jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
                            vmap_method="broadcast_all")
    return call(dh.astype(gate_up.dtype), gate_up)


def _run(impl, mesh, ffi, ref, *args, n_out, phase):
    """Runs fwd or bwd per data shard: every operand and output is split along its leading (row)
    axis; a rank-1 operand is a single row and is not split (its halves matter when packed)."""
    if any(a.size == 0 for a in args):
        return ref(*args)
    fn = pick(impl, ffi, ref, OP, phase)
    tupled = (lambda *a: (fn(*a),)) if n_out == 1 else (lambda *a: tuple(fn(*a)))
    split = all(a.ndim >= 2 for a in args)
    out = on_shards(tupled, *args, mesh=mesh, batched=(split,) * len(args), out_batched=(split,) * n_out)
    return out[0] if n_out == 1 else tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _swiglu(gate, up, impl, mesh):
    return _run(impl, mesh, _fwd_ffi, _fwd_ref, gate, up, n_out=1, phase="fwd")


def _swiglu_vjp_fwd(gate, up, impl, mesh):
    return _swiglu(gate, up, impl, mesh), (gate, up)


def _swiglu_vjp_bwd(impl, mesh, res, dh):
    gate, up = res
    return _run(impl, mesh, _bwd_ffi, _bwd_ref, dh, gate, up, n_out=2, phase="bwd")


_swiglu.defvjp(_swiglu_vjp_fwd, _swiglu_vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _swiglu_packed(gate_up, impl, mesh):
    return _run(impl, mesh, _packed_fwd_ffi, _packed_fwd_ref, gate_up, n_out=1, phase="fwd")


def _swiglu_packed_vjp_fwd(gate_up, impl, mesh):
    return _swiglu_packed(gate_up, impl, mesh), (gate_up,)


def _swiglu_packed_vjp_bwd(impl, mesh, res, dh):
    (gate_up,) = res
    return (_run(impl, mesh, _packed_bwd_ffi, _packed_bwd_ref, dh, gate_up, n_out=1, phase="bwd"),)


_swiglu_packed.defvjp(_swiglu_packed_vjp_fwd, _swiglu_packed_vjp_bwd)


def _impl_for(name: str, dtype, impl: str | None) -> str:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name}: inputs must be floating point, got {dtype}")
    impl = resolve_impl(impl, OP)
    if impl != "ref" and dtype not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"{name}: impl='ffi' supports float32/bfloat16/float16, got {dtype}")
        impl = "ref"
    return impl


def swiglu(gate: jax.Array, up: jax.Array, *, impl: str | None = None,
           mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """silu(gate) * up for gate, up [..., F] (promoted to one float dtype); returns that dtype.

    impl: None/"auto" (CUDA kernel on GPU, reference elsewhere), "ffi" or "ref"; the environment
    variable SUROGATE_JAX_OPS=ref forces the reference. mesh: rows are split over its data axes
    (ops/_sharding.py; None: one call on the whole input). Tagged `checkpoint_name(h, "swiglu")`.
    """
    if gate.shape != up.shape or gate.ndim < 1:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} must have one shape (rank >= 1)")
    dtype = jnp.result_type(gate, up)
    impl = _impl_for("swiglu", dtype, impl)
    h = _swiglu(gate.astype(dtype), up.astype(dtype), impl, mesh)
    return checkpoint_name(h, "swiglu")


def swiglu_packed(gate_up: jax.Array, *, impl: str | None = None,
                  mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """silu(gate) * up with gate, up = the two halves of gate_up [..., 2F]; returns [..., F].

    Same numerics, impl, mesh and checkpoint name ("swiglu") as `swiglu`; one input buffer, so a fused
    gate/up projection needs no split copy.
    """
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: gate_up's last dimension must be even, got {gate_up.shape}")
    impl = _impl_for("swiglu_packed", gate_up.dtype, impl)
    h = _swiglu_packed(gate_up, impl, mesh)
    return checkpoint_name(h, "swiglu")
