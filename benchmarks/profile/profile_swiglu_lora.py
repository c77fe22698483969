"""Run one SwiGLU+LoRA pass a few times, for Nsight Compute to profile (kernel-only durations).

    ncu --profile-from-start off --clock-control none --print-units base --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 benchmarks/profile/profile_swiglu_lora.py --shape 4096x3072 --rank 16 --pass fwd --impl ffi

--impl ffi: `swiglu_lora` on our kernel (--form packed: gate_up one [rows, 2F] array; sep: gate
and up as two [rows, F] arrays); xla: XLA's compilation of the model's unfused formula
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
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, swiglu_lora, swiglu_lora_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _opbench.py, bench_<op>.py
import _opbench
from profile_swiglu import _shape

sl = importlib.import_module("surogate_jax.ops.swiglu_lora")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", type=_shape, default=(4096, 3072),
                    help="ROWSxF (default 4096x3072: Qwen3-0.6B, 2 x 2048 tokens)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--scale", type=float, default=2.0,
                    help="LoRA scale (default 2.0; in bf16 a power of two >= 1 is folded into xa)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--impl", default="ffi", choices=("ffi", "xla", "copy"))
    ap.add_argument("--form", default="packed", choices=("packed", "sep"))
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    (rows, F), R = args.shape, args.rank
    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 4)
    gu = jax.random.normal(k[0], (rows, 2 * F), jnp.float32).astype(dtype)
    xa = jax.random.normal(k[1], (rows, 2 * R), jnp.float32).astype(dtype)
    b = (0.1 * jax.random.normal(k[2], (2, R, F), jnp.float32)).astype(dtype)
    dh = jax.random.normal(k[3], (rows, F), jnp.float32).astype(dtype)
    base = (gu,) if args.form == "packed" else (gu[:, :F], gu[:, F:])
    nb = len(base)
    if args.pass_ == "fwd":
        def gate_up(a):  # the op's base argument: one packed array or the (gate, up) pair
            return a[:-2] if nb == 2 else a[0]

        fn = {"ffi": lambda *a: swiglu_lora(gate_up(a), a[-2], a[-1], args.scale, impl="ffi"),
              "xla": lambda *a: swiglu_lora_ref(gate_up(a), a[-2], a[-1], args.scale),
              "copy": lambda *a: sum(sl._halves(a[:-2]))}[args.impl]
        jfn = jax.jit(fn)
        _opbench.profile_calls(lambda: jfn(*base, xa, b), args.calls)
    else:
        def copy(dhs, base, x, bb, scale):
            g, u = sl._halves(base)
            return dhs[0] + g, dhs[0] + u
        pass_fn = {"ffi": sl._pass_ffi, "xla": sl._pass_ref, "copy": copy}[args.impl]
        jfn = jax.jit(lambda d, *a: pass_fn((d,), a[:-2], a[-2], a[-1], scale=args.scale))
        _opbench.profile_calls(lambda: jfn(dh, *base, xa, b), args.calls)
    nbytes = rows * F * dtype.itemsize * (3 if args.pass_ == "fwd" else 5)
    print(f"swiglu_lora {rows}x{F} r{R} {args.pass_} {args.impl} {args.form} {dtype.name}: {args.calls} calls, "
          f"{nbytes / 1e6:.1f} MB of rows each (floor {nbytes / 3e12 * 1e6:.1f} us at 3000 GB/s)")


if __name__ == "__main__":
    main()
