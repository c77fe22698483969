"""One fused 8-bit AdamW update over a Qwen3-0.6B-embedding-sized f32 leaf, repeated, for a profiler,
plus the device's copy bandwidth measured the same way (x + 1 over 2 GiB: read + write).

    python benchmarks/profile/profile_adamw_8bit.py [--dtype float32]
    ncu --kernel-name regex:adamw --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python benchmarks/profile/profile_adamw_8bit.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from surogate_jax.optim import adamw_8bit, apply_fused


def copy_bandwidth(n_bytes: int = 2 << 30, repeats: int = 20) -> float:
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        x = f(x)
    x.block_until_ready()
    return 2 * n_bytes * repeats / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    dt = jnp.dtype(a.dtype)
    shape = (151936, 1024)
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"embedding": jax.random.normal(k1, shape, jnp.float32).astype(dt)}
    g = {"embedding": (jax.random.normal(k2, shape, jnp.float32) * 0.01).astype(dt)}
    tx = adamw_8bit(1e-3, weight_decay=0.1)
    step = jax.jit(lambda p, s, g: apply_fused(tx, g, s, p), donate_argnums=(0, 1))
    s = jax.jit(tx.init)(p)
    for _ in range(a.steps):
        p, s = step(p, s, g)
    jax.block_until_ready(p)
    print(f"copy bandwidth (x + 1, f32, 2 GiB, read + write): {copy_bandwidth():.0f} GB/s")


if __name__ == "__main__":
    main()
