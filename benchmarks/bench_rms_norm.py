"""Benchmark RMSNorm on GPU: our FFI kernels vs XLA's fusion of `rms_norm_ref`, forward and
backward, against the memory-bandwidth floor.

    python benchmarks/bench_rms_norm.py [--out results.jsonl] [--steps 10] [--repeats 20]
                                        [--algos 0,1,2,3] [--fwd-only]
                                        [--fwd-algo K] [--bwd-algo K]

Forward variants: every shape's forward is timed for each kernel variant in --algos (the FFI
attribute fwd_algo, kernels/rms_norm_common.cuh); the main table shows the op's default
(ops/rms_norm.py FWD_ALGO), and a sweep table at the end shows, per shape, XLA's time and each
variant's time, GB/s, % of 3000 GB/s and XLA/ours, with the fastest marked (JSON: pass "fwd algo k").

Timing and passes: see benchmarks/_opbench.py (fwd and bwd are timed separately: a chained
fwd+bwd program lets XLA fuse the reference's forward into its backward and read x once for
both, which real training with the passes layers apart cannot do). Our backward is given the
forward's saved rstd; XLA's is given x and recomputes what it needs.
Bytes counted (useful traffic): forward reads x, writes y and rstd; backward reads dy, x and rstd
and writes dx (w and dw are negligible). "% of 3000" is of the H100's measured copy bandwidth.
"""

from __future__ import annotations

import argparse

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, rms_norm_ref
from surogate_jax.ops.rms_norm import BWD_ALGO, FWD_ALGO, _bwd_ffi, _fwd_ffi

# Qwen3-0.6B / -8B / -14B hidden sizes, and the per-head q/k norm (16 heads x 128).
SHAPES = [(16384, 1024), (16384, 4096), (8192, 5120), (16384 * 16, 128)]
DTYPES = [jnp.bfloat16, jnp.float32]
EPS = 1e-6


def sweep_report(op: str, rows: list[dict], meta: dict, pass_: str = "fwd") -> list[dict]:
    """Print the variant table of one pass ("fwd" / "bwd"); rows: {shape, dtype, xla_s, bytes,
    algos: {k: seconds}}. Returns one JSON record per (shape, dtype, algo)."""
    algos = sorted({k for r in rows for k in r["algos"]})
    print(f"\n# {op} {'forward' if pass_ == 'fwd' else 'backward'} variants "
          f"(us | GB/s | % of {_opbench.PEAK_GBS:.0f} | xla/ours); * = fastest")
    print("| shape | dtype | xla us | " + " | ".join(f"algo {k}" for k in algos) + " |")
    print("|---|---|---|" + "---|" * len(algos))
    recs = []
    for r in rows:
        best = min(r["algos"], key=r["algos"].get)
        cells = []
        for k in algos:
            t = r["algos"].get(k)
            if t is None:
                cells.append("-")
                continue
            gbs = r["bytes"] / t / 1e9
            mark = " *" if k == best else ""
            cells.append(f"{t * 1e6:.1f}/{gbs:.0f}/{100 * gbs / _opbench.PEAK_GBS:.0f}%/"
                         f"{r['xla_s'] / t:.2f}x{mark}")
            recs.append({**meta, "shape": r["shape"], "dtype": r["dtype"], "pass": f"{pass_} algo {k}",
                         "algo": k, "ours_us": t * 1e6, "xla_us": r["xla_s"] * 1e6,
                         "speedup_vs_xla": r["xla_s"] / t, "bytes": r["bytes"], "ours_gbs": gbs,
                         "pct_peak": 100 * gbs / _opbench.PEAK_GBS, "best": k == best})
        print(f"| {r['shape']} | {r['dtype']} | {r['xla_s'] * 1e6:.1f} | " + " | ".join(cells) + " |",
              flush=True)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=40,
                    help="chained steps per timed call (fewer lets the per-call overhead inflate both times)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--algos", default="0,1,2,3", help="forward variants to time (fwd_algo)")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward (sweep only)")
    ap.add_argument("--fwd-algo", type=int, default=FWD_ALGO, help="forward variant of the main table")
    ap.add_argument("--bwd-algo", type=int, default=BWD_ALGO, help="backward variant (bwd_algo)")
    args = ap.parse_args()
    algos = sorted({int(a) for a in args.algos.split(",")} | {args.fwd_algo})
    _opbench.require_gpu(ffi_available)
    table = _opbench.Table("rms_norm", args.steps, args.repeats,
                           variant=f"fwd_algo {args.fwd_algo}, bwd_algo {args.bwd_algo}")
    sweep = []
    key = jax.random.key(0)
    for rows, dim in SHAPES:
        for dtype in DTYPES:
            kx, kd, kw, key = jax.random.split(key, 4)
            x = jax.random.normal(kx, (rows, dim), jnp.float32).astype(dtype)
            dy = jax.random.normal(kd, (rows, dim), jnp.float32).astype(dtype)
            w = (1.0 + 0.1 * jax.random.normal(kw, (dim,), jnp.float32)).astype(dtype)
            _, rstd = jax.jit(lambda x, w: _fwd_ffi(x, w, EPS))(x, w)

            xla_fwd = lambda x: (rms_norm_ref(x, w, EPS),)  # noqa: E731,B023
            ours_bwd = lambda dy, x, rstd: (_bwd_ffi(dy, x, w, rstd, args.bwd_algo)[0], x, rstd)  # noqa: E731,B023
            xla_bwd = lambda dy, x, rstd: (  # noqa: E731
                jax.vjp(lambda x: rms_norm_ref(x, w, EPS), x)[1](dy)[0], x, rstd)  # noqa: B023
            xla_s = _opbench.time_chain(xla_fwd, (x,), args.steps, args.repeats)
            fwd_s = {a: _opbench.time_chain(lambda x, a=a: (_fwd_ffi(x, w, EPS, algo=a)[0],),  # noqa: B023
                                            (x,), args.steps, args.repeats) for a in algos}
            elem = rows * dim * jnp.dtype(dtype).itemsize
            nbytes = {"fwd": 2 * elem + 4 * rows, "bwd": 3 * elem + 4 * rows}
            sweep.append({"shape": f"{rows}x{dim}", "dtype": jnp.dtype(dtype).name, "xla_s": xla_s,
                          "bytes": nbytes["fwd"], "algos": fwd_s})
            if not args.fwd_only:
                t = {
                    "fwd": (fwd_s[args.fwd_algo], xla_s),
                    "bwd": tuple(_opbench.time_chain(f, (dy, x, rstd), args.steps, args.repeats)
                                 for f in (ours_bwd, xla_bwd)),
                }
                table.add_passes(f"{rows}x{dim}", jnp.dtype(dtype).name, t, nbytes)
            del x, dy, rstd
    table.write(args.out)
    _opbench.append_jsonl(args.out, sweep_report("rms_norm", sweep, table.meta))


if __name__ == "__main__":
    main()
