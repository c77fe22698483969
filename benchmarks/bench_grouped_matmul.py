"""Benchmark the MoE experts' grouped GEMMs at Qwen3-30B-A3B's shapes: rows sorted by expert [N, D] times the
stacked expert weights [E, D, I] (each row times its own expert's matrix), its input gradient and its weight
gradient, against one plain GEMM of the same FLOPs (the floor: what cuBLAS does with the same work undivided).

    python benchmarks/bench_grouped_matmul.py [--out results.jsonl] [--steps 10] [--repeats 10]

Shapes: T = 4096 tokens (the seed configuration's micro-batch: 2 rows x 2048), top-8 of 128 experts, so
N = 32768 rows; D = 2048 (hidden), I = 768 (moe_intermediate). FLOPs of each of fwd / d_lhs / d_rhs: 2 N D I
= 103 GFLOP whatever the grouping. Routing: softmax top-8 of random normal logits (near-balanced) and of logits
with a per-expert bias (skewed: a few experts get several times the mean).

Variants: `ours` (kernels/grouped_matmul.cu: forward, d_lhs = the same kernel reading w transposed, d_rhs = the
weight-gradient kernel), `ragged_dot` (jax.lax.ragged_dot; XLA lowers it to cuDNN's grouped GEMM where its version
has that path, else to a zero-padded dense dot), `tokamax <impl>` (tokamax.ragged_dot, Google's Pallas kernel
library, when it is installed: its Mosaic GPU (wgmma) and Triton implementations, gradients through its own VJP),
`dense` (one [N, D] x [D, I] GEMM: the GEMM ceiling), and our FP8 forms (fp8-hybrid's expert GEMMs:
`ours fp8 fwd` = E4M3 amax + cast of x and the fp8 kernel against the cached E4M3 experts, `ours fp8 d_lhs` =
E5M2 amax + cast of dy, the byte transpose of the cached experts and the kernel; `gemm only` the kernel alone on
operands already in fp8, against `ours fwd gemm only`). Each line
also says whether the compiled program calls cuDNN. Timing: benchmarks/_opbench.py (chained steps, difference of two
chain lengths).
"""

from __future__ import annotations

import json

import _opbench
import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, fp8_formats
from surogate_jax.ops.grouped_matmul import _dw_ffi, _fp8_gemm_ffi, _fwd_ffi, expert_scales, fp8_forward, fp8_input_grad

T, K, E, D, I = 4096, 8, 128, 2048, 768


def group_sizes(key, skew: bool) -> jax.Array:
    logits = jax.random.normal(key, (T, E), jnp.float32)
    if skew:  # a few hot experts, as a router early in training or after collapse
        logits = logits + 2.0 * jax.random.normal(jax.random.fold_in(key, 1), (E,), jnp.float32)
    _, idx = jax.lax.top_k(logits, K)
    return jnp.bincount(idx.reshape(-1), length=E).astype(jnp.int32)


def _dlhs_step(rd, a, b, g, d):
    """(b, g, d'): the input gradient of rd at (a, b, g) for d, fed into the next step's d (as ours: a step's input
    must depend on the last step's output, or XLA hoists the loop-invariant gradient out of the chain)."""
    dx = jax.vjp(lambda a_: rd(a_, b, g), a)[1](d)[0]
    return b, g, dx[:, :I].astype(d.dtype) + d


def _drhs_step(rd, a, b, g, d):
    """(a, b', g, d): the weight gradient added into the weights the next step reads."""
    return a, jax.vjp(lambda b_: rd(a, b_, g), b)[1](d)[0].astype(b.dtype) + b, g, d


def tokamax_cases(x, w, gs, dy) -> list:
    """tokamax.ragged_dot's fwd / d_lhs / d_rhs per GPU implementation, as the ragged_dot cases (none without it)."""
    try:
        import tokamax  # noqa: PLC0415
    except ImportError as e:
        print(json.dumps({"bench": "grouped_matmul", "case": "tokamax", "error": f"not installed: {e}"}), flush=True)
        return []
    out = []
    for impl in ("mosaic", "triton"):
        rd = lambda a, b, g, impl=impl: tokamax.ragged_dot(a, b, g, implementation=impl)  # noqa: E731
        out += [
            (f"tokamax {impl} fwd", lambda a, b, g, rd=rd: (rd(a, b, g)[:, :1].astype(a.dtype) + a, b, g), (x, w, gs),
             lambda: False),
            (f"tokamax {impl} d_lhs", lambda a, b, g, d, rd=rd: (a, *_dlhs_step(rd, a, b, g, d)), (x, w, gs, dy),
             lambda: False),
            (f"tokamax {impl} d_rhs", lambda a, b, g, d, rd=rd: _drhs_step(rd, a, b, g, d), (x, w, gs, dy),
             lambda: False),
        ]
    return out


