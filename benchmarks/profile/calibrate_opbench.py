"""Check the op-bench timing method (_opbench.time_chain) on the one op whose answer is known: a
plain element-wise copy, which no GPU can run faster than its DRAM allows (H100 80GB HBM3: 3.35
TB/s peak, ~3.0 TB/s measured). For each size it prints the copy's GB/s with the chain rotating
through inputs worth 1, 2, 4, 8 and 16 times the L2, by the difference method (_opbench's) and by a
single chain (the method _opbench used before). A figure above the peak means the timing is wrong
at that size (L2 hits, or per-call costs that the difference of chains does not cancel). Result
(H100): only steps of >= ~100 MB time correctly (benchmarks/RESULTS.md, "Ops").

    python benchmarks/profile/calibrate_opbench.py [--sizes-mb 8,34,100] [--steps 40] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _opbench.py, bench_<op>.py
import _opbench


def single_chain_seconds(step, carry, steps: int, repeats: int, r: int) -> float:
    """The single-chain figure (the old method): one chain's median call time over its steps."""
    carries = tuple([tuple(carry)] + [tuple(jax.tree.map(jnp.copy, tuple(carry))) for _ in range(r - 1)])
    fn = jax.jit(_opbench.chain(step, steps, r))
    for _ in range(3):
        jax.block_until_ready(fn(carries))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(carries))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes-mb", default="8,34,100", help="bytes moved per step (read + write), MB")
    ap.add_argument("--multiples", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    try:
        sizes = [float(v) for v in args.sizes_mb.split(",")]
        multiples = [int(v) for v in args.multiples.split(",")]
    except ValueError:
        ap.error("--sizes-mb and --multiples take comma-separated numbers, e.g. 8,34,100 and 1,2,4")
    if min(sizes) <= 0 or min(multiples) < 1:
        ap.error("--sizes-mb must be positive and --multiples at least 1")
    if jax.default_backend() != "gpu":
        print("error: needs a GPU (the copy's bandwidth is what is being checked)", file=sys.stderr)
        raise SystemExit(2)
    step = lambda a: (a + jnp.uint32(1),)  # noqa: E731  (the copy of _opbench.copy_seconds)
    print(f"{jax.devices()[0].device_kind}, commit {_opbench.commit()}; GB/s of a copy moving the given bytes per step")
    print("| MB moved | L2 multiple | copies | difference GB/s | single chain GB/s |")
    print("|---|---|---|---|---|")
    for mb in sizes:
        nbytes = int(mb * 1e6)
        x = jnp.zeros(max(1, nbytes // 8), jnp.uint32)  # read nbytes/2, write nbytes/2
        for mult in multiples:
            r = _opbench.rotation((x,), multiple=mult)
            diff = _opbench.time_chain(step, (x,), args.steps, args.repeats, rotate=r)
            single = single_chain_seconds(step, (x,), args.steps, args.repeats, r)
            print(f"| {mb:g} | {mult} | {r} | {nbytes / diff / 1e9:.0f} | {nbytes / single / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
