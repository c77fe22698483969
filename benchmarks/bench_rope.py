"""Benchmark RoPE on GPU: our FFI kernels vs XLA's fusion of `rope_ref`, rotation only ("rope")
and fused with the per-head q/k RMSNorm ("norm+rope", Qwen3), angles from positions (cos/sin
computed in the kernel / in XLA's fusion) or from HF-style fp32 [B, T, K] cos/sin tables (what
the model passes), forward and backward, at Qwen3-0.6B and -8B q/k shapes.

    python benchmarks/bench_rope.py [--out results.jsonl] [--steps 40] [--repeats 20] [--dtype bfloat16]

The k shapes move ~10 MB (a few us of DRAM time), so per-call overheads weigh there; --steps 50
amortizes the program launch over more steps.

Last rows: `rope_qk` (a layer's q and k through one paired launch per direction, what the models
call) vs XLA's fusion of the two rope_ref calls, norm + table mode (84-126 MB a pass, where the
chained timing holds; see profile/calibrate_opbench.py).

Timing and passes: see benchmarks/_opbench.py (fwd and bwd are timed separately, as in training;
"fwd+bwd" rows are their sum). The norm backward of both sides also produces the weight gradient
(accumulated in the carry, so XLA cannot drop it).
Bytes counted (useful traffic): forward reads x and writes y; the rotation-only backward reads dy
and writes dx; the norm backward reads dy and x and writes dx; plus the angle source per pass
(positions: 4 bytes per token; tables: the K/2 cos and K/2 sin floats per token that are used).
"% of 3000" is of the H100's measured copy bandwidth.
"""

from __future__ import annotations

import _opbench
import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.ops import ffi_available, rope_ref
from surogate_jax.ops.rope import _bwd_ffi, _fwd_ffi, _qk_bwd_ffi, _qk_fwd_ffi

# name -> (B, T, H, K)
SHAPES = {
    "0.6b q": (4, 2048, 16, 128),
    "0.6b k": (4, 2048, 8, 128),
    "8b q": (2, 2048, 32, 128),
    "8b k": (2, 2048, 8, 128),
}
EPS = 1e-6


