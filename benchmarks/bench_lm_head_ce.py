"""Benchmark the fused LM head + cross-entropy on GPU against the pure-JAX chunked loss and the
unfused reference: forward+backward time and memory, at Qwen3 shapes (4096 tokens x 151936 vocab,
hidden 1024 = Qwen3-0.6B and 4096 = Qwen3-8B, bf16).

    python benchmarks/bench_lm_head_ce.py [--out results.jsonl] [--repeats 10] [--tokens 4096]
        [--hidden 1024 4096] [--isolate]

Implementations (all return (loss sum, count) and are differentiated with jax.value_and_grad):
  fused        lm_head_ce(impl="ffi"): chunk GEMM (fp32 logits) + our CUDA row kernel + dh GEMM in
               the forward rule; with a trainable head the default head_grad="vocab_chunks"
               computes dW in the backward over vocab blocks (logits block recomputed: 4 GEMMs,
               no [D, V] accumulator) (default chunk, and chunk / vocab-block sweeps)
  fused_tokacc head_grad="token_accum" (full-ft only): dW accumulated across token chunks in an
               fp32 [D, V] accumulator in the forward rule (3 GEMMs)
  fused_bf16   the same with bf16 logits (kernel works in place over the GEMM output)
  fused_2pass  fused with kernel="two_pass": the row kernel pre-Hopper GPUs run, instead of the
               single-read cluster kernel
  fused_bf16acc  fused_bf16 + token_accum with the head gradient accumulated in bf16 (full-ft)
  fused_twin   lm_head_ce(impl="ref"): the same chunked algorithm with the kernel's jnp twin (XLA
               fusions instead of our kernel)
  chunked_jax  lm_head_ce_ref: the plain chunked loss (lax.scan + jax.checkpoint per chunk of 2048,
               XLA autodiff: recomputes each chunk's logits GEMM in the backward)
  unfused      full [N, V] fp32 logits, log_softmax, XLA autodiff
Modes: "full-ft" (gradients for hidden and the head: 3 GEMMs of 2 N D V FLOPs each are needed;
the vocab_chunks path runs a 4th), "lora" (head frozen: gradient for hidden only, 2 GEMMs), "eval"
(loss only, 1 GEMM). TFLOP/s counts the needed GEMMs only (3 / 2 / 1), so it compares times.

Memory: `temp MB` is XLA's compiled memory_analysis() temp_size_in_bytes of the jitted program
(everything it allocates besides arguments and outputs); with --isolate every configuration also
runs in a fresh process and reports the device's peak_bytes_in_use minus the bytes in use before
the call (arguments), which includes outputs. Time: median of --repeats calls after warm-up.
TFLOP/s counts only the GEMMs; "% of 740" compares with the measured bf16 GEMM rate on the H100.
Target (issue 4): fused peak <= 1/8 of unfused and fused time <= unfused time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from surogate_jax.ops import ffi_available, lm_head_ce, lm_head_ce_ref

VOCAB = 151936
GEMM_TFLOPS = 740.0


def _unfused(h, w, t, m):
    x = jnp.dot(h, w, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(x, axis=-1)
    nll = -jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * m), jnp.sum(m)


def impls(chunks, vocab_chunks=()):
    out = {
        "fused": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ffi"),
        "fused_bf16": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ffi", logits_dtype=jnp.bfloat16),
        "fused_2pass": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ffi", kernel="two_pass"),
        "fused_tokacc": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ffi", head_grad="token_accum"),
        "fused_bf16acc": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ffi", logits_dtype=jnp.bfloat16,
                                                       head_grad="token_accum", dhead_accum_dtype=jnp.bfloat16),
        "fused_twin": lambda h, w, t, m: lm_head_ce(h, w, t, m, impl="ref"),
        "chunked_jax": lambda h, w, t, m: lm_head_ce_ref(h, w, t, m, chunk=2048),
        "unfused": _unfused,
    }
    for c in chunks:
        out[f"fused_c{c}"] = lambda h, w, t, m, c=c: lm_head_ce(h, w, t, m, impl="ffi", chunk=c)
    for c in vocab_chunks:  # vocab_chunks' pass-2 block (full-ft only)
        out[f"fused_v{c}"] = lambda h, w, t, m, c=c: lm_head_ce(h, w, t, m, impl="ffi", vocab_chunk=c)
    return out


def program(fn, mode):
    if mode == "eval":
        return jax.jit(lambda h, w, t, m: fn(h, w, t, m)[0])
    argnums = (0, 1) if mode == "full-ft" else 0
    return jax.jit(jax.value_and_grad(lambda h, w, t, m: fn(h, w, t, m)[0], argnums=argnums))


def inputs(n, d, v):
    kh, kw, kt, km = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (d, v), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (n,), 0, v)
    m = (jax.random.uniform(km, (n,)) > 0.1).astype(jnp.float32)
    return h, w, t, m


def measure(name, mode, n, d, v, repeats, chunks, vocab_chunks=(), isolated=False):
    fn = impls(chunks, vocab_chunks)[name]
    args = inputs(n, d, v)
    jax.block_until_ready(args)
    f = program(fn, mode)
    compiled = f.lower(*args).compile()
    ma = compiled.memory_analysis()
    temp = getattr(ma, "temp_size_in_bytes", -1) if ma is not None else -1
    outb = getattr(ma, "output_size_in_bytes", -1) if ma is not None else -1
    dev = jax.devices()[0]
    before = (dev.memory_stats() or {}).get("bytes_in_use", 0)
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    # the process-lifetime peak means something only in a fresh process (--isolate)
    peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) - before if isolated else float("nan")
    gemms = {"full-ft": 3, "lora": 2, "eval": 1}[mode]
    sec = statistics.median(times)
    tflops = gemms * 2 * n * d * v / sec / 1e12
    return {"impl": name, "mode": mode, "tokens": n, "hidden": d, "vocab": v, "ms": sec * 1e3,
            "gemm_tflops": tflops, "pct_gemm": 100 * tflops / GEMM_TFLOPS, "temp_mb": temp / 2**20,
            "out_mb": outb / 2**20, "peak_mb_process": peak / 2**20}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--chunks", type=int, nargs="*", default=[512, 1024, 2048, 4096],
                    help="extra fused chunk sizes to sweep (full-ft and lora)")
    ap.add_argument("--vocab-chunks", type=int, nargs="*", default=[4096, 8192, 32768],
                    help="extra pass-2 vocab block sizes to sweep (full-ft, head_grad=vocab_chunks)")
    ap.add_argument("--modes", nargs="+", default=["full-ft", "lora", "eval"],
                    choices=["full-ft", "lora", "eval"])
    ap.add_argument("--isolate", action="store_true", help="one fresh process per configuration")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    args = ap.parse_args()

    if args.one:
        cfg = json.loads(args.one)
        print("RESULT " + json.dumps(measure(**cfg, isolated=True)), flush=True)
        return
    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)

    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": _commit(),
            "repeats": args.repeats}
    print(f"# LM head + CE on {meta['device']}, jax {meta['jax']}, commit {meta['commit']}, {meta['date']}")
    print("| N x D x V | mode | impl | ms | GEMM TFLOP/s | % of 740 | temp MB | peak MB | vs unfused: time, temp |")
    print("|---|---|---|---|---|---|---|---|---|")
    names = list(impls(args.chunks, args.vocab_chunks))
    records = []
    for d in args.hidden:
        for mode in args.modes:
            rows = {}
            # the unfused reference first: the ratios are relative to it
            for name in ["unfused"] + [x for x in names if x != "unfused"]:
                if mode == "eval" and ("_c" in name or name in ("fused_2pass", "fused_bf16acc")):
                    continue
                if mode != "full-ft" and (name in ("fused_bf16acc", "fused_tokacc") or name.startswith("fused_v")):
                    continue  # head-gradient variants: the same program as "fused" without a head gradient
                cfg = {"name": name, "mode": mode, "n": args.tokens, "d": d, "v": args.vocab,
                       "repeats": args.repeats, "chunks": args.chunks, "vocab_chunks": args.vocab_chunks}
                try:
                    if args.isolate:
                        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                                           capture_output=True, text=True, timeout=900, check=False)
                        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                        if not line:
                            raise RuntimeError(r.stderr[-2000:])
                        rec = json.loads(line[-1][7:])
                    else:
                        rec = measure(**cfg)
                except Exception as e:  # noqa: BLE001  (an OOM in one configuration must not end the table)
                    print(f"| {args.tokens} x {d} x {args.vocab} | {mode} | {name} | failed: "
                          f"{type(e).__name__}: {str(e)[:200]} |", flush=True)
                    continue
                rows[name] = rec
                base = rows.get("unfused")
                rec = {**meta, **rec}
                if base:
                    rec["speedup_vs_unfused"] = base["ms"] / rec["ms"]
                    rec["temp_ratio_vs_unfused"] = rec["temp_mb"] / max(base["temp_mb"], 1e-9)
                records.append(rec)
                ratio = (f"{rec['speedup_vs_unfused']:.2f}x, 1/{1 / max(rec['temp_ratio_vs_unfused'], 1e-9):.1f}"
                         if base else "")
                print(f"| {args.tokens} x {d} x {args.vocab} | {mode} | {name} | {rec['ms']:.2f} | "
                      f"{rec['gemm_tflops']:.0f} | {rec['pct_gemm']:.0f}% | {rec['temp_mb']:.0f} | "
                      f"{rec['peak_mb_process']:.0f} | {ratio} |", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
