"""Benchmark RMSNorm on GPU: our FFI kernel (`rms_norm(..., impl="ffi")`) vs XLA's fusion of
`rms_norm_ref`, forward and forward+backward, reported against the memory-bandwidth floor.

    python benchmarks/bench_rms_norm.py [--out results.jsonl] [--steps 10] [--repeats 20]

Timing: one jitted program applies the op `--steps` times in a chain (each step's output feeds the
next, with an optimization barrier so XLA cannot fuse across steps); the time per step is the
median over `--repeats` calls after warm-up, divided by `--steps`.
Bytes counted (useful traffic): forward reads x, writes y and rstd; backward reads dy, x, rstd and
writes dx (w and dw are negligible). GB/s = bytes / time; "% peak" is of 3000 GB/s, the H100's
measured device copy bandwidth.
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

from surogate_jax.ops import ffi_available, rms_norm, rms_norm_ref

PEAK_GBS = 3000.0
SHAPES = [(4096 * 8, 1024), (16384, 4096), (65536 * 16, 128)]
DTYPES = [jnp.bfloat16, jnp.float32]
EPS = 1e-6


def _chain(fn, mode: str, steps: int):
    """A jitted program running `steps` dependent fwd (or fwd+bwd) steps of fn(x, w)."""

    def step(x, w, acc):
        if mode == "fwd":
            return fn(x, w), acc
        y, vjp = jax.vjp(fn, x, w)
        dx, dw = vjp(y)  # dy = y: the backward reads a full tensor that depends on the forward
        return dx, acc + dw.astype(jnp.float32)

    def run(x, w, acc):
        for _ in range(steps):
            x, acc = jax.lax.optimization_barrier(step(x, w, acc))
        return x, acc

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


def _bytes(rows: int, dim: int, dtype, mode: str) -> int:
    elem = rows * dim * jnp.dtype(dtype).itemsize
    fwd = 2 * elem + 4 * rows
    return fwd if mode == "fwd" else fwd + 3 * elem + 4 * rows


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)

    impls = {
        "ffi": lambda x, w: rms_norm(x, w, EPS, impl="ffi"),
        "xla": lambda x, w: rms_norm_ref(x, w, EPS),
    }
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": _commit(),
        "steps": args.steps,
        "repeats": args.repeats,
    }
    print(f"# RMSNorm on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
    print("| rows x D | dtype | pass | impl | ms | GB/s | % of 3000 | speedup vs xla |")
    print("|---|---|---|---|---|---|---|---|")
    records = []
    key = jax.random.key(0)
    for rows, dim in SHAPES:
        for dtype in DTYPES:
            kx, kw, key = jax.random.split(key, 3)
            x = jax.random.normal(kx, (rows, dim), jnp.float32).astype(dtype)
            w = (1.0 + 0.1 * jax.random.normal(kw, (dim,), jnp.float32)).astype(dtype)
            acc = jnp.zeros((dim,), jnp.float32)
            for mode in ("fwd", "fwd+bwd"):
                ms = {}
                for name, fn in impls.items():
                    sec = _time(_chain(fn, mode, args.steps), (x, w, acc), args.repeats)
                    ms[name] = 1e3 * sec / args.steps
                for name in impls:
                    gbs = _bytes(rows, dim, dtype, mode) / (ms[name] * 1e-3) / 1e9
                    rec = {**meta, "rows": rows, "dim": dim, "dtype": jnp.dtype(dtype).name,
                           "pass": mode, "impl": name, "ms": ms[name], "gbs": gbs,
                           "pct_peak": 100 * gbs / PEAK_GBS, "speedup_vs_xla": ms["xla"] / ms[name]}
                    records.append(rec)
                    print(f"| {rows} x {dim} | {rec['dtype']} | {mode} | {name} | {ms[name]:.3f} | "
                          f"{gbs:.0f} | {rec['pct_peak']:.0f}% | {rec['speedup_vs_xla']:.2f}x |",
                          flush=True)
            del x, w, acc
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
