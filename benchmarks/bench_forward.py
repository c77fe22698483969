"""Forward pass of Qwen3-0.6B- and Qwen3-8B-shaped random models on one GPU.

For each size: (1) accuracy: bf16 forward with cuDNN flash attention vs the fp32 forward (XLA
attention) on the same weights, ||bf16 - fp32|| / ||fp32|| over the logits; (2) speed: bf16 forward
(logits included) after compile, median of repeats, tokens/s and model TFLOP/s (forward FLOPs per
token = 2 * P_linear + 2 * L * T * H * Dh, causal attention); (3) memory: the compiled program's
argument/temp/output sizes and the device's peak bytes in use. Run each size in a fresh process
(`--size`) so the peak is that size's own.

    python benchmarks/bench_forward.py --size 0.6b --out $OUT/forward_0.6b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.metrics import linear_params
from surogate_jax.models import Decoder, DecoderConfig

SIZES = {
    # Qwen3-0.6B / Qwen3-8B config.json shapes (vocab 151936, head_dim 128, rope_theta 1e6).
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                 tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
               tie_word_embeddings=False),
}
SHAPES = {"0.6b": (4, 2048), "8b": (2, 2048)}  # (batch, seq) for the speed run


def config(size: str, dtype, attention_impl: str) -> DecoderConfig:
    return DecoderConfig(
        model_type="qwen3", vocab_size=151936, head_dim=128, qk_norm=True, rope_theta=1e6,
        rms_norm_eps=1e-6, dtype=dtype, param_dtype=dtype, attention_impl=attention_impl, **SIZES[size],
    )


def init_params(cfg: DecoderConfig, seed: int):
    ids = jnp.zeros((1, 8), jnp.int32)
    return nn.meta.unbox(jax.jit(Decoder(cfg).init)(jax.random.key(seed), ids)["params"])


def speed(size: str, repeats: int, res: dict) -> None:
    """bf16 weights and activations, cuDNN attention, logits included; runs first so the device's
    peak-bytes counter is this forward's own."""
    cfg = config(size, jnp.bfloat16, "cudnn")
    params = init_params(cfg, 1)
    B, T = SHAPES[size]
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    compiled = jax.jit(Decoder(cfg).apply).lower({"params": params}, ids).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        res["compiled_bytes"] = {
            "arguments": int(mem.argument_size_in_bytes),
            "temp": int(mem.temp_size_in_bytes),
            "output": int(mem.output_size_in_bytes),
        }
    for _ in range(3):
        compiled({"params": params}, ids).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled({"params": params}, ids).block_until_ready()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    flops_per_token = 2 * linear_params(cfg) + 2 * cfg.num_layers * T * cfg.num_heads * cfg.head_dim
    res.update(
        batch=B, seq=T, median_ms=sec * 1e3, spread_ms=(max(times) - min(times)) * 1e3,
        tokens_per_s=B * T / sec, model_tflops=flops_per_token * B * T / sec / 1e12,
        param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
        peak_bytes_in_use=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
    )


def accuracy(size: str, res: dict) -> None:
    """bf16 + cuDNN attention vs an fp32 forward at full matmul precision on the same weights.

    A deep random network amplifies any rounding, so "within bf16 error" is judged against the
    baseline of the plain XLA bf16 forward: cuDNN should add nothing beyond it."""
    cfg32 = config(size, jnp.float32, "xla")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg32.vocab_size, (1, 1024)), jnp.int32)
    params32 = init_params(cfg32, 0)
    with jax.default_matmul_precision("highest"):
        logits32 = jax.jit(Decoder(cfg32).apply)({"params": params32}, ids)
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    del params32
    out = {}
    for impl in ("cudnn", "xla"):
        logits = jax.jit(Decoder(config(size, jnp.bfloat16, impl)).apply)({"params": params16}, ids)
        logits = logits.astype(jnp.float32)
        out[impl] = logits
        res[f"rel_l2_bf16_{impl}_vs_fp32"] = float(jnp.linalg.norm(logits - logits32) / jnp.linalg.norm(logits32))
        res[f"top1_agree_bf16_{impl}_vs_fp32"] = float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(logits32, -1)))
    res["rel_l2_bf16_cudnn_vs_bf16_xla"] = float(
        jnp.linalg.norm(out["cudnn"] - out["xla"]) / jnp.linalg.norm(out["xla"]))
    res["finite"] = bool(jnp.all(jnp.isfinite(out["cudnn"])))


def run(size: str, repeats: int) -> dict:
    dev = jax.devices()[0]
    res: dict = {"size": size, "device": dev.device_kind, "jax": jax.__version__}
    speed(size, repeats, res)
    accuracy(size, res)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args()
    res = run(args.size, args.repeats)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
