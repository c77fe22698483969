"""Benchmark the NorMuon update on GPU: where its time goes, and whether a fused kernel could pay.

    python benchmarks/bench_normuon.py [--out results.jsonl] [--steps 5] [--repeats 10]

There is no NorMuon kernel (surogate_jax/optim/normuon.py explains why); this measures that
claim on the hidden matrices of one model's layers (q, k, v, o, gate, up, down; fp32 masters,
stacked [L, in, out] as our scanned models store them):
  normuon      the whole update + parameter write (jitted, state carried from step to step)
  ns_only      the 5 Newton-Schulz steps alone (bf16 GEMMs) on the same matrices
  no_ns        the update with ns_steps=0: everything except the NS GEMMs (momentum, the
               Frobenius normalization, second moment, both norms, rescale, cautious decay,
               parameter write) = what a fused elementwise kernel could replace
  adamw        optax.adamw on the same matrices, for scale
Floors: NS at 989 TFLOP/s dense bf16 (FLOPs = 5 (4 m^2 n + 2 m^3) per matrix, m <= n); the
elementwise part at 3000 GB/s for the 30 bytes per parameter that any implementation moves (see
normuon.py: read grad, read+write momentum, write the bf16 NS input; read O twice, read+write the
parameter). "% of floor" of no_ns is how close XLA's fusions come to what a fused kernel could
reach; "share" = no_ns / normuon bounds what such a kernel could save of the whole update.
"""

from __future__ import annotations

import argparse

import _opbench
import jax
import jax.numpy as jnp
import optax

from surogate_jax.optim.normuon import newton_schulz, normuon

PEAK_FLOPS = 989e12
# name: (hidden D, heads H, kv heads, head dim K, intermediate F, layers timed)
MODELS = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, 4), "qwen3-8b": (4096, 32, 8, 128, 12288, 2),
          "tiny": (64, 4, 2, 16, 128, 2)}  # tiny: a CPU smoke test of this script (--allow-cpu)


def matrices(D, H, KV, K, F, L, key):
    shapes = {"q_proj": (D, H * K), "k_proj": (D, KV * K), "v_proj": (D, KV * K), "o_proj": (H * K, D),
              "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    keys = jax.random.split(key, len(shapes))
    tree = {n: {"kernel": 0.02 * jax.random.normal(k, (L, *s), jnp.float32)} for (n, s), k in zip(shapes.items(), keys)}
    return {"layers": tree}, shapes


def ns_flops(shapes, L) -> float:
    total = 0
    for m, n in shapes.values():
        m, n = min(m, n), max(m, n)
        total += 5 * (4 * m * m * n + 2 * m**3)
    return float(total * L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"], choices=list(MODELS))
    ap.add_argument("--allow-cpu", action="store_true", help="run anyway without a GPU (smoke test)")
    args = ap.parse_args()
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print("error: needs a CUDA GPU", flush=True)
        raise SystemExit(2)
    meta = {"op": "normuon", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "commit": _opbench.commit(), "steps": args.steps, "repeats": args.repeats}
    print(f"# normuon on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}")
    print("| model | layers | params | variant | ms / step | ms / layer | floor ms | % of floor | share of normuon |")
    print("|---|---|---|---|---|---|---|---|---|")
    records = []
    for name in args.models:
        D, H, KV, K, F, L = MODELS[name]
        params, shapes = matrices(D, H, KV, K, F, L, jax.random.key(0))
        grads = jax.tree.map(lambda p: jnp.sin(p * 37.0) * 1e-3, params)
        n_params = sum(leaf.size for leaf in jax.tree.leaves(params))

        def opt_step(tx):
            def step(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, g
            return step

        times = {}
        for variant, tx in (("normuon", normuon(1e-3, weight_decay=0.01)),
                            ("no_ns", normuon(1e-3, weight_decay=0.01, ns_steps=0)),
                            ("adamw", optax.adamw(1e-3, weight_decay=0.01))):
            state = jax.jit(tx.init)(params)
            times[variant] = _opbench.time_chain(opt_step(tx), (params, state, grads), args.steps, args.repeats)
        ns = lambda t: (jax.tree.map(lambda x: newton_schulz(x).astype(x.dtype), t),)  # noqa: E731
        times["ns_only"] = _opbench.time_chain(ns, (params,), args.steps, args.repeats)

        flops = ns_flops(shapes, L)
        floors = {"ns_only": flops / PEAK_FLOPS, "no_ns": 30 * n_params / 3000e9,
                  "adamw": 36 * n_params / 3000e9}  # adamw: g, p r/w, m r/w, v r/w (fp32)
        floors["normuon"] = floors["ns_only"] + floors["no_ns"]
        for variant in ("normuon", "ns_only", "no_ns", "adamw"):
            t = times[variant]
            rec = {**meta, "model": name, "layers": L, "params": n_params, "variant": variant, "ms": t * 1e3,
                   "ms_per_layer": t * 1e3 / L, "floor_ms": floors[variant] * 1e3,
                   "pct_floor": 100 * floors[variant] / t, "share_of_normuon": t / times["normuon"]}
            if variant == "ns_only":
                rec["tflops"] = flops / t / 1e12
            records.append(rec)
            print(f"| {name} | {L} | {n_params / 1e6:.0f}M | {variant} | {rec['ms']:.2f} | {rec['ms_per_layer']:.2f} | "
                  f"{rec['floor_ms']:.2f} | {rec['pct_floor']:.0f}% | {rec['share_of_normuon']:.2f} |", flush=True)
        print(f"NS: {flops / times['ns_only'] / 1e12:.0f} TFLOP/s over {flops / 1e12:.2f} TFLOP per step", flush=True)
    _opbench.append_jsonl(args.out, records)


if __name__ == "__main__":
    main()
