"""Run one SwiGLU+LoRA pass a few times, for Nsight Compute to profile (kernel-only durations).

    ncu --profile-from-start off --clock-control none --print-units base --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 benchmarks/profile_swiglu_lora.py --shape 4096x3072 --rank 16 --pass fwd --impl ffi

--impl ffi: `swiglu_lora` on our kernel; xla: XLA's compilation of the model's unfused formula
(`swiglu_lora_ref`: the LoRA GEMMs, then the adds fused with SwiGLU); copy: an XLA element-wise
fusion moving the pass's row bytes (fwd gate + up; bwd (dh + gate, dh + up)), the floor.
fwd: h (xla: with its LoRA GEMMs). bwd: the kernel pass, dgate_up from dh (xla: the same values,
`_bwd_ref`, with its LoRA GEMMs); the LoRA factors' gradient GEMMs, the same on both sides in the
model, are left out (under ncu the whole VJP's cuBLAS GEMMs crashed the profiled process).

Why: inside the LoRA train step the SwiGLU inputs are sums; the in-kernel LoRA products are what
should make this faster than XLA's fusion (which writes and reads the [rows, F] LoRA outputs).
"""

from __future__ import annotations

import argparse
import importlib

import _opbench
import jax
import jax.numpy as jnp
from profile_swiglu import _shape

from surogate_jax.ops import ffi_available, swiglu_lora, swiglu_lora_ref

SCALE = 2.0
sl = importlib.import_module("surogate_jax.ops.swiglu_lora")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", type=_shape, default=(4096, 3072), help="ROWSxF (default 4096x3072: Qwen3-0.6B, 2 x 2048 tokens)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--impl", default="ffi", choices=("ffi", "xla", "copy"))
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    (rows, F), R = args.shape, args.rank
    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 4)
    gu = jax.random.normal(k[0], (rows, 2 * F), jnp.float32).astype(dtype)
    xa = jax.random.normal(k[1], (rows, 2 * R), jnp.float32).astype(dtype)
    b = (0.1 * jax.random.normal(k[2], (2, R, F), jnp.float32)).astype(dtype)
    dh = jax.random.normal(k[3], (rows, F), jnp.float32).astype(dtype)
    op = {"ffi": lambda g, x, bb: swiglu_lora(g, x, bb, SCALE, impl="ffi"),
          "xla": lambda g, x, bb: swiglu_lora_ref(g, x, bb, SCALE)}.get(args.impl)
    if args.pass_ == "fwd":
        fn = op if op else (lambda g, x, bb: g[:, :F] + g[:, F:])
        jfn = jax.jit(fn)
        _opbench.profile_calls(lambda: jfn(gu, xa, b), args.calls)
    else:
        fn = {"ffi": lambda d, g, x, bb: sl._bwd_ffi(d, g, x, bb, SCALE),
              "xla": lambda d, g, x, bb: sl._bwd_ref(d, g, x, bb, SCALE),
              "copy": lambda d, g, x, bb: jnp.concatenate([d + g[:, :F], d + g[:, F:]], axis=-1)}[args.impl]
        jfn = jax.jit(fn)
        _opbench.profile_calls(lambda: jfn(dh, gu, xa, b), args.calls)
    nbytes = rows * F * dtype.itemsize * (3 if args.pass_ == "fwd" else 5)
    print(f"swiglu_lora {rows}x{F} r{R} {args.pass_} {args.impl} {dtype.name}: {args.calls} calls, "
          f"{nbytes / 1e6:.1f} MB of rows each (floor {nbytes / 3e12 * 1e6:.1f} us at 3000 GB/s)")


if __name__ == "__main__":
    main()
