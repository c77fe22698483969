"""Benchmark the fused residual add + RMSNorm on GPU: our FFI kernels vs XLA's fusion of the
unfused reference (`x + residual`, then `rms_norm_ref`), forward and backward, against the
memory-bandwidth floor.

    python benchmarks/bench_add_rms_norm.py [--out results.jsonl] [--steps 40] [--repeats 20] [--fwd-only]

Timing and passes: see benchmarks/_opbench.py. XLA's backward is given what the unfused model
saves (the residual stream s), computes the norm gradient and adds the residual's gradient.
Bytes counted (useful traffic): forward reads x and residual and writes y and s (4 x D per row,
plus rstd); backward reads dy, ds and s and writes dx (4 x D per row, plus rstd).
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import add_rms_norm_ref, ffi_available, rms_norm_ref
from surogate_jax.ops.add_rms_norm import _bwd_ffi, _fwd_ffi

SHAPES = [(16384, 1024), (16384, 4096), (8192, 5120)]
DTYPES = [jnp.bfloat16, jnp.float32]
EPS = 1e-6


def _xla_bwd(dy, ds, s, w):
    dx = jax.vjp(lambda s: rms_norm_ref(s, w, EPS), s)[1](dy)[0]
    return (dx.astype(jnp.float32) + ds.astype(jnp.float32)).astype(s.dtype)


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    table = _opbench.Table("add_rms_norm", args.steps, args.repeats)
    key = jax.random.key(0)
    for rows, dim in SHAPES:
        for dtype in DTYPES:
            ks = jax.random.split(key, 6)
            key = ks[0]
            x, res, dy, ds = (jax.random.normal(k, (rows, dim), jnp.float32).astype(dtype) for k in ks[1:5])
            w = (1.0 + 0.1 * jax.random.normal(ks[5], (dim,), jnp.float32)).astype(dtype)
            _, s, rstd = jax.jit(lambda x, r, w: _fwd_ffi(x, r, w, EPS))(x, res, w)

            ours_fwd = lambda x, r: _fwd_ffi(x, r, w, EPS)[:2]  # noqa: E731,B023
            xla_fwd = lambda x, r: add_rms_norm_ref(x, r, w, EPS)  # noqa: E731,B023
            ours_bwd = lambda dy, ds, s, rstd: (_bwd_ffi(dy, ds, s, w, rstd)[0], ds, s, rstd)  # noqa: E731,B023
            xla_bwd = lambda dy, ds, s, rstd: (_xla_bwd(dy, ds, s, w), ds, s, rstd)  # noqa: E731,B023
            elem = rows * dim * jnp.dtype(dtype).itemsize
            nbytes = {"fwd": 4 * elem + 4 * rows, "bwd": 4 * elem + 4 * rows}
            shape, dname = f"{rows}x{dim}", jnp.dtype(dtype).name
            fwd = tuple(_opbench.time_chain(f, (x, res), args.steps, args.repeats) for f in (ours_fwd, xla_fwd))
            if args.fwd_only:
                table.add(shape, dname, "fwd", *fwd, nbytes["fwd"])
            else:
                bwd = tuple(_opbench.time_chain(f, (dy, ds, s, rstd), args.steps, args.repeats)
                            for f in (ours_bwd, xla_bwd))
                table.add_passes(shape, dname, {"fwd": fwd, "bwd": bwd}, nbytes)
            del x, res, dy, ds, s, rstd
    table.write(args.out)


if __name__ == "__main__":
    main()
