"""Benchmark SwiGLU on GPU: our FFI kernels vs XLA's fusion of `swiglu_ref`, forward and backward,
against the memory-bandwidth floor.

    python benchmarks/bench_swiglu.py [--out results.jsonl] [--steps 40] [--repeats 20]

Timing and passes: see benchmarks/_opbench.py. Bytes counted (useful traffic): forward reads gate
and up and writes h (3 x F elements per row); backward reads dh, gate and up and writes dgate and
dup (5 x F). "% of 3000" is of the H100's measured device copy bandwidth.
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, swiglu_ref
from surogate_jax.ops.swiglu import _bwd_ffi, _fwd_ffi, _packed_bwd_ffi

SHAPES = [(16384, 3072), (8192, 17408)]  # Qwen3-0.6B and -14B MLP widths at 16k / 8k tokens
DTYPES = [jnp.bfloat16, jnp.float32]


def _ref_bwd(dh, g, u):
    return jax.vjp(swiglu_ref, g, u)[1](dh)


def _steps(packed: bool):
    """(ours_fwd, xla_fwd, ours_bwd, xla_bwd) chain steps over carries (g, u) / (g, u, dh)."""
    if packed:
        F = lambda gu: gu.shape[-1] // 2  # noqa: E731
        xla_f = lambda gu: swiglu_ref(gu[..., : F(gu)], gu[..., F(gu):])  # noqa: E731
        # h [rows, F] cannot feed the next step's [rows, 2F] input, and a chain whose step drops
        # the previous h lets XLA skip all but the last one (it then shows ~2x the copy
        # bandwidth), so the packed forward is not timed; its backward chains through dgu.
        ours_fwd = xla_fwd = None
        ours_bwd = lambda gu, dh: (_packed_bwd_ffi(dh, gu), dh)  # noqa: E731
        xla_bwd = lambda gu, dh: (jax.vjp(xla_f, gu)[1](dh)[0], dh)  # noqa: E731
        return ours_fwd, xla_fwd, ours_bwd, xla_bwd
    ours_fwd = lambda g, u: (_fwd_ffi(g, u), u)  # noqa: E731
    xla_fwd = lambda g, u: (swiglu_ref(g, u), u)  # noqa: E731
    ours_bwd = lambda g, u, dh: (*_bwd_ffi(dh, g, u), dh)  # noqa: E731
    xla_bwd = lambda g, u, dh: (*_ref_bwd(dh, g, u), dh)  # noqa: E731
    return ours_fwd, xla_fwd, ours_bwd, xla_bwd


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    table = _opbench.Table("swiglu", args.steps, args.repeats)
    key = jax.random.key(0)
    cases = [(s, d, False) for s in SHAPES for d in DTYPES] + [((16384, 3072), jnp.bfloat16, True)]
    for (rows, F), dtype, packed in cases:
        kg, ku, kd, key = jax.random.split(key, 4)
        es = jnp.dtype(dtype).itemsize
        g = jax.random.normal(kg, (rows, F), jnp.float32).astype(dtype)
        u = jax.random.normal(ku, (rows, F), jnp.float32).astype(dtype)
        dh = jax.random.normal(kd, (rows, F), jnp.float32).astype(dtype)
        if packed:
            gu = jnp.concatenate([g, u], -1)
            fwd_carry, bwd_carry = None, (gu, dh)
        else:
            fwd_carry, bwd_carry = (g, u), (g, u, dh)
        nbytes = {"fwd": 3 * rows * F * es, "bwd": 5 * rows * F * es}
        ours_fwd, xla_fwd, ours_bwd, xla_bwd = _steps(packed)
        xla = {"bwd": _opbench.time_chain(xla_bwd, bwd_carry, args.steps, args.repeats)}
        if not packed:
            xla["fwd"] = _opbench.time_chain(xla_fwd, fwd_carry, args.steps, args.repeats)
        bwd = (_opbench.time_chain(ours_bwd, bwd_carry, args.steps, args.repeats), xla["bwd"])
        if packed:
            table.add(f"[{rows}, {2 * F}] packed", jnp.dtype(dtype).name, "bwd", *bwd, nbytes["bwd"])
        else:
            fwd = (_opbench.time_chain(ours_fwd, fwd_carry, args.steps, args.repeats), xla["fwd"])
            table.add_passes(f"[{rows}, {F}]", jnp.dtype(dtype).name, {"fwd": fwd, "bwd": bwd}, nbytes)
        del g, u, dh
    table.write(args.out)


if __name__ == "__main__":
    main()