def _ref(x, a, b, w):
    """rope_ref with the angle source (a, b) = (positions, inv_freq) | (cos, sin)."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return rope_ref(x, a, b, norm_w=w, eps=EPS)
    return rope_ref(x, table=(a, b), norm_w=w, eps=EPS)


# A layer's q and k through rope_qk's paired launches (the models' call), norm + table mode.
PAIRS = {"0.6b qk": ("0.6b q", "0.6b k"), "8b qk": ("8b q", "8b k")}


def _pairs(table, dtype, steps, repeats) -> None:
    """Rows for rope_qk (ours: one launch per direction) vs XLA's fusion of two rope_ref calls."""
    key = jax.random.key(1)
    for label, (nq, nk) in PAIRS.items():
        (B, T, Hq, K), (_, _, Hk, _) = SHAPES[nq], SHAPES[nk]
        ks = jax.random.split(key, 7)
        key = ks[0]
        q, k, dq, dk = (jax.random.normal(kk, s, jnp.float32).astype(dtype)
                        for kk, s in zip(ks[1:5], (SHAPES[nq], SHAPES[nk]) * 2))
        wq, wk = ((1.0 + 0.1 * jax.random.normal(kk, (K,), jnp.float32)).astype(dtype) for kk in ks[5:7])
        pos = jnp.asarray(np.random.default_rng(1).integers(0, T, size=(B, T)), jnp.int32)
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(1.0 / 1e6 ** (np.arange(0, K, 2) / K), jnp.float32)
        ang = jnp.concatenate([ang, ang], axis=-1)
        a, b = jnp.cos(ang), jnp.sin(ang)
        acc = jnp.zeros((K,), jnp.float32)

        def ours_fwd(q, k, a, b):
            return (*_qk_fwd_ffi(q, k, a, b, wq, wk, eps=EPS, norm=True, inverse=False), a, b)  # noqa: B023

        def xla_fwd(q, k, a, b):
            return _ref(q, a, b, wq), _ref(k, a, b, wk), a, b  # noqa: B023

        def ours_bwd(dyq, dyk, q, k, a, b, aq, ak):
            gq, gk, gwq, gwk = _qk_bwd_ffi(dyq, dyk, q, k, a, b, wq, wk, eps=EPS)  # noqa: B023
            return gq, gk, q, k, a, b, aq + gwq.astype(jnp.float32), ak + gwk.astype(jnp.float32)

        def xla_bwd(dyq, dyk, q, k, a, b, aq, ak):
            gq, gwq = jax.vjp(lambda x, w: _ref(x, a, b, w), q, wq)[1](dyq)  # noqa: B023
            gk, gwk = jax.vjp(lambda x, w: _ref(x, a, b, w), k, wk)[1](dyk)  # noqa: B023
            return gq, gk, q, k, a, b, aq + gwq.astype(jnp.float32), ak + gwk.astype(jnp.float32)

        fwd_carry, bwd_carry = (q, k, a, b), (dq, dk, q, k, a, b, acc, acc)
        t = {
            "fwd": (_opbench.time_chain(ours_fwd, fwd_carry, steps, repeats),
                    _opbench.time_chain(xla_fwd, fwd_carry, steps, repeats)),
            "bwd": (_opbench.time_chain(ours_bwd, bwd_carry, steps, repeats),
                    _opbench.time_chain(xla_bwd, bwd_carry, steps, repeats)),
        }
        elem = (q.size + k.size) * dtype.itemsize
        angle_bytes = B * T * 2 * 4 * (K // 2)
        name = f"{label} {B}x{T}x{Hq}+{Hk}x{K} rope_qk norm+rope table"
        table.add_passes(name, dtype.name, t, {"fwd": 2 * elem + angle_bytes, "bwd": 3 * elem + angle_bytes})


def main() -> None:
    ap = _opbench.chain_parser(__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args()
    _opbench.require_gpu(ffi_available)
    dtype = jnp.dtype(args.dtype)
    table = _opbench.Table("rope", args.steps, args.repeats)
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    for label, shape in SHAPES.items():
        B, T, H, K = shape
        kx, kd, kw, key = jax.random.split(key, 4)
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
        w = (1.0 + 0.1 * jax.random.normal(kw, (K,), jnp.float32)).astype(dtype)
        no_w = jnp.zeros((0,), dtype)
        pos = jnp.asarray(rng.integers(0, T, size=(B, T)), jnp.int32)
        inv = jnp.asarray(1.0 / 1e6 ** (np.arange(0, K, 2) / K), jnp.float32)
        ang = pos.astype(jnp.float32)[..., None] * inv
        ang = jnp.concatenate([ang, ang], axis=-1)
        tab = (jnp.cos(ang), jnp.sin(ang))
        acc = jnp.zeros((K,), jnp.float32)
        elem = B * T * H * K * dtype.itemsize
        for norm in (True, False):
            for source, (a, b) in (("positions", (pos, inv)), ("table", tab)):
                angle_bytes = B * T * (4 if source == "positions" else 2 * 4 * (K // 2))
                wn = w if norm else no_w

                def ours_fwd(x, a, b, wn=wn, norm=norm):
                    return _fwd_ffi(x, a, b, wn, eps=EPS, norm=norm, inverse=False), a, b

                if norm:
                    xla_fwd = lambda x, a, b: (_ref(x, a, b, w), a, b)  # noqa: B023

                    def ours_bwd(dy, x, a, b, acc):
                        dx, dw = _bwd_ffi(dy, x, a, b, w, eps=EPS)  # noqa: B023
                        return dx, x, a, b, acc + dw.astype(jnp.float32)

                    def xla_bwd(dy, x, a, b, acc):
                        dx, dw = jax.vjp(lambda x, w: _ref(x, a, b, w), x, w)[1](dy)  # noqa: B023
                        return dx, x, a, b, acc + dw.astype(jnp.float32)

                    bwd_carry = (dy, x, a, b, acc)
                else:
                    xla_fwd = lambda x, a, b: (_ref(x, a, b, None), a, b)
                    ours_bwd = lambda dy, a, b: (
                        _fwd_ffi(dy, a, b, no_w, eps=EPS, norm=False, inverse=True), a, b)  # noqa: B023
                    xla_bwd = lambda dy, a, b: (jax.vjp(lambda v: _ref(v, a, b, None), dy)[1](dy)[0], a, b)
                    bwd_carry = (dy, a, b)
                t = {
                    "fwd": (_opbench.time_chain(ours_fwd, (x, a, b), args.steps, args.repeats),
                            _opbench.time_chain(xla_fwd, (x, a, b), args.steps, args.repeats)),
                    "bwd": (_opbench.time_chain(ours_bwd, bwd_carry, args.steps, args.repeats),
                            _opbench.time_chain(xla_bwd, bwd_carry, args.steps, args.repeats)),
                }
                nbytes = {"fwd": 2 * elem + angle_bytes, "bwd": (3 if norm else 2) * elem + angle_bytes}
                name = f"{label} {B}x{T}x{H}x{K} {'norm+rope' if norm else 'rope'} {source}"
                table.add_passes(name, dtype.name, t, nbytes)
        del x, dy, tab
    _pairs(table, dtype, args.steps, args.repeats)
    table.write(args.out)


if __name__ == "__main__":
    main()
