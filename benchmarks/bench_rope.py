"""Benchmark RoPE on GPU: our FFI kernel (`rope(..., impl="ffi")`) vs XLA's fusion of `rope_ref`,
rotation only and fused with the per-head q/k RMSNorm (Qwen3), angles from positions (cos/sin
computed in the kernel / in XLA's fusion) or from HF-style fp32 [B, T, K] cos/sin tables (what the
model passes), forward and forward+backward, at Qwen3-0.6B and -8B q/k shapes.

    python benchmarks/bench_rope.py [--out results.jsonl] [--steps 10] [--repeats 20] [--dtype bfloat16]

Timing: one jitted program applies the op `--steps` times in a chain (each step's output feeds the
next, with an optimization barrier so XLA cannot fuse across steps); the time per step is the
median over `--repeats` calls after warm-up, divided by `--steps`.
Bytes counted (useful traffic): forward reads x and writes y; the rotation-only backward reads dy
and writes dx; the norm backward reads dy and x and writes dx; plus the angle source per pass
(positions: 4 bytes per token; tables: the K/2 cos and sin floats per token that are read).
GB/s = bytes / time; "% peak" is of 3000 GB/s, the H100's measured device copy bandwidth.
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
import numpy as np

from surogate_jax.ops import ffi_available, rope, rope_ref

PEAK_GBS = 3000.0
# name -> (B, T, H, K)
SHAPES = {
    "qwen3-0.6b q": (4, 2048, 16, 128),
    "qwen3-0.6b k": (4, 2048, 8, 128),
    "qwen3-8b q": (2, 2048, 32, 128),
    "qwen3-8b k": (2, 2048, 8, 128),
}
EPS = 1e-6


def _chain(fn, mode: str, steps: int, norm: bool):
    """A jitted program running `steps` dependent fwd (or fwd+bwd) steps of fn(x, w)."""

    def step(x, w, acc):
        if mode == "fwd":
            return fn(x, w), acc
        y, vjp = jax.vjp(fn, x, w)
        dx, dw = vjp(y)  # dy = y: the backward reads a full tensor that depends on the forward
        return dx, (acc + dw.astype(jnp.float32)) if norm else acc

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


def _bytes(shape, dtype, mode: str, norm: bool, source: str) -> int:
    B, T, H, K = shape
    elem = B * T * H * K * jnp.dtype(dtype).itemsize
    angles = B * T * (4 if source == "positions" else 2 * 4 * (K // 2))
    fwd = 2 * elem + angles
    if mode == "fwd":
        return fwd
    return fwd + (3 if norm else 2) * elem + angles


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
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args()

    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)

    dtype = jnp.dtype(args.dtype)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": _commit(),
        "steps": args.steps,
        "repeats": args.repeats,
    }
    print(f"# RoPE on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
    print("| shape | B,T,H,K | norm | angles | pass | impl | us | GB/s | % of 3000 | speedup vs xla |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    records = []
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    for label, shape in SHAPES.items():
        B, T, H, K = shape
        kx, kw, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        w = (1.0 + 0.1 * jax.random.normal(kw, (K,), jnp.float32)).astype(dtype)
        pos = jnp.asarray(rng.integers(0, T, size=(B, T)), jnp.int32)
        inv = jnp.asarray(1.0 / 1e6 ** (np.arange(0, K, 2) / K), jnp.float32)
        ang = pos.astype(jnp.float32)[..., None] * inv
        ang = jnp.concatenate([ang, ang], axis=-1)
        tab = (jnp.cos(ang), jnp.sin(ang))
        acc = jnp.zeros((K,), jnp.float32)
        for norm in (True, False):
            for source in ("positions", "table"):
                src = {"positions": pos, "inv_freq": inv} if source == "positions" else {"table": tab}
                nw = (lambda w: w) if norm else (lambda w: None)
                impls = {
                    "ffi": lambda x, w, src=src, nw=nw: rope(x, **src, norm_w=nw(w), eps=EPS, impl="ffi"),
                    "xla": lambda x, w, src=src, nw=nw: rope_ref(x, **src, norm_w=nw(w), eps=EPS),
                }
                for mode in ("fwd", "fwd+bwd"):
                    us = {}
                    for name, fn in impls.items():
                        sec = _time(_chain(fn, mode, args.steps, norm), (x, w, acc), args.repeats)
                        us[name] = 1e6 * sec / args.steps
                    for name in impls:
                        gbs = _bytes(shape, dtype, mode, norm, source) / (us[name] * 1e-6) / 1e9
                        rec = {**meta, "shape": label, "B": B, "T": T, "H": H, "K": K,
                               "dtype": dtype.name, "norm": norm, "angles": source, "pass": mode,
                               "impl": name, "us": us[name], "gbs": gbs,
                               "pct_peak": 100 * gbs / PEAK_GBS, "speedup_vs_xla": us["xla"] / us[name]}
                        records.append(rec)
                        print(f"| {label} | {B},{T},{H},{K} | {'norm' if norm else '-'} | {source} | {mode} | "
                              f"{name} | {us[name]:.1f} | {gbs:.0f} | {rec['pct_peak']:.0f}% | "
                              f"{rec['speedup_vs_xla']:.2f}x |", flush=True)
        del x, w, acc, tab
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
