"""Benchmark RMSNorm on GPU: our FFI kernels vs XLA's fusion of `rms_norm_ref`, forward and
backward, against the memory-bandwidth floor.

    python benchmarks/bench_rms_norm.py [--out results.jsonl] [--steps 40] [--repeats 20] [--fwd-only]

Timing and passes: see benchmarks/_opbench.py (fwd and bwd are timed separately: a chained
fwd+bwd program lets XLA fuse the reference's forward into its backward and read x once for
both, which real training with the passes layers apart cannot do). Our backward is given the
forward's saved rstd; XLA's is given x and recomputes what it needs.
Bytes counted (useful traffic): forward reads x, writes y and rstd; backward reads dy, x and rstd
and writes dx (w and dw are negligible). "% of 3000" is of the H100's measured copy bandwidth.
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, rms_norm_ref
from surogate_jax.ops.rms_norm import _bwd_ffi, _fwd_ffi

# Qwen3-0.6B / -8B / -14B hidden sizes, and the per-head q/k norm (16 heads x 128).
SHAPES = [(16384, 1024), (16384, 4096), (8192, 5120), (16384 * 16, 128)]
DTYPES = [jnp.bfloat16, jnp.float32]
EPS = 1e-6


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    table = _opbench.Table("rms_norm", args.steps, args.repeats)
    key = jax.random.key(0)
    for rows, dim in SHAPES:
        for dtype in DTYPES:
            kx, kd, kw, key = jax.random.split(key, 4)
            x = jax.random.normal(kx, (rows, dim), jnp.float32).astype(dtype)
            dy = jax.random.normal(kd, (rows, dim), jnp.float32).astype(dtype)
            w = (1.0 + 0.1 * jax.random.normal(kw, (dim,), jnp.float32)).astype(dtype)
            _, rstd = jax.jit(lambda x, w: _fwd_ffi(x, w, EPS))(x, w)

            ours_fwd = lambda x: (_fwd_ffi(x, w, EPS)[0],)  # noqa: E731,B023
            xla_fwd = lambda x: (rms_norm_ref(x, w, EPS),)  # noqa: E731,B023
            ours_bwd = lambda dy, x, rstd: (_bwd_ffi(dy, x, w, rstd)[0], x, rstd)  # noqa: E731,B023
            xla_bwd = lambda dy, x, rstd: (  # noqa: E731
                jax.vjp(lambda x: rms_norm_ref(x, w, EPS), x)[1](dy)[0], x, rstd)  # noqa: B023
            elem = rows * dim * jnp.dtype(dtype).itemsize
            nbytes = {"fwd": 2 * elem + 4 * rows, "bwd": 3 * elem + 4 * rows}
            shape, dname = f"{rows}x{dim}", jnp.dtype(dtype).name
            fwd = tuple(_opbench.time_chain(f, (x,), args.steps, args.repeats) for f in (ours_fwd, xla_fwd))
            if args.fwd_only:
                table.add(shape, dname, "fwd", *fwd, nbytes["fwd"])
            else:
                bwd = tuple(_opbench.time_chain(f, (dy, x, rstd), args.steps, args.repeats)
                            for f in (ours_bwd, xla_bwd))
                table.add_passes(shape, dname, {"fwd": fwd, "bwd": bwd}, nbytes)
            del x, dy, rstd
    table.write(args.out)


if __name__ == "__main__":
    main()
