"""Run one RMSNorm or residual+RMSNorm pass a few times, for Nsight Compute to profile.

    ncu --profile-from-start off --clock-control none --print-units base --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 benchmarks/profile/profile_norm.py --op rms_norm --shape 16384x1024 --pass fwd --impl ffi

--impl ffi: our kernel (one per pass); xla: XLA's fusion of the reference
(forward, or jax.vjp's backward with the weight gradient); copy: an XLA element-wise fusion
moving the pass's row bytes (rms_norm fwd y = x + 1, bwd dx = dy + x; add_rms_norm fwd
(x + r, x - r), bwd dx = dy + ds + s), the kernel-only floor at that size.

Why: the chained op benchmarks are not trustworthy below ~100 MB a step (calibrate_opbench.py);
the [16384, 1024] bf16 RMSNorm forward moves 67 MB, so its figure comes from here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from surogate_jax.ops import add_rms_norm_ref, ffi_available, rms_norm_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _opbench.py, bench_<op>.py
import _opbench
from profile_swiglu import _shape

EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--op", default="rms_norm", choices=("rms_norm", "add_rms_norm"))
    ap.add_argument("--shape", type=_shape, default=(16384, 1024), help="ROWSxD (default 16384x1024)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--impl", default="ffi", choices=("ffi", "xla", "copy"))
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    import importlib

    mod = importlib.import_module(f"surogate_jax.ops.{args.op}")  # the package exports functions of these names
    rows, D = args.shape
    dtype = jnp.dtype(args.dtype)
    ks = jax.random.split(jax.random.key(0), 5)
    x, r, dy, ds = (jax.random.normal(k, (rows, D), jnp.float32).astype(dtype) for k in ks[:4])
    w = (1.0 + 0.1 * jax.random.normal(ks[4], (D,), jnp.float32)).astype(dtype)
    fwd = args.pass_ == "fwd"
    one = jnp.asarray(1, dtype)
    # Every tensor is an argument of the jitted call (closed-over arrays would be constants that
    # XLA may fold at compile time).
    if args.op == "rms_norm":
        s = x
        rstd = jax.jit(lambda x, w: mod._fwd_ref(x, w, EPS)[1])(x, w)
        fns = {
            ("fwd", "ffi"): lambda x, r, dy, ds, s, w, rstd: mod._fwd_ffi(x, w, EPS),
            ("fwd", "xla"): lambda x, r, dy, ds, s, w, rstd: rms_norm_ref(x, w, EPS),
            ("fwd", "copy"): lambda x, r, dy, ds, s, w, rstd: x + one,
            ("bwd", "ffi"): lambda x, r, dy, ds, s, w, rstd: mod._bwd_ffi(dy, x, w, rstd),
            ("bwd", "xla"): lambda x, r, dy, ds, s, w, rstd: jax.vjp(lambda x, w: rms_norm_ref(x, w, EPS), x, w)[1](dy),
            ("bwd", "copy"): lambda x, r, dy, ds, s, w, rstd: dy + x,
        }
        n = 2 if fwd else 3
    else:
        _, s, rstd = jax.jit(lambda x, r, w: mod._fwd_ref(x, r, w, EPS))(x, r, w)
        fns = {
            ("fwd", "ffi"): lambda x, r, dy, ds, s, w, rstd: mod._fwd_ffi(x, r, w, EPS),
            ("fwd", "xla"): lambda x, r, dy, ds, s, w, rstd: add_rms_norm_ref(x, r, w, EPS),
            ("fwd", "copy"): lambda x, r, dy, ds, s, w, rstd: (x + r, x - r),
            ("bwd", "ffi"): lambda x, r, dy, ds, s, w, rstd: mod._bwd_ffi(dy, ds, s, w, rstd),
            ("bwd", "xla"): lambda x, r, dy, ds, s, w, rstd: jax.vjp(
                lambda x, r, w: add_rms_norm_ref(x, r, w, EPS), x, r, w)[1]((dy, ds)),
            ("bwd", "copy"): lambda x, r, dy, ds, s, w, rstd: dy + ds + s,
        }
        n = 4
    fn = jax.jit(fns[(args.pass_, args.impl)])
    _opbench.profile_calls(lambda: fn(x, r, dy, ds, s, w, rstd), args.calls)
    nbytes = x.nbytes * n
    print(f"{args.op} {rows}x{D} {args.pass_} {args.impl} {dtype.name}: {args.calls} calls, {nbytes / 1e6:.1f} MB "
          f"of rows each (floor {nbytes / 3e12 * 1e6:.1f} us at 3000 GB/s)")


if __name__ == "__main__":
    main()
