"""Run one RoPE kernel pass a few times at a bench_rope.py shape, for Nsight Compute to profile.

    ncu --clock-control none -k regex:'rope|col_sum' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python3 benchmarks/profile/profile_rope.py --shape "0.6b q" --pass bwd [--source table]
    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum \
        python3 benchmarks/profile/profile_rope.py --impl xla --shape "8b k" --pass bwd --source table

--impl copy profiles an XLA element-wise fusion that moves the same row bytes (the kernel-only
floor at that size: small tensors cannot reach the large-copy bandwidth). --impl xla profiles XLA's
fusion of the reference instead (all its kernels: every kernel launched
between cudaProfilerStart and cudaProfilerStop, which this script calls around the measured calls
when cudart can be loaded, so ncu --profile-from-start off skips the setup's kernels).

Why: the chained timings of bench_rope.py include the launch gaps and, for the norm backward, the
dw column-sum kernel, and are not trustworthy below ~100 MB a step (calibrate_opbench.py); ncu gives
each kernel's own duration, DRAM throughput and stall reasons. `bash benchmarks/gpu_session.sh
ncu_rope` runs it for the forward and backward kernels, `ncu_ops` for ours / XLA / copy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops import ffi_available
from surogate_jax.ops.rope import _bwd_ffi, _fwd_ffi, _qk_bwd_ffi, _qk_fwd_ffi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _opbench.py, bench_<op>.py
import _opbench
from bench_rope import EPS, PAIRS, SHAPES, _ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="0.6b q", choices=[*SHAPES, *PAIRS],
                    help="a bench_rope.py shape, or a q/k pair (rope_qk's paired launch; XLA / copy: both tensors)")
    ap.add_argument("--pass", dest="pass_", default="bwd", choices=("fwd", "bwd"))
    ap.add_argument("--source", default="positions", choices=("positions", "table"))
    ap.add_argument("--no-norm", dest="norm", action="store_false", help="rotation only (fwd)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--impl", default="ffi", choices=("ffi", "xla", "copy"),
                    help="our kernel, XLA's fusion of the reference, or 'copy': XLA's element-wise fusion moving "
                         "the pass's row bytes (fwd y = x + 1, bwd dx = dy + x), the same-size floor")
    args = ap.parse_args()
    if args.pass_ == "bwd" and not args.norm:
        ap.error("--no-norm is a forward option: the rotation-only backward is the forward with inverse angles")
    _opbench.require_gpu(ffi_available)
    names = PAIRS.get(args.shape, (args.shape,))
    B, T, _, K = SHAPES[names[0]]
    dtype = jnp.dtype(args.dtype)
    keys = iter(jax.random.split(jax.random.key(0), 3 * len(names)))
    xs = tuple(jax.random.normal(next(keys), SHAPES[n], jnp.float32).astype(dtype) for n in names)
    dys = tuple(jax.random.normal(next(keys), SHAPES[n], jnp.float32).astype(dtype) for n in names)
    ws = tuple((1.0 + 0.1 * jax.random.normal(next(keys), (K,), jnp.float32)).astype(dtype) for _ in names)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, T, size=(B, T)), jnp.int32)
    inv = jnp.asarray(1.0 / 1e6 ** (np.arange(0, K, 2) / K), jnp.float32)
    if args.source == "positions":
        a, b = pos, inv
    else:
        ang = pos.astype(jnp.float32)[..., None] * inv
        ang = jnp.concatenate([ang, ang], axis=-1)
        a, b = jnp.cos(ang), jnp.sin(ang)
    fwd = args.pass_ == "fwd"
    if args.impl == "copy":
        one = jnp.asarray(1, dtype)
        fn = jax.jit(lambda dys, xs: tuple(x + one for x in xs) if fwd else tuple(d + x for d, x in zip(dys, xs)))
    elif args.impl == "xla":
        if fwd:
            fn = jax.jit(lambda dys, xs: tuple(_ref(x, a, b, w if args.norm else None) for x, w in zip(xs, ws)))
        else:
            fn = jax.jit(lambda dys, xs: tuple(
                jax.vjp(lambda x, w: _ref(x, a, b, w), x, w)[1](d) for d, x, w in zip(dys, xs, ws)))
    elif fwd:
        wn = ws if args.norm else (jnp.zeros((0,), dtype),) * len(xs)
        kw = {"eps": EPS, "norm": args.norm, "inverse": False}
        if len(xs) == 2:  # the paired launch (rope_qk)
            fn = jax.jit(lambda dys, xs: _qk_fwd_ffi(*xs, a, b, *wn, **kw))
        else:
            fn = jax.jit(lambda dys, xs: _fwd_ffi(xs[0], a, b, wn[0], **kw))
    else:
        if len(xs) == 2:
            fn = jax.jit(lambda dys, xs: _qk_bwd_ffi(*dys, *xs, a, b, *ws, eps=EPS))
        else:
            fn = jax.jit(lambda dys, xs: _bwd_ffi(dys[0], xs[0], a, b, ws[0], eps=EPS))
    call = lambda: fn(dys, xs)  # noqa: E731
    _opbench.profile_calls(call, args.calls)
    nbytes = sum(x.nbytes for x in xs) * (2 if fwd else 3)
    heads = "+".join(str(x.shape[2]) for x in xs)
    print(f"{args.shape} {B}x{T}x{heads}x{K} {args.pass_} {args.impl} {args.source} {dtype.name}: "
          f"{args.calls} calls, {nbytes / 1e6:.1f} MB of rows each (floor {nbytes / 3e12 * 1e6:.1f} us at 3000 GB/s)")


if __name__ == "__main__":
    main()
