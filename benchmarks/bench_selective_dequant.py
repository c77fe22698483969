"""Benchmark selective MoE expert dequantization (qlora_selective_expert_dequant) on GPU: one Qwen3-30B-A3B MoE
layer's quantized experts (E = 128, D = 2048, I = 768; gate_proj and up_proj [E, I, D], down_proj [E, D, I]) to bf16,
as `qlora.base.expert_weights` does once per projection in the forward and again in the backward, for the NF4
(blocks of 64, double quantization), FP8 (128x128 tiles) and NVFP4 bases, dequantizing every expert ("all") and only
the experts that received tokens ("selective"), at T = 16, 64, 256 and 4096 tokens routed top-8 at random.

    python benchmarks/bench_selective_dequant.py [--out results.jsonl] [--calls 4] [--repeats 10]

Routing: top-8 of random normal logits per token (near-balanced); "active" is how many of the 128 experts got at
least one token. Only the experts without tokens are skipped, so the saving is their share of the layer's bytes:
at 4096 (the seed configuration's micro-batch) and 256 tokens every expert gets tokens and nothing is saved. The
"all" time does not depend on T (measured once per format). Timing: K independent layers in one program and 2K,
the difference of the medians over K (`_opbench.time_calls`); the quantized parts are random bytes of the right
shapes (the dequantization's cost does not depend on the values). Before timing, the selective output is checked to
equal the full one on the active experts' rows.
"""

from __future__ import annotations

import json

import _opbench
import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops import ffi_available
from surogate_jax.qlora import base
from surogate_jax.qlora.base import QloraSpec

E, D, I, K = 128, 2048, 768, 8
TOKENS = (16, 64, 256, 4096)
SHAPES = {"gate_proj": (E, I, D), "up_proj": (E, I, D), "down_proj": (E, D, I)}  # [E, out, in] per projection
SPECS = {"nf4": QloraSpec("nf4", 64, double_quant=True), "fp8": QloraSpec("fp8", 128), "fp4": QloraSpec("fp4", 16)}


def group_sizes(key, tokens: int) -> jax.Array:
    """Tokens per expert [E] int32 of top-K routing over random normal logits."""
    _, idx = jax.lax.top_k(jax.random.normal(key, (tokens, E), jnp.float32), K)
    return jnp.bincount(idx.reshape(-1), length=E).astype(jnp.int32)


def random_parts(key, spec: QloraSpec, shape) -> dict[str, jax.Array]:
    """Random quantized parts of one stacked projection [E * out, in]: codes any byte, scales in a normal range."""
    E_, out, inp = shape
    parts = {}
    for i, (name, sds) in enumerate(sorted(base.param_shapes(spec, (E_ * out, inp)).items())):
        k = jax.random.fold_in(key, i)
        dtype = jnp.dtype(sds.dtype)
        if dtype == jnp.uint8:
            parts[name] = jax.random.bits(k, sds.shape, jnp.uint8)
        elif dtype == jnp.float8_e4m3fn:  # bytes 0x30..0x4f: finite values near 1
            b = jax.random.randint(k, sds.shape, 0x30, 0x50, jnp.int32).astype(jnp.uint8)
            parts[name] = jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)
        else:
            parts[name] = jax.random.uniform(k, sds.shape, jnp.float32, 1e-3, 1e-2)
    return parts


def layer(spec: QloraSpec, parts, sizes):
    """The layer's three projections dequantized to bf16 (sizes None: every expert)."""
    return [base.expert_weights(spec, p, SHAPES[name], jnp.bfloat16, group_sizes=sizes) for name, p in parts.items()]


def check(spec: QloraSpec, parts, sizes) -> None:
    act = np.asarray(sizes) > 0
    full, sel = jax.jit(lambda p: layer(spec, p, None))(parts), jax.jit(lambda p, s: layer(spec, p, s))(parts, sizes)
    for a, b in zip(full, sel, strict=True):
        if not np.array_equal(np.asarray(a[act]).view(np.uint16), np.asarray(b[act]).view(np.uint16)):
            raise SystemExit(f"error: {spec.format}: the selective dequantization differs on the active experts")


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--calls", type=int, default=4, help="K: layers per timed program (and 2K)")
    ap.set_defaults(repeats=10)
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    key = jax.random.key(0)
    sizes = {t: group_sizes(jax.random.fold_in(key, t), t) for t in TOKENS}
    meta = {"bench": "selective_dequant", "E": E, "D": D, "I": I, "top_k": K, "commit": _opbench.commit(),
            "device": str(jax.devices()[0].device_kind)}
    rows = []
    print(f"{'format':6} {'tokens':>6} {'active':>6} {'all ms':>8} {'selective ms':>12} {'ratio':>6}", flush=True)
    for fmt, spec in SPECS.items():
        sets = [{name: random_parts(jax.random.fold_in(key, 1000 * c + j), spec, SHAPES[name])
                 for j, name in enumerate(SHAPES)} for c in range(2 * args.calls)]
        check(spec, sets[0], sizes[TOKENS[0]])
        full = _opbench.time_calls(lambda p: layer(spec, p, None), [(p,) for p in sets], args.calls, args.repeats)
        for t in TOKENS:
            sel = _opbench.time_calls(lambda p, s: layer(spec, p, s), [(p, sizes[t]) for p in sets], args.calls,
                                      args.repeats)
            active = int(jnp.sum(sizes[t] > 0))
            row = {**meta, "format": fmt, "tokens": t, "active_experts": active, "all_ms": full * 1e3,
                   "selective_ms": sel * 1e3}
            print(f"{fmt:6} {t:6d} {active:6d} {full * 1e3:8.3f} {sel * 1e3:12.3f} {sel / full:6.2f}", flush=True)
            rows.append(row)
        del sets
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
