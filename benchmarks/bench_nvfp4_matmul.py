"""Benchmark NVFP4 GEMMs at Llama-3-8B projection shapes: native (cuBLASLt block-scaled FP4, SM100+
only), emulated (dequantize both operands to bf16 + bf16 GEMM) and a plain bf16 GEMM; plus the
native path's operand preparation (scale swizzle, W^T nibble transpose), which runs on any GPU.

    python benchmarks/bench_nvfp4_matmul.py [--out results.jsonl] [--tokens 16384] [--steps 10] [--repeats 20]

GEMMs y[M, N] = a[M, K] b[N, K]^T with M = --tokens and (N, K) = (4096, 4096) (q/o proj),
(14336, 4096) (gate/up), (4096, 14336) (down). Operands are quantized once outside the timed
chain (1x16 blocks for a, 16x16 tiles transposed for b, as in the recipe's forward), so the rows
time the GEMM with its per-call preparation: native = swizzle both scale sets + the FP4 GEMM;
emulated = dequantize both operands to bf16 + the bf16 GEMM. TFLOP/s = 2 M N K / time (dense
bf16 peak 989 on H100). On a GPU below SM100 the native row says so and is skipped (expected on
our H100s). Timing: benchmarks/_opbench.py (dependent chain in one jitted program, median).
"""

from __future__ import annotations

import argparse
import datetime

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, nvfp4_quantize
from surogate_jax.ops import nvfp4_matmul as g

SHAPES = {"qo_proj": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}  # (N, K)
BF16_PEAK_TFLOPS = 989.0


def _tensor(codes, scales, gs, shape, tile_2d):
    return nvfp4_quantize.NVFP4Tensor(codes, scales, gs, shape, tile_2d, None)


def _gemm_step(gemm, m, n, k):
    """A chain step on (a codes, scales, gs, b codes, scales, gs, y): y = gemm(a, b^T), bf16."""
    def step(ac, asc, ags, bc, bsc, bgs, y):
        aa = _tensor(ac, asc, ags, (m, k), False)
        bb = _tensor(bc, bsc, bgs, (n, k), True)
        return (ac, asc, ags, bc, bsc, bgs, gemm(aa, bb, jnp.bfloat16))
    return step


def _swizzle_step(m, n):
    def step(s1, s2, o1, o2):
        return (s1, s2, g.swizzle_scales(s1, m, 1, impl="ffi"), g.swizzle_scales(s2, n, 16, impl="ffi"))
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    native = g.native_available()
    dev = jax.devices()[0]
    meta = {"op": "nvfp4_matmul", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": dev.device_kind, "compute_capability": str(getattr(dev, "compute_capability", "?")),
            "jax": jax.__version__, "commit": _opbench.commit(), "steps": args.steps, "repeats": args.repeats,
            "tokens": args.tokens}
    print(f"# nvfp4_matmul on {meta['device']} (cc {meta['compute_capability']}), jax {meta['jax']}, "
          f"commit {meta['commit']}, {meta['date']}")
    if not native:
        print("# native FP4 GEMM: needs SM100+ (Blackwell); this GPU has none, so only the emulated, bf16 "
              "and operand-preparation rows are measured")
    print("| gemm | M x N x K | path | us | TFLOP/s | % of 989 | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    records = []
    m = args.tokens
    key = jax.random.key(0)
    for name, (n, k) in SHAPES.items():
        ka, kb, key = jax.random.split(key, 3)
        x = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kb, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        a = nvfp4_quantize.quantize(x, impl="ffi")
        bt = g.transpose(nvfp4_quantize.quantize(w, tile_2d=True, impl="ffi"), impl="ffi")  # [N, K] tiles
        flops = 2.0 * m * n * k
        y0 = jnp.zeros((m, n), jnp.bfloat16)
        wt = w.T

        def bf16_step(x, wt, y):
            return (x, wt, jnp.matmul(x, wt.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))

        ops = (a.codes, a.scales, a.global_scale, bt.codes, bt.scales, bt.global_scale, y0)
        t_bf16 = _opbench.time_chain(bf16_step, (x, wt, y0), args.steps, args.repeats)
        rows = [("bf16", t_bf16),
                ("emulated", _opbench.time_chain(_gemm_step(g.nvfp4_gemm_emulated, m, n, k), ops, args.steps,
                                                 args.repeats))]
        if native:
            rows.append(("native", _opbench.time_chain(_gemm_step(g.nvfp4_gemm_native, m, n, k), ops, args.steps,
                                                       args.repeats)))
        # operand preparation alone (any GPU): swizzle of a's and W^T's scales, W^T nibble transpose
        wq = nvfp4_quantize.quantize(w, tile_2d=True, impl="ffi")
        o1 = g.swizzle_scales(a.scales, m, 1, impl="ffi")
        o2 = g.swizzle_scales(bt.scales, n, 16, impl="ffi")
        t_sw = _opbench.time_chain(_swizzle_step(m, n), (a.scales, bt.scales, o1, o2), args.steps, args.repeats)
        tr = lambda c, o: (c, g.transpose_codes(c, impl="ffi"))
        t_tr = _opbench.time_chain(tr, (wq.codes, bt.codes), args.steps, args.repeats)
        for path, t in rows:
            tf = flops / t / 1e12
            rec = {**meta, "gemm": name, "m": m, "n": n, "k": k, "path": path, "us": t * 1e6, "tflops": tf,
                   "pct_bf16_peak": 100 * tf / BF16_PEAK_TFLOPS, "speedup_vs_bf16": t_bf16 / t}
            records.append(rec)
            print(f"| {name} | {m}x{n}x{k} | {path} | {t * 1e6:.1f} | {tf:.0f} | {rec['pct_bf16_peak']:.0f}% | "
                  f"{t_bf16 / t:.2f}x |", flush=True)
        if not native:
            print(f"| {name} | {m}x{n}x{k} | native | needs SM100+ | | | |")
        sw_bytes = (m * k // 16 + (n // 16) * (k // 16) + g.swizzled_scale_bytes(m, k // 16)
                    + g.swizzled_scale_bytes(n, k // 16))
        tr_bytes = 2 * (k * n // 2)
        for path, t, b in (("prep: swizzle a + W^T scales", t_sw, sw_bytes),
                           ("prep: W^T nibble transpose", t_tr, tr_bytes)):
            gbs = b / t / 1e9
            rec = {**meta, "gemm": name, "m": m, "n": n, "k": k, "path": path, "us": t * 1e6, "bytes": b,
                   "gbs": gbs, "pct_copy_peak": 100 * gbs / _opbench.PEAK_GBS}
            records.append(rec)
            print(f"| {name} | {m}x{n}x{k} | {path} | {t * 1e6:.1f} | {gbs:.0f} GB/s | "
                  f"{rec['pct_copy_peak']:.0f}% of 3000 GB/s | |", flush=True)
        del x, w, a, bt, wq
    _opbench.append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
