"""Benchmark the NVFP4 quantizer kernels on GPU against XLA's compilation of the pure-JAX reference
(`jax.jit(quantize_ref)`), reported against the memory-bandwidth floor.

    python benchmarks/bench_nvfp4_quantize.py [--out results.jsonl] [--steps 10] [--repeats 20]

Shapes: [16384, 4096] and [8192, 14336] bf16 (activations / an MLP weight). Configurations:
1x16 and 16x16 tiles, with and without Four Over Six, 1x16 + 4/6 with the fused RHT, and 1x16 +
4/6 with stochastic rounding. Timing: benchmarks/_opbench.py (a dependent chain of `--steps`
calls in one jitted program, median of `--repeats`).

Columns: "full" = amax pass + quantize pass (what quantize(x) costs when amax is not known);
"quant" = the quantize kernel alone with amax given; "amax" = the amax kernel alone; "xla" = the
jitted reference (full). Bytes counted: full reads x twice and writes codes (0.5 B/elt) + scales
(1 B per block) + 4 B; quant reads x once and writes the same; amax reads x once.
GB/s = bytes / time; "% of 3000" is of the H100's measured device copy bandwidth. Note the
reference keeps float32 operation order with optimization barriers (see ops/nvfp4_quantize.py), which also
limits XLA's fusion, so "xla" is the bit-exact reference's speed, not the best XLA could do.
"""

from __future__ import annotations

import argparse
import datetime

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, hadamard, nvfp4_quantize

SHAPES = [(16384, 4096), (8192, 14336)]
CONFIGS = {
    "1x16": {"tile_2d": False, "four_over_six": False},
    "1x16+4/6": {"tile_2d": False, "four_over_six": True},
    "16x16": {"tile_2d": True, "four_over_six": False},
    "16x16+4/6": {"tile_2d": True, "four_over_six": True},
    "1x16+4/6+rht": {"tile_2d": False, "four_over_six": True, "rht_sign_mask": hadamard.DEFAULT_SIGN_MASK},
    "1x16+4/6+sr": {"tile_2d": False, "four_over_six": True, "stochastic": True},
}


def _step(fn):
    def step(x, *_):
        out = fn(x)
        return (x, out.codes, out.scales, out.global_scale)  # x passes the barrier: no CSE
    return step


def _carry(x, kw):
    q = nvfp4_quantize.quantize(x, impl="ffi", **kw)
    return (x, q.codes, q.scales, q.global_scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    meta = {"op": "nvfp4_quantize",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "commit": _opbench.commit(), "steps": args.steps, "repeats": args.repeats}
    records = []
    print(f"# nvfp4_quantize on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
    print("| shape | config | full us | quant us | amax us | xla us | xla/full | full GB/s | % | quant GB/s | % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    key = jax.random.key(0)
    for rows, cols in SHAPES:
        kx, key = jax.random.split(key)
        x = jax.random.normal(kx, (rows, cols), jnp.float32).astype(jnp.bfloat16)
        n = rows * cols
        for name, cfg in CONFIGS.items():
            kw = dict(cfg)
            stochastic = kw.pop("stochastic", False)
            if stochastic:
                kw.update(stochastic=True, key=jax.random.key(1))
            nscales = (-(-rows // 16) * (cols // 16)) if kw["tile_2d"] else rows * cols // 16
            out_bytes = n // 2 + nscales + 4
            mask = kw.get("rht_sign_mask")
            amax = jax.jit(lambda x: nvfp4_quantize.global_amax(x, rht_sign_mask=mask, impl="ffi"))(x)
            carry = _carry(x, kw)
            full = _opbench.time_chain(_step(lambda x: nvfp4_quantize.quantize(x, impl="ffi", **kw)), carry,
                                       args.steps, args.repeats)
            quant = _opbench.time_chain(
                _step(lambda x: nvfp4_quantize.quantize(x, impl="ffi", amax=amax, **kw)), carry, args.steps,
                args.repeats)
            amax_s = _opbench.time_chain(
                lambda x, a: (x, nvfp4_quantize.global_amax(x, rht_sign_mask=mask, impl="ffi")), (x, amax),
                args.steps, args.repeats)
            xla = _opbench.time_chain(_step(lambda x: nvfp4_quantize.quantize(x, impl="ref", **kw)), carry,
                                      args.steps, args.repeats)
            full_b, quant_b = 2 * n * 2 + out_bytes, n * 2 + out_bytes
            fg, qg = full_b / full / 1e9, quant_b / quant / 1e9
            rec = {**meta, "shape": f"{rows}x{cols}", "dtype": "bfloat16", "config": name,
                   "full_us": full * 1e6, "quant_us": quant * 1e6, "amax_us": amax_s * 1e6,
                   "xla_us": xla * 1e6, "speedup_vs_xla": xla / full, "full_bytes": full_b,
                   "quant_bytes": quant_b, "full_gbs": fg, "quant_gbs": qg,
                   "full_pct_peak": 100 * fg / _opbench.PEAK_GBS,
                   "quant_pct_peak": 100 * qg / _opbench.PEAK_GBS}
            records.append(rec)
            print(f"| {rows}x{cols} | {name} | {full * 1e6:.1f} | {quant * 1e6:.1f} | {amax_s * 1e6:.1f} | "
                  f"{xla * 1e6:.1f} | {xla / full:.2f}x | {fg:.0f} | {rec['full_pct_peak']:.0f}% | "
                  f"{qg:.0f} | {rec['quant_pct_peak']:.0f}% |", flush=True)
        del x
    _opbench.append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
