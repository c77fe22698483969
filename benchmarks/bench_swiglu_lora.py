"""Benchmark SwiGLU+LoRA on GPU: `swiglu_lora` (our kernels, impl=None) vs XLA's fusion of the model's
unfused formula (`swiglu_lora_ref` under jit and autodiff), forward and forward+backward, against the
byte floor, at Qwen3-0.6B and -8B MLP shapes with LoRA rank 16 (alpha 32, scale 2) on gate and up.

    python benchmarks/bench_swiglu_lora.py [--out results.jsonl] [--steps 40] [--repeats 20]
                                           [--shapes 0.6b 8b] [--dtype bfloat16] [--no-split]

Forms: gate and up as one packed [rows, 2F] GEMM output and as two [rows, F] arrays, both at each
shape; "(model)" marks the form models/llamalike.py's MLP passes at that size (PACK_GATE_UP_MAX_BYTES).
fwd+bwd is one jax.vjp of the op as the model calls it: split_output=True (LoRA on down_proj too, as
in sft_throughput.py), so h's two cotangents enter the backward separately (--no-split: one); it
includes the LoRA factors' gradient GEMMs, on both sides.

Timing and passes: see benchmarks/_opbench.py. Each chained step consumes the previous one's output
so XLA drops no step: forward, xa is the first 2R columns of the previous h (a [rows, 2R] slice,
under 1% of the bytes); fwd+bwd, the base, xa and lora_b gradients become the next step's operands
and h the next cotangent (as in bench_swiglu.py the values grow to inf / NaN over a long chain; the
kernels and GEMMs do the same work whatever the values).
Floor (bytes read + written, each tensor once per pass, at 3000 GB/s, the "% of 3000" column):
forward reads the base (2F a row), xa (2R) and lora_b and writes h (F); backward reads dh (F, twice
split), the base, xa and lora_b and writes the base gradient (2F), d_xa (2R) and d_lora_b. "% of copy"
is of a same-size copy per pass (fwd+bwd: two copies).
`--shapes tiny --allow-cpu` is a CPU smoke test of this script (the references on both sides).
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.models.llamalike import PACK_GATE_UP_MAX_BYTES
from surogate_jax.ops import ffi_available, swiglu_lora, swiglu_lora_ref

# name: (tokens, hidden D, intermediate F); tokens as in bench_swiglu.py
SHAPES = {"0.6b": (16384, 1024, 3072), "8b": (8192, 4096, 12288),
          "tiny": (64, 32, 128)}  # tiny: a CPU smoke test of this script (--allow-cpu)
RANK = 16
SCALE = 2.0  # alpha 32 / r 16, as benchmarks/sft_throughput.py


def _gate_up(base):
    """The op's first argument: one packed array or the (gate, up) pair."""
    return base if len(base) == 2 else base[0]


def _steps(op, nb: int, split: bool):
    """(fwd, fwd_bwd) chain steps of `op` (swiglu_lora or swiglu_lora_ref) over carries
    (*base, h, lora_b) and (*base, xa, lora_b, dh[, dh2]), nb base arrays."""

    def fwd(*c):
        base, h, b = c[:nb], c[nb], c[nb + 1]
        return (*base, op(_gate_up(base), h[:, : 2 * RANK], b, SCALE), b)

    def f(*a):
        if op is swiglu_lora:
            return op(_gate_up(a[:nb]), a[nb], a[nb + 1], SCALE, split_output=split)
        h = op(_gate_up(a[:nb]), a[nb], a[nb + 1], SCALE)
        return (h, h) if split else h  # h feeding two consumers: autodiff sums their gradients

    def fwd_bwd(*c):
        h, vjp = jax.vjp(f, *c[: nb + 2])
        if split:
            return (*vjp(tuple(c[nb + 2:])), h[0], c[nb + 2])
        return (*vjp(c[nb + 2]), h)

    return fwd, fwd_bwd


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=["0.6b", "8b"], choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--no-split", dest="split", action="store_false",
                    help="one cotangent for h (the model without LoRA on down_proj)")
    ap.add_argument("--allow-cpu", action="store_true", help="run anyway without a GPU (smoke test)")
    args = ap.parse_args()
    if not args.allow_cpu:
        _opbench.require_gpu(ffi_available)
    dtype = jnp.dtype(args.dtype)
    es = dtype.itemsize
    table = _opbench.Table("swiglu_lora", args.steps, args.repeats,
                           variant=f"rank {RANK}, scale {SCALE}, split_output {args.split}")
    key = jax.random.key(0)
    for name in args.shapes:
        rows, D, F = SHAPES[name]
        model_form = "packed" if 2 * D * F * es <= PACK_GATE_UP_MAX_BYTES else "sep"
        for form in ("packed", "sep"):
            key, kb, *ks = jax.random.split(key, 7)
            g, u, h, dh, dh2 = (jax.random.normal(k, (rows, F), jnp.float32).astype(dtype) for k in ks)
            b = (0.1 * jax.random.normal(kb, (2, RANK, F), jnp.float32)).astype(dtype)
            base = (jnp.concatenate([g, u], -1),) if form == "packed" else (g, u)
            del g, u
            dhs = (dh, dh2) if args.split else (dh,)
            nbytes = {"fwd": rows * (3 * F + 2 * RANK) * es + 2 * RANK * F * es,
                      "bwd": rows * ((len(dhs) + 4) * F + 4 * RANK) * es + 4 * RANK * F * es}
            t = {}
            for side, op in (("ours", swiglu_lora), ("xla", swiglu_lora_ref)):
                fwd, fwd_bwd = _steps(op, len(base), args.split)
                t[side, "fwd"] = _opbench.time_chain(fwd, (*base, h, b), args.steps, args.repeats)
                t[side, "fwd+bwd"] = _opbench.time_chain(fwd_bwd, (*base, h[:, : 2 * RANK], b, *dhs),
                                                         args.steps, args.repeats)
            label = f"{name} [{rows}, {F}] {form}{' (model)' if form == model_form else ''}"
            copy = {p: _opbench.copy_seconds(n, args.steps, args.repeats) for p, n in nbytes.items()}
            table.add(label, dtype.name, "fwd", t["ours", "fwd"], t["xla", "fwd"], nbytes["fwd"], copy["fwd"])
            table.add(label, dtype.name, "fwd+bwd", t["ours", "fwd+bwd"], t["xla", "fwd+bwd"],
                      nbytes["fwd"] + nbytes["bwd"], copy["fwd"] + copy["bwd"])  # two passes: two copies
            del base, h, dh, dh2, dhs
    table.write(args.out)


if __name__ == "__main__":
    main()
