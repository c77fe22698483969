"""Benchmark tile-scaled weight dequantization on GPU (FP8 128x128-tile and NVFP4 16x16-tile QLoRA bases): our FFI
kernel vs XLA's fusion of `tile_dequantize_ref` (jitted), against the memory-bandwidth floor, at Qwen3 projection
shapes; and fp8-hybrid's whole per-projection weight (`qlora.base.frozen_fp8_weight`: max|W| from the codes, then
the scaled E4M3 weight) with the kernel vs the same through XLA (the path before the kernel).

    python benchmarks/bench_tile_dequantize.py [--out results.jsonl] [--calls 8] [--repeats 20]

Rows per shape and format: "bfloat16" (the bf16 recipe's base weight), "e4m3 via bf16" (the kernel step of
fp8-hybrid's weight: rounded to bf16, times a scale, to E4M3), and "fp8_weight" (the whole fp8-hybrid weight:
`tile_amax` over the codes plus that kernel; XLA column: dequantize to bf16, max, quantize, all XLA).
Timing: K independent weights in one program and 2K, the difference of medians over K (`_opbench.time_calls`).
Before timing, the kernel's output is checked to be bit-identical to the reference's.

Bytes counted (what must move): the codes read (1 B a weight for FP8, 0.5 B for NVFP4) plus the tile scales, the
output written; for "fp8_weight" the codes are read twice (once for max|W|, once to dequantize), the floor of a
two-pass design. "% of 3000" is the byte floor (bytes / 3000 GB/s, the H100's measured copy bandwidth) as a
percentage of our time.
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surogate_jax.ops import ffi_available, fp8_formats, tile_dequantize, tile_dequantize_ref
from surogate_jax.qlora import base

# [out, in] as HF stores them: Qwen3-8B down_proj and gate/up_proj, Qwen3-32B down_proj, Qwen3-0.6B down_proj.
SHAPES = [(4096, 12288), (12288, 4096), (5120, 25600), (1024, 3072)]
FORMATS = [("fp8", 128), ("nvfp4", 16)]


def _inputs(rng, fmt, tile, shape):
    rows, cols = shape
    grid = (-(-rows // tile), -(-cols // tile))
    if fmt == "fp8":
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C
        scales = rng.uniform(1e-4, 1e-3, size=grid).astype(np.float32)
        return {"fp8_weight": jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)), "fp8_scale_inv": jnp.asarray(scales)}
    codes = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(0x30, 0x70, size=grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return {"fp4_codes": jnp.asarray(codes), "fp4_scales": jnp.asarray(scales), "fp4_global_scale": jnp.float32(1e-3)}


def _operands(fmt, p):
    if fmt == "fp8":
        return p["fp8_weight"], p["fp8_scale_inv"], None
    return p["fp4_codes"], p["fp4_scales"], p["fp4_global_scale"]


def _xla_fp8_weight(spec, p, shape):
    """The fp8-hybrid weight as XLA computed it before the kernel: dequantize to bf16, max, quantize."""
    c, s, g = _operands(spec.format, p)
    w = tile_dequantize_ref(c, s, g, fmt=spec.format, shape=shape, tile=spec.block_size, out_dtype=jnp.bfloat16)
    w = jax.lax.optimization_barrier(w)  # a bf16 weight in memory: XLA:GPU may not skip its rounding in the max
    scale = fp8_formats.current_scale(jnp.max(jnp.abs(w.astype(jnp.float32))))
    return fp8_formats.quantize(w, scale, fp8_formats.E4M3), scale


def _check_same(got, want, what):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if not np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)):
            raise SystemExit(f"error: kernel and reference differ at {what}")


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--calls", type=int, default=8, help="K: independent weights in the shorter program")
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    table = _opbench.Table("tile_dequantize", args.steps, args.repeats, variant="fp8 128x128, nvfp4 16x16")
    rng = np.random.default_rng(0)
    k = args.calls
    for fmt, tile in FORMATS:
        spec = base.QloraSpec("fp4" if fmt == "nvfp4" else "fp8", tile)
        code_bytes = 1.0 if fmt == "fp8" else 0.5
        for shape in SHAPES:
            n = shape[0] * shape[1]
            params = [_inputs(rng, fmt, tile, shape) for _ in range(2 * k)]
            inputs = [(p,) for p in params]
            scale_bytes = int(np.asarray(_operands(fmt, params[0])[1]).nbytes)
            kw = dict(fmt=fmt, shape=shape, tile=tile)
            rows = [("bfloat16", dict(out_dtype=jnp.bfloat16), None, 2),
                    ("e4m3 via bf16", dict(out_dtype=jnp.float8_e4m3fn, via_dtype=jnp.bfloat16), 1000.0, 1)]
            for label, okw, scale, out_bytes in rows:

                def ours(p, okw=okw, scale=scale):
                    return tile_dequantize(*_operands(fmt, p), scale, impl="ffi", **kw, **okw)

                def xla(p, okw=okw, scale=scale):
                    return tile_dequantize_ref(*_operands(fmt, p), scale, **kw, **okw)

                _check_same(jax.jit(ours)(params[0]), jax.jit(xla)(params[0]), f"{fmt} {shape} {label}")
                t_ours = _opbench.time_calls(ours, inputs, k, args.repeats)
                t_xla = _opbench.time_calls(xla, inputs, k, args.repeats)
                table.add(f"{fmt} [{shape[0]}, {shape[1]}]", label, "fwd", t_ours, t_xla,
                          int(n * (code_bytes + out_bytes) + scale_bytes))

            def ours_w(p, spec=spec, shape=shape):
                return base.frozen_fp8_weight(spec, p, shape, jnp.bfloat16)

            def xla_w(p, spec=spec, shape=shape):
                return _xla_fp8_weight(spec, p, shape)

            _check_same(jax.jit(ours_w)(params[0]), jax.jit(xla_w)(params[0]), f"{fmt} {shape} fp8_weight")
            t_ours = _opbench.time_calls(ours_w, inputs, k, args.repeats)
            t_xla = _opbench.time_calls(xla_w, inputs, k, args.repeats)
            table.add(f"{fmt} [{shape[0]}, {shape[1]}]", "fp8_weight", "fwd", t_ours, t_xla,
                      int(n * (2 * code_bytes + 1) + 2 * scale_bytes))
            del params, inputs
    table.write(args.out)


if __name__ == "__main__":
    main()
