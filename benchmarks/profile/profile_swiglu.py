"""Run one SwiGLU pass a few times at a bench_swiglu.py shape, for Nsight Compute to profile.

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum,\
launch__grid_size,launch__block_size,launch__registers_per_thread \
        python3 benchmarks/profile/profile_swiglu.py --shape 16384x3072 --pass fwd --impl ffi

--impl ffi: our kernel; xla: XLA's fusion of swiglu_ref
(the forward, or jax.vjp's backward); copy: an XLA element-wise fusion that moves the same bytes
(fwd h = gate + up; bwd (dh + gate, dh + up)), the kernel-only floor for that traffic.

Why: chained timings (bench_swiglu.py) of two kernels at the copy limit differ by a few percent
that may be the harness's; kernel-only durations and launch shapes say whether a gap is the kernel
(its grid, its access order) or the harness.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, swiglu_ref
from surogate_jax.ops.swiglu import _bwd_ffi, _fwd_ffi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _opbench.py, bench_<op>.py
import _opbench


def _shape(s: str) -> tuple[int, int]:
    try:
        rows, f = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxF such as 16384x3072, got {s!r}") from None
    if rows < 1 or f < 1:
        raise argparse.ArgumentTypeError(f"ROWS and F must be positive, got {s!r}")
    return rows, f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", type=_shape, default=(16384, 3072), help="ROWSxF (default 16384x3072)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--impl", default="ffi", choices=("ffi", "xla", "copy"))
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    rows, F = args.shape
    dtype = jnp.dtype(args.dtype)
    kg, ku, kd = jax.random.split(jax.random.key(0), 3)
    g, u, dh = (jax.random.normal(k, (rows, F), jnp.float32).astype(dtype) for k in (kg, ku, kd))
    if args.pass_ == "fwd":
        fn = {
            "ffi": lambda g, u, dh: _fwd_ffi(g, u),
            "xla": lambda g, u, dh: swiglu_ref(g, u),
            "copy": lambda g, u, dh: g + u,
        }[args.impl]
    else:
        fn = {
            "ffi": lambda g, u, dh: _bwd_ffi(dh, g, u),
            "xla": lambda g, u, dh: jax.vjp(swiglu_ref, g, u)[1](dh),
            "copy": lambda g, u, dh: (dh + g, dh + u),
        }[args.impl]
    jfn = jax.jit(fn)
    _opbench.profile_calls(lambda: jfn(g, u, dh), args.calls)
    nbytes = g.nbytes * (3 if args.pass_ == "fwd" else 5)
    print(f"swiglu {rows}x{F} {args.pass_} {args.impl} {dtype.name}: {args.calls} calls, "
          f"{nbytes / 1e6:.1f} MB each (floor {nbytes / 3e12 * 1e6:.1f} us at 3000 GB/s)")


if __name__ == "__main__":
    main()
