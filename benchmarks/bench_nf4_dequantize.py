"""Benchmark NF4 dequantization on GPU: our FFI kernel vs XLA's fusion of `nf4_dequantize_ref` (jitted), against the
memory-bandwidth floor, at Qwen3 projection shapes, block size 64 (bitsandbytes' and QLoRA's default).

    python benchmarks/bench_nf4_dequantize.py [--out results.jsonl] [--calls 8] [--repeats 20] [--block-size 64]

Outputs: bfloat16 (QLoRA's bf16 base weight) and float8_e4m3fn with a scale (fp8-hybrid's cached weight).
Timing: the op's inputs never change from step to step, so a chain of calls on one carry is not a fair timing
(measured on the H100: XLA's program did not grow with the chain). Instead one program dequantizes K independent
weights (distinct buffers: nothing to share, every output returned) and another 2K; the time per call is the
difference of their medians over K, so the fixed cost of a call cancels (`time_calls`). Before timing, the kernel's
output is checked to be bit-identical to the reference's.

Bytes counted (what must move): per weight 0.5 B of codes + 4 / block_size B of absmax read, sizeof(out) written.
"ours GB/s" is those bytes over our time; "% of 3000" is of the H100's measured copy bandwidth, i.e. the byte floor
(bytes / 3000 GB/s) as a percentage of our time.
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops import ffi_available, nf4_dequantize, nf4_dequantize_ref
from surogate_jax.qlora.nf4 import NF4_CODE

# [out, in] as HF stores them: Qwen3-8B down_proj and gate/up_proj, Qwen3-32B down_proj, Qwen3-0.6B down_proj.
SHAPES = [(4096, 12288), (12288, 4096), (5120, 25600), (1024, 3072)]
OUTPUTS = [("bfloat16", jnp.bfloat16, False), ("e4m3+scale", jnp.float8_e4m3fn, True)]


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--block-size", type=int, default=64, choices=(64, 128, 256, 512))
    ap.add_argument("--calls", type=int, default=8, help="K: independent weights in the shorter program")
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    bs = args.block_size
    table = _opbench.Table("nf4_dequantize", args.steps, args.repeats, variant=f"block {bs}")
    rng = np.random.default_rng(0)
    k = args.calls
    for shape in SHAPES:
        n = shape[0] * shape[1]
        inputs = [
            (
                jnp.asarray(rng.integers(0, 256, size=(n + 1) // 2, dtype=np.uint8)),
                jnp.asarray(rng.uniform(0.01, 0.2, size=-(-n // bs)).astype(np.float32)),
                jnp.float32(448.0 / 0.2),
            )
            for _ in range(2 * k)
        ]
        for label, out_dtype, scaled in OUTPUTS:
            kw = dict(shape=shape, block_size=bs, out_dtype=out_dtype)

            def ours(c, a, s, kw=kw, scaled=scaled):
                return nf4_dequantize(c, a, NF4_CODE, s if scaled else None, impl="ffi", **kw)

            def xla(c, a, s, kw=kw, scaled=scaled):
                return nf4_dequantize_ref(c, a, NF4_CODE, s if scaled else None, **kw)

            got, want = jax.jit(ours)(*inputs[0]), jax.jit(xla)(*inputs[0])
            if not np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)):
                raise SystemExit(f"error: kernel and reference differ at {shape} {label}")
            del got, want
            t_ours = _opbench.time_calls(ours, inputs, k, args.repeats)
            t_xla = _opbench.time_calls(xla, inputs, k, args.repeats)
            nbytes = n * (jnp.dtype(out_dtype).itemsize + 0.5 + 4 / bs)
            table.add(f"[{shape[0]}, {shape[1]}]", label, "fwd", t_ours, t_xla, int(nbytes))
        del inputs
    table.write(args.out)


if __name__ == "__main__":
    main()
