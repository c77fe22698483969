"""SFT throughput at the seed benchmark's configuration, one model size per process.

Random-init Qwen3 shapes (0.6B, 1.7B, 4B, 8B, 14B), bf16 base weights, LoRA r=16 alpha=32 on
q,k,v,o,gate,up,down (fp32 adapters), sequence 2048, batch 2, gradient accumulation 4, packed rows
(random document lengths, per-document attention and positions), AdamW, the production train
step (surogate_jax.train.jit_train_step). Tokens/s = B x GA x T / median step seconds after
warm-up (compile excluded); MFU per ARCHITECTURE.md (4 x P_linear + 6 x L x T x H x Dh per token,
989 TFLOP/s); peak = the device's peak bytes in use.

    python benchmarks/sft_throughput.py --size 0.6b [--steps 8] [--no-recompute] [--out f.json]
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
import optax

from surogate_jax import train as T
from surogate_jax.lora import init_adapters
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec

QWEN3 = {  # from the Qwen3 config.json files: hidden, intermediate, layers, heads, kv heads, tied
    "0.6b": (1024, 3072, 28, 16, 8, True),
    "1.7b": (2048, 6144, 28, 16, 8, True),
    "4b": (2560, 9728, 36, 32, 8, True),
    "8b": (4096, 12288, 36, 32, 8, False),
    "14b": (5120, 17408, 40, 40, 8, False),
    "tiny": (64, 128, 2, 4, 2, True),  # CPU smoke test of this script only
}
SEED_H100 = {  # seed table, NVIDIA H100 80GB HBM3, total tokens/s (Surogate BF16, Unsloth BF16)
    "0.6b": (53.9e3, 21.3e3), "1.7b": (32.8e3, 20.8e3), "4b": (15.9e3, 12.4e3),
    "8b": (10.2e3, 8.9e3), "14b": (6.0e3, 5.6e3), "tiny": (float("nan"), float("nan")),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen3(size: str, recompute: bool) -> DecoderConfig:
    D, F, L, H, KV, tied = QWEN3[size]
    return DecoderConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=D, intermediate_size=F, num_layers=L, num_heads=H,
        num_kv_heads=KV, head_dim=128, qk_norm=True, rope_theta=1e6, tie_word_embeddings=tied,
        dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat_policy="full" if recompute else "none",
        lora=LoraSpec(rank=16, alpha=32.0, targets=TARGETS),
    )


def packed_batches(rng, n, accum, rows, T_, vocab):
    """n batches [accum, rows, T] of packed documents (lengths 64..1024) with shifted targets."""
    out = []
    for _ in range(n):
        b = {k: np.zeros((accum, rows, T_), np.int32) for k in ("input_ids", "targets", "positions", "segment_ids")}
        b["loss_mask"] = np.zeros((accum, rows, T_), np.float32)
        for a in range(accum):
            for r in range(rows):
                t, seg = 0, 1
                while t < T_:
                    m = min(int(rng.integers(64, 1025)), T_ - t)
                    doc = rng.integers(0, vocab, m)
                    b["input_ids"][a, r, t:t + m] = doc
                    b["targets"][a, r, t:t + m - 1] = doc[1:]
                    b["loss_mask"][a, r, t + m // 3:t + m - 1] = 1  # the reply part is supervised
                    b["positions"][a, r, t:t + m] = np.arange(m)
                    b["segment_ids"][a, r, t:t + m] = seg
                    t, seg = t + m, seg + 1
        out.append(b)
    return out


def run(size: str, steps: int, recompute: bool, batch: int, accum: int, seq: int) -> dict:
    cfg = qwen3(size, recompute)
    model = Decoder(cfg)
    mesh = T.make_mesh(jax.devices()[:1])
    params = nn.meta.unbox(jax.jit(Decoder(cfg.replace(lora=None)).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    adapters = init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    tx = optax.adamw(2e-4, weight_decay=0.0)
    state = T.init_state(model, tx, params, adapters, 0, mesh)
    del params, adapters
    step = T.jit_train_step(model, tx, lambda s: 2e-4, mesh, state)
    batches = [T.global_batch(mesh, b, True) for b in packed_batches(np.random.default_rng(0), 3, accum, batch, seq, cfg.vocab_size)]
    t0 = time.perf_counter()
    state, m = step(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % len(batches)])
        losses.append(float(m["loss"]))  # fetching the loss syncs, as the training loop's logging does
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times[1:])
    tokens = batch * accum * seq
    tps = tokens / sec
    mfu = T.flops_per_token(cfg, seq, frozen_base=True) * tps / T.H100_BF16_PEAK
    res = dict(size=size, device=jax.devices()[0].device_kind, jax=jax.__version__, recompute=recompute, batch=batch,
               accum=accum, seq=seq, step_s=sec, step_spread_s=max(times[1:]) - min(times[1:]), tokens_per_s=tps,
               mfu=mfu, peak_gb=(T.peak_memory_bytes() or 0) / 1e9, compile_s=compile_s, losses=losses,
               seed_surogate_bf16=SEED_H100[size][0], seed_unsloth_bf16=SEED_H100[size][1])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(QWEN3), required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-recompute", dest="recompute", action="store_false")
    ap.add_argument("--out")
    a = ap.parse_args()
    res = run(a.size, a.steps, a.recompute, a.batch, a.accum, a.seq)
    line = (f"| Qwen3-{a.size.upper()} | {res['tokens_per_s'] / 1e3:.1f}k | {100 * res['mfu']:.1f}% | {res['peak_gb']:.1f} GB "
            f"| {res['step_s'] * 1e3:.0f} ms | {res['seed_surogate_bf16'] / 1e3:.1f}k | {res['seed_unsloth_bf16'] / 1e3:.1f}k |")
    print(json.dumps(res))
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
