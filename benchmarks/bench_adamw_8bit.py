"""Benchmark the fused 8-bit AdamW update on GPU against the memory-bandwidth floor: our kernel
(`adamw_8bit`, impl auto -> CUDA) vs jax.jit of its pure-JAX reference (impl="ref", XLA fusions) vs
fp32 optax.adamw, over whole parameter sets with Qwen3 shapes (stacked [L, ...] leaves, as our models
and the trainer hold them: one launch per leaf), plus the largest single tensor (the embedding) on
its own.

    python benchmarks/bench_adamw_8bit.py [--out results.jsonl] [--sets qwen3-0.6b,qwen3-1.7b] [--repeats 10]

Timing: one jitted step (update + parameter write, state and params donated so the update is in place)
called `--repeats` times after warm-up, each call feeding the next; the median wall time per call
("ms"), and the mean over `--repeats` calls enqueued back to back with one sync at the end ("ms
pipelined": no host round trip per call). Bytes counted, per element: parameter read + write, gradient
read, optimizer state read + write (8-bit: 2 x 1 byte codes + absmax 8 / 256 each way; fp32 AdamW: 2 x 4
bytes), i.e. the floor any implementation must move ("B/param" = these bytes per parameter: 16.06 for
f32 params and grads, 10.06 for bf16). GB/s = bytes / time (the better of the two timings); "% of 3000"
of the H100's measured copy bandwidth. Optimizer state bytes per parameter are reported too (8-bit:
2.03; fp32: 8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax

from surogate_jax.ops import ffi_available
from surogate_jax.optim import adamw_8bit, apply_fused

PEAK_GBS = 3000.0

# Qwen3 configs: hidden, intermediate, layers, q heads, kv heads, head dim, vocab (tied embeddings).
QWEN3 = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
}


def qwen3_shapes(name: str) -> dict[str, tuple[int, ...]]:
    D, F, L, H, KV, K, V = QWEN3[name]
    return {
        "embedding": (V, D),
        "q_proj": (L, D, H, K), "k_proj": (L, D, KV, K), "v_proj": (L, D, KV, K), "o_proj": (L, H, K, D),
        "gate_proj": (L, D, F), "up_proj": (L, D, F), "down_proj": (L, F, D),
        "input_layernorm": (L, D), "post_attention_layernorm": (L, D), "q_norm": (L, K), "k_norm": (L, K),
        "norm": (D,),
    }


def _time(fn, args, grads, repeats: int) -> tuple[float, float, tuple]:
    """(median synced seconds per call, mean seconds per call enqueued back to back, last outputs).
    fn(*args, grads) -> new args; the gradients are passed in every call and never returned (a jit
    output that is an un-donated input is a fresh buffer: XLA copies it, which on the H100 added
    ~0.43 ms = 1.2 GB of traffic per call for the 0.16B-element f32 embedding, measured with ncu
    2026-11-22)."""
    for _ in range(3):
        args = fn(*args, grads)
    jax.block_until_ready(args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        args = jax.block_until_ready(fn(*args, grads))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        args = fn(*args, grads)
    args = jax.block_until_ready(args)
    return statistics.median(times), (time.perf_counter() - t0) / repeats, args


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim > 0)


def _moved_bytes(params, grads, state) -> int:
    """Floor bytes of one step: params r+w, grads r, every state array r+w."""
    p = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    g = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grads))
    return 2 * p + g + 2 * _state_bytes(state)


def bench_set(name, shapes, pdtype, gdtype, repeats, meta):
    key = jax.random.key(0)
    params, grads = {}, {}
    for i, (k, shp) in enumerate(shapes.items()):
        kp, kg = jax.random.split(jax.random.fold_in(key, i))
        params[k] = (0.02 * jax.random.normal(kp, shp, jnp.float32)).astype(pdtype)
        grads[k] = (1e-3 * jax.random.normal(kg, shp, jnp.float32)).astype(gdtype)
    n = sum(math.prod(s) for s in shapes.values())
    fp32_mask = {k: len(s) <= 2 and ("norm" in k) for k, s in shapes.items()}  # norms keep fp32 states
    txs = {"adamw_8bit CUDA": adamw_8bit(1e-4, weight_decay=0.01, fp32_mask=fp32_mask),
           "adamw_8bit reference (XLA)": adamw_8bit(1e-4, weight_decay=0.01, fp32_mask=fp32_mask, impl="ref"),
           "optax.adamw fp32": optax.adamw(1e-4, weight_decay=0.01)}
    rows = []
    for label, tx in txs.items():
        state = jax.jit(tx.init)(params)
        moved = _moved_bytes(params, grads, state)
        sbytes = _state_bytes(state)
        step = jax.jit(lambda p, s, g, tx=tx: apply_fused(tx, g, s, p), donate_argnums=(0, 1))
        p0 = jax.tree.map(jnp.copy, params)
        sec, sec_pipe, out = _time(step, (p0, state), grads, repeats)
        del out, state
        best = min(sec, sec_pipe)
        gbs = moved / best / 1e9
        rec = {**meta, "set": name, "elements": n, "leaves": len(shapes), "param_dtype": jnp.dtype(pdtype).name,
               "grad_dtype": jnp.dtype(gdtype).name, "impl": label, "ms": 1e3 * sec, "ms_pipelined": 1e3 * sec_pipe,
               "bytes": moved, "bytes_per_param": moved / n, "gbs": gbs, "pct_peak": 100 * gbs / PEAK_GBS,
               "state_bytes_per_param": sbytes / n}
        rows.append(rec)
        print(f"| {name} ({n / 1e9:.2f}B, {len(shapes)} leaves) | {rec['param_dtype']}/{rec['grad_dtype']} | {label} | "
              f"{rec['ms']:.3f} | {rec['ms_pipelined']:.3f} | {moved / n:.2f} | {moved / 1e9:.2f} | {gbs:.0f} | "
              f"{rec['pct_peak']:.0f}% | {rec['state_bytes_per_param']:.3f} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--sets", default="qwen3-0.6b,qwen3-1.7b")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": _commit(),
        "repeats": args.repeats,
    }
    print(f"# 8-bit AdamW update on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
    print("| params | param/grad dtype | impl | ms | ms pipelined | B/param | GB moved | GB/s | % of 3000 | "
          "state B/param |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    records = []
    cases = []
    for name in args.sets.split(","):
        shapes = qwen3_shapes(name)
        cases.append((name, shapes, jnp.float32, jnp.float32))
        if name == "qwen3-0.6b":
            cases.append((name, shapes, jnp.bfloat16, jnp.bfloat16))
            cases.append((name, shapes, jnp.float32, jnp.bfloat16))  # fp32 masters, bf16 grads
            cases.append(("embedding only", {"embedding": shapes["embedding"]}, jnp.float32, jnp.float32))
            cases.append(("embedding only", {"embedding": shapes["embedding"]}, jnp.bfloat16, jnp.bfloat16))
    for name, shapes, pdt, gdt in cases:
        records += bench_set(name, shapes, pdt, gdt, args.repeats, meta)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)


if __name__ == "__main__":
    main()