def uses_cudnn(fn, *args) -> bool:
    return "__cudnn" in jax.jit(fn).lower(*args).compile().as_text()  # custom call or fusion kind


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.set_defaults(steps=10, repeats=10)
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    N = T * K
    flops = 2 * N * D * I
    kx, kw, kd, kg = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (N, D), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, D, I), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (N, I), jnp.bfloat16)
    w2 = w[0]
    s_w = expert_scales(w)
    wq = fp8_formats.quantize(jnp.swapaxes(w, 1, 2), s_w[:, None, None], fp8_formats.E4M3)  # the cache [E, I, D]
    xq = x.astype(fp8_formats.E4M3)
    rows = []
    for skew in (False, True):
        gs = group_sizes(kg, skew)
        assert int(gs.sum()) == N
        rd = lambda a, b, g: jax.lax.ragged_dot(a, b, g)  # noqa: E731
        fwd = lambda a, b, g: (rd(a, b, g)[:, :1].astype(a.dtype) + a, b, g)  # noqa: E731
        dlhs = lambda a, b, g, d: (a, *_dlhs_step(rd, a, b, g, d))  # noqa: E731
        drhs = lambda a, b, g, d: _drhs_step(rd, a, b, g, d)  # noqa: E731
        dense = lambda a, b: ((a @ b)[:, :1] + a, b)  # noqa: E731
        ours_fwd = lambda a, b, g: (_fwd_ffi(a, b, g)[:, :1] + a, b, g)  # noqa: E731
        ours_dlhs = lambda a, b, g, d: (a, b, g, _fwd_ffi(d, b, g, w_nk=True)[:, :I] + d)  # noqa: E731
        ours_drhs = lambda a, b, g, d: (a, _dw_ffi(a, d, g, E) + b, g, d)  # noqa: E731
        cases = [
            *tokamax_cases(x, w, gs, dy),
            ("ours fwd", ours_fwd, (x, w, gs), lambda: False),
            ("ours d_lhs", ours_dlhs, (x, w, gs, dy), lambda: False),
            ("ours d_rhs", ours_drhs, (x, w, gs, dy), lambda: False),
            ("ragged_dot fwd", fwd, (x, w, gs), lambda: uses_cudnn(rd, x, w, gs)),
            ("ragged_dot d_lhs", dlhs, (x, w, gs, dy), lambda: uses_cudnn(lambda *a: dlhs(*a)[3], x, w, gs, dy)),
            ("ragged_dot d_rhs", drhs, (x, w, gs, dy), lambda: uses_cudnn(lambda *a: drhs(*a)[1], x, w, gs, dy)),
            ("dense fwd (floor)", dense, (x, w2), lambda: False),
            # the chain's dependency through the group sizes: no pass over the operands besides the GEMM
            ("ours fwd gemm only", lambda a, b, g: (a, b, g + (_fwd_ffi(a, b, g)[0, 0] > 1e30).astype(g.dtype)),
             (x, w, gs), lambda: False),
            ("ours fp8 fwd", lambda a, b, s, g: (fp8_forward(a, b, s, g, "ffi")[:, :1] + a, b, s, g),
             (x, wq, s_w, gs), lambda: False),
            ("ours fp8 d_lhs", lambda a, b, s, g: (fp8_input_grad(a, b, s, g, "ffi", a.dtype)[:, :I] + a, b, s, g),
             (dy, wq, s_w, gs), lambda: False),
            # the chain's dependency through the scalar scale: no pass over the operands besides the GEMM
            ("ours fp8 fwd gemm only", lambda a, b, s, g, xi: (a, b, s, g, xi + 1e-30 * _fp8_gemm_ffi(
                a, b, g, xi, s)[0, 0].astype(jnp.float32)), (xq, wq, s_w, gs, jnp.float32(1.0)), lambda: False),
        ]
        for name, step, carry, cudnn in cases:
            try:
                s = _opbench.time_chain(step, carry, args.steps, args.repeats, rotate=1)
                row = {"bench": "grouped_matmul", "case": name, "skew": skew, "N": N, "D": D, "I": I, "E": E,
                       "max_group": int(gs.max()), "ms": s * 1e3, "tflops": flops / s / 1e12, "cudnn": cudnn(),
                       "commit": _opbench.commit(), "device": str(jax.devices()[0].device_kind)}
            except Exception as e:  # noqa: BLE001  (a variant XLA cannot compile is a result, not a crash)
                row = {"bench": "grouped_matmul", "case": name, "skew": skew, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
