"""Benchmark FP8 GEMMs on GPU at the Qwen3-8B linear-layer shapes (4096 tokens): bf16 XLA dot vs
`fp8_matmul(impl="xla")` (XLA's own cuBLASLt FP8 rewrite) vs `fp8_matmul(impl="ffi")` (our fused
quantizers + cuBLASLt), forward and forward+backward, in TFLOP/s.

    python benchmarks/bench_fp8_matmul.py [--out results.jsonl] [--steps 10] [--repeats 20] [--tokens 4096]

Every fp8 figure includes the quantization of x and w (forward) and of dy (backward) and the
amax reductions, i.e. the whole op as training runs it; "fp8-ffi gemm" is our cuBLASLt call
alone on pre-quantized operands (the ceiling the op could reach). FLOPs: 2 M K N forward,
6 M K N forward+backward. Floors: 989 TFLOP/s dense bf16 and 1979 TFLOP/s dense FP8 on H100 SXM;
"% peak" is against the peak of the impl's own format.
Timing: one jitted program runs `--steps` independent repetitions chained through optimization
barriers (each step waits for the previous one and XLA cannot merge them); per-step time is the
median over `--repeats` calls after warm-up, divided by `--steps`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, fp8_formats
from surogate_jax.ops.fp8_matmul import _gemm_ffi, _quantize_ffi, fp8_matmul
from surogate_jax.precision import fp8

BF16_PEAK = 989e12
FP8_PEAK = 1979e12
# (name, K, N) of the Qwen3-8B linear layers (hidden 4096, intermediate 12288, 8 KV heads x 128)
SHAPES = [("q/o proj", 4096, 4096), ("gate|up", 4096, 12288), ("down", 12288, 4096), ("k/v proj", 4096, 1024)]


def _state(x, w, dy):
    st = fp8_formats.init_matmul_state(16)
    d = fp8_formats.Fp8MatmulState(
        *(fp8_formats.Fp8TensorState(fp8_formats.amax(t), jnp.zeros(16)) for t in (x, w, dy)))
    return fp8.update(st, d)


def _impls(state):
    # the state's scalars are closed over (constants): folding them changes nothing measurable
    return {
        "bf16 xla": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16),
        "fp8 xla": lambda x, w: fp8_matmul(x, w, state, impl="xla"),
        "fp8 ffi": lambda x, w: fp8_matmul(x, w, state, impl="ffi"),
    }


def _chain(fn, mode: str, steps: int):
    """A jitted program running `steps` dependent repetitions of fn(x, w) (fwd or fwd+bwd).
    Every array is an argument: XLA would constant-fold work on closed-over arrays."""

    def run(x, w, dy):
        outs, prev = [], jnp.zeros((), jnp.float32)
        for _ in range(steps):
            xi, _ = jax.lax.optimization_barrier((x, prev))  # waits for the previous step
            if mode == "fwd":
                out = (fn(xi, w),)
            else:
                _, vjp = jax.vjp(fn, xi, w)
                out = vjp(dy)
            out = jax.lax.optimization_barrier(out)
            prev = out[0][0, 0].astype(jnp.float32)
            outs.append(out)
        return outs

    return jax.jit(run)


def _gemm_chain(steps: int, scale):
    """Our cuBLASLt FP8 GEMM alone (forward-like: E4M3 x E4M3, fast accumulation)."""

    def run(xq, wq_t):
        outs, prev = [], jnp.zeros((), jnp.float32)
        for _ in range(steps):
            a, _ = jax.lax.optimization_barrier((xq, prev))
            d = jax.lax.optimization_barrier(_gemm_ffi(a, wq_t, scale, scale, jnp.bfloat16, True))
            prev = d[0, 0].astype(jnp.float32)
            outs.append(d)
        return outs

    return jax.jit(run)


def _time(fn, args, repeats: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()

    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": _commit(),
        "steps": args.steps,
        "repeats": args.repeats,
    }
    m = args.tokens
    print(f"# FP8 GEMMs on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}, "
          f"M = {m} tokens")
    print("| layer | M x K x N | pass | impl | ms | TFLOP/s | % of own peak | speedup vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    records = []
    key = jax.random.key(0)
    for name, k, n in SHAPES:
        kx, kw, kg, key = jax.random.split(key, 4)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        dy = (1e-3 * jax.random.normal(kg, (m, n), jnp.float32)).astype(jnp.bfloat16)
        impls = _impls(_state(x, w, dy))
        for mode in ("fwd", "fwd+bwd"):
            flops = (2 if mode == "fwd" else 6) * m * k * n
            ms = {}
            for iname, fn in impls.items():
                try:
                    ms[iname] = 1e3 * _time(_chain(fn, mode, args.steps), (x, w, dy), args.repeats) / args.steps
                except Exception as e:  # noqa: BLE001  (one failing impl must not hide the others)
                    print(f"| {name} | {m} x {k} x {n} | {mode} | {iname} | failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]} |||||", flush=True)
            if mode == "fwd":
                xq, _, _ = _quantize_ffi(x, jnp.float32(1.0), fp8_formats.E4M3, transposed=False)
                _, wq_t, _ = _quantize_ffi(w, jnp.float32(1.0), fp8_formats.E4M3, transposed=True)
                try:
                    ms["fp8 ffi gemm"] = 1e3 * _time(_gemm_chain(args.steps, jnp.float32(1.0)), (xq, wq_t),
                                                     args.repeats) / args.steps
                except Exception as e:  # noqa: BLE001  (report, keep the other figures)
                    print(f"| {name} | gemm only failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |")
            for iname, t in ms.items():
                tflops = flops / (t * 1e-3) / 1e12
                peak = BF16_PEAK if iname.startswith("bf16") else FP8_PEAK
                base = ms.get("bf16 xla")
                rec = {**meta, "layer": name, "m": m, "k": k, "n": n, "pass": mode, "impl": iname, "ms": t,
                       "tflops": tflops, "pct_peak": 100 * tflops * 1e12 / peak,
                       "speedup_vs_bf16": (base / t) if base else None}
                records.append(rec)
                sp = f"{rec['speedup_vs_bf16']:.2f}x" if base else "-"
                print(f"| {name} | {m} x {k} x {n} | {mode} | {iname} | {t:.3f} | {tflops:.0f} | "
                      f"{rec['pct_peak']:.0f}% | {sp} |", flush=True)
        del x, w, dy
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
