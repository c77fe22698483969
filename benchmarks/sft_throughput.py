"""SFT throughput at the seed benchmark's configuration, one model size per process; also the
multi-GPU / ZeRO / host-offload / full fine-tuning variants of issue 7.

Random-init Qwen3 shapes (0.6B, 1.7B, 4B, 8B, 14B), bf16 base weights, LoRA r=16 alpha=32 on
q,k,v,o,gate,up,down (fp32 adapters), sequence 2048, batch 2, gradient accumulation 4, packed rows
(random document lengths 64..1024, per-document attention and positions), AdamW, the production train
step (surogate_jax.train.jit_train_step) with the trainer's defaults: `recompute: auto` (train.pick_remat: remat
policy and unrolled layers; --unroll-layers as the trainer's `unroll_layers`) and cuDNN packed attention bounded
by the most documents of any row plus one (its loader's bound); --max-segments 0 gives the dense same-document
mask, --recompute true the per-layer recomputation. --long-docs: one document a
row (no packing boundary within the sequence). Tokens/s = B x GPUs x GA x T / median step seconds after
warm-up (compile excluded); MFU per ARCHITECTURE.md (4 x P_linear + 6 x L x T x H x Dh per token,
6 x P_linear with --full-ft, over 989 TFLOP/s x GPUs); peak = the devices' peak bytes in use over
the whole process (max over the used devices, and each); init_peak_gb_per_gpu = the same before
the first step (building the state), compiled_gb = XLA's buffer assignment of the step per device.

Scaling: --gpus N builds the mesh over the first N devices (global batch = batch x N rows, split
over "data"), the state and step exactly as the trainer does (parallel.Layout from a
ParallelConfig with --zero-level / --offload-* / --ep-size; train.init_state; train.jit_train_step).
--ep-size N: expert parallelism, N devices of the mesh split each MoE layer's experts.
--full-ft trains fp32 masters of every weight (bf16 compute, no LoRA), as the trainer's full
fine-tuning does. --baseline-tps (the 1-GPU tokens/s) adds the scaling efficiency
(tokens/s per GPU / baseline).

    python benchmarks/sft_throughput.py --size 0.6b [--steps 8] [--recompute auto|true|false|dots] [--out f.json]
    python benchmarks/sft_throughput.py --size 8b --gpus 4 --full-ft --zero-level 3 --offload-optimizer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _qwen3 import QWEN3, QWEN3_MOE, SEED_H100, TARGETS, head_dim, vocab_size

from surogate_jax import parallel as par
from surogate_jax import train as T
from surogate_jax.config import ParallelConfig
from surogate_jax.lora import init_adapters
from surogate_jax.metrics import H100_BF16_PEAK, flops_per_token
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.optim import adamw_8bit, fp32_state_mask

OFFLOADS = ("optimizer", "master", "grads", "residual", "experts")  # experts: qlora_offload_experts


def qwen3(size: str, recompute: bool | str, full_ft: bool = False, offload_residual: bool = False,
          layers: int | None = None) -> DecoderConfig:
    """A Qwen3 (QWEN3) or Qwen3-MoE (QWEN3_MOE: LoRA on attention and every expert) shape; `layers` overrides the
    depth (a shape too big for one GPU measured per layer)."""
    family = {"model_type": "qwen3"}
    if size in QWEN3_MOE:
        D, L, H, KV, E, k, I, tied = QWEN3_MOE[size]
        F = I
        family = dict(model_type="qwen3_moe", num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                   norm_topk_prob=True, router_aux_loss_coef=0.001)
    else:
        D, F, L, H, KV, tied = QWEN3[size]
    return DecoderConfig(
        vocab_size=vocab_size(size), hidden_size=D, intermediate_size=F, num_layers=layers or L, num_heads=H,
        num_kv_heads=KV, head_dim=head_dim(size), qk_norm=True,
        rope_theta=1e6, tie_word_embeddings=tied, dtype=jnp.bfloat16,
        param_dtype=jnp.float32 if full_ft else jnp.bfloat16,  # full FT: fp32 masters, bf16 compute
        remat_policy="full" if recompute == "auto" else par.remat_policy(recompute, offload_residual),
        lora=None if full_ft else LoraSpec(rank=16, alpha=32.0, targets=TARGETS),
        **family,
    )


def packed_batches(rng, n, accum, rows, T_, vocab, long_docs=False):
    """n batches [accum, rows, T] of packed documents (lengths 64..1024; long_docs: one of T a row), shifted
    targets."""
    out = []
    for _ in range(n):
        b = {k: np.zeros((accum, rows, T_), np.int32) for k in ("input_ids", "targets", "positions", "segment_ids")}
        b["loss_mask"] = np.zeros((accum, rows, T_), np.float32)
        for a in range(accum):
            for r in range(rows):
                t, seg = 0, 1
                while t < T_:
                    m = T_ if long_docs else min(int(rng.integers(64, 1025)), T_ - t)
                    doc = rng.integers(0, vocab, m)
                    b["input_ids"][a, r, t:t + m] = doc
                    b["targets"][a, r, t:t + m - 1] = doc[1:]
                    b["loss_mask"][a, r, t + m // 3:t + m - 1] = 1  # the reply part is supervised
                    b["positions"][a, r, t:t + m] = np.arange(m)
                    b["segment_ids"][a, r, t:t + m] = seg
                    t, seg = t + m, seg + 1
        out.append(b)
    return out


def init_weights(model: Decoder, layout: par.Layout, seed: int):
    """Random weights of `model` (no LoRA) built directly in their final sharding (ZeRO-3: no device
    ever holds the whole model), in device memory (init_state moves offloaded masters to the host)."""
    ids = jnp.zeros((1, 8), jnp.int32)
    init = lambda key: nn.meta.unbox(model.init(key, ids)["params"])
    shardings = layout.weight_shardings(jax.eval_shape(init, jax.random.key(seed)), trainable=False)
    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def make_tx(optimizer: str, mesh=None):
    """mesh: the mesh whose shards each update their own slice of the 8-bit state (ZeRO >= 1), as the trainer does."""
    if optimizer == "adamw_8bit":  # as the trainer builds it: norms keep fp32 moments
        return adamw_8bit(2e-4, weight_decay=0.0, fp32_mask=fp32_state_mask, mesh=mesh)
    return optax.adamw(2e-4, weight_decay=0.0)


def device_peaks(devices) -> list[float | None]:
    """Peak bytes in use per device (GB) since the process started; None where not reported (CPU)."""
    stats = [d.memory_stats() or {} for d in devices]
    return [s["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in s else None for s in stats]


def compiled_memory_gb(compiled) -> dict:
    """XLA's per-device buffer assignment of the step (GB): device arguments + outputs - donated
    aliases + temporaries is the step's own device footprint; host_* are pinned_host buffers."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    g = lambda k: getattr(m, k, 0) / 1e9
    dev = g("argument_size_in_bytes") + g("output_size_in_bytes") - g("alias_size_in_bytes") + g("temp_size_in_bytes")
    return {"device_total": dev, "temp": g("temp_size_in_bytes"), "arguments": g("argument_size_in_bytes"),
            "host_arguments": g("host_argument_size_in_bytes"), "host_temp": g("host_temp_size_in_bytes")}


def run(size: str, steps: int, recompute: bool | str, batch: int, accum: int, seq: int, gpus: int = 1,
        zero_level: int = 1, offload: tuple[str, ...] = (), full_ft: bool = False, optimizer: str = "adamw",
        baseline_tps: float | None = None, recipe: str = "bf16", kernels: tuple[str, ...] | None = None,
        qlora: str | None = None, max_segments: int | None = None, long_docs: bool = False,
        trace_dir: str | None = None, unroll: bool | None = None, layers: int | None = None, ep_size: int = 1) -> dict:
    if recompute == "auto" and "residual" in offload:
        recompute = True  # as the trainer: the offloaded layer input is what the recomputation starts from
    cfg = qwen3(size, recompute, full_ft, "residual" in offload, layers)
    devices = par.run_devices(gpus)
    rows = batch * len(devices)
    host_batches = packed_batches(np.random.default_rng(0), 3, accum, rows, seq, cfg.vocab_size, long_docs)
    if max_segments == -1:  # as the trainer's loader bound: the most documents of any row, plus a padding run
        max_segments = 1 + max(int(b["segment_ids"].max()) for b in host_batches)
    cfg = cfg.replace(max_segments=max_segments or None)  # 0 / None: the dense same-document mask
    if qlora is not None:  # the frozen base's projections stored quantized (the config keys' defaults)
        from surogate_jax.qlora.base import QloraSpec

        cfg = cfg.replace(qlora={"bnb": QloraSpec("nf4", 64, True), "fp8": QloraSpec("fp8", 128),
                                 "fp4": QloraSpec("fp4", 16)}[qlora])
    unroll = T.auto_unroll(cfg, unroll)  # as the trainer (QLoRA on experts: the loop)
    if recompute != "auto":  # as the trainer: an explicit recompute keeps the layer loop unless unroll_layers: true
        cfg = cfg.replace(unroll_layers=bool(unroll))
    if kernels is not None:  # which model ops run our CUDA kernels (DecoderConfig.kernels)
        cfg = cfg.replace(kernels=kernels)
    if recipe != "bf16":  # precision recipe of the seven projections (LoRA: frozen base quantized once)
        from surogate_jax.precision.recipe import QuantRecipe

        cfg = cfg.replace(recipe=QuantRecipe(recipe))
    cfg = cfg.replace(offload_experts="experts" in offload)
    model = Decoder(cfg)
    mesh = T.make_mesh(devices, ep_size)
    pcfg = ParallelConfig(zero_level=zero_level, gpus=gpus, ep_size=ep_size,
                          **{f"offload_{o}": True for o in offload if o != "experts"})
    layout = par.Layout(mesh, dataclasses.replace(par.Plan.from_config(pcfg), offload_experts="experts" in offload))
    if full_ft:  # the trainer's full fine-tuning: no frozen base, the fp32 masters are trained
        params, trainable = {}, init_weights(model, layout, 0)
    else:
        params = init_weights(Decoder(cfg.replace(lora=None)), layout, 0)
        trainable = init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    tx = make_tx(optimizer, mesh if layout.plan.shard_optimizer else None)
    state = T.init_state(model, tx, params, trainable, 0, mesh, layout)
    del params, trainable
    step = T.jit_train_step(model, tx, lambda s: 2e-4, mesh, state, layout)
    batches = [T.global_batch(mesh, b, True) for b in host_batches]
    init_peaks = device_peaks(devices)  # before the first step: what building the state took
    t0 = time.perf_counter()
    note = None
    if recompute == "auto":  # the trainer's `recompute: auto`: the fastest remat policy whose step fits
        model, step, note = T.pick_remat(model, tx, lambda s: 2e-4, mesh, state, layout, batches[0], unroll=unroll)
        print(note, flush=True)
    else:
        step = step.lower(state, batches[0]).compile()
    mem = compiled_memory_gb(step)
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
    if trace_dir:  # two more steps under the profiler (benchmarks/profile/step_breakdown.py reads the trace)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for i in range(2):
                state, m = step(state, batches[i % len(batches)])
                float(m["loss"])
    tokens = rows * accum * seq
    tps = tokens / sec
    mfu = flops_per_token(cfg, seq, frozen_base=not full_ft) * tps / (H100_BF16_PEAK * len(devices))
    peaks = device_peaks(devices)
    known = [p for p in peaks if p is not None]
    res = dict(size=size, layers=cfg.num_layers, device=devices[0].device_kind, jax=jax.__version__,
               recompute=recompute, batch=batch,
               accum=accum, seq=seq, step_s=sec, step_spread_s=max(times[1:]) - min(times[1:]), tokens_per_s=tps,
               mfu=mfu, peak_gb=max(known) if known else 0.0, compile_s=compile_s, losses=losses,
               seed_surogate_bf16=SEED_H100[size][0], seed_unsloth_bf16=SEED_H100[size][1],
               gpus=len(devices), tokens_per_s_per_gpu=tps / len(devices), peak_gb_per_gpu=peaks,
               mode="full" if full_ft else ("qlora-" + qlora if qlora else "lora"), recipe=recipe,
               zero_level=zero_level, offload=list(offload), ep_size=ep_size,
               optimizer=optimizer,
               init_peak_gb_per_gpu=init_peaks, compiled_gb=mem,
               parallel=layout.describe(), remat=model.config.remat_policy,
               unroll_layers=model.config.unroll_layers, remat_note=note, baseline_tps=baseline_tps,
               kernels=list(cfg.kernels), max_segments=cfg.max_segments, long_docs=long_docs,
               ops_env=os.environ.get("SUROGATE_JAX_OPS", ""),
               ffi_graphs=os.environ.get("SUROGATE_JAX_FFI_GRAPHS", "1"),
               scaling_efficiency=(tps / len(devices) / baseline_tps) if baseline_tps else None)
    return res


def table_line(res: dict, plain: bool) -> str:
    """The seed-table line for the plain 1-GPU LoRA run (as before), else the scaling line."""
    if plain:
        return (f"| Qwen3-{res['size'].upper()} | {res['tokens_per_s'] / 1e3:.1f}k | {100 * res['mfu']:.1f}% "
                f"| {res['peak_gb']:.1f} GB | {res['step_s'] * 1e3:.0f} ms | {res['seed_surogate_bf16'] / 1e3:.1f}k "
                f"| {res['seed_unsloth_bf16'] / 1e3:.1f}k |")
    eff = f"{100 * res['scaling_efficiency']:.1f}%" if res["scaling_efficiency"] else "--"
    peaks = "/".join("--" if p is None else f"{p:.1f}" for p in res["peak_gb_per_gpu"])
    ep = f" ep {res['ep_size']}" if res["ep_size"] > 1 else ""
    return (f"| Qwen3-{res['size'].upper()} | {res['mode']} | {res['gpus']}{ep} | zero {res['zero_level']} "
            f"| {','.join(res['offload']) or 'none'} | {res['optimizer']} | {res['tokens_per_s'] / 1e3:.2f}k "
            f"| {res['tokens_per_s_per_gpu'] / 1e3:.2f}k | {eff} | {100 * res['mfu']:.1f}% | {res['peak_gb']:.1f} GB "
            f"({peaks}) | {res['step_s'] * 1e3:.0f} ms |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=[*QWEN3, *QWEN3_MOE], required=True)
    ap.add_argument("--layers", type=int, help="override the model's depth (a shape too big for the GPU, per layer)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2, help="rows per GPU per micro-batch")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--recompute", default="auto", choices=("auto", "true", "false", "full", "none", "dots",
                                                             "dots_no_batch"),
                    help="the trainer's `recompute` (default auto: no recomputation when XLA's estimate of the step "
                    "fits the device, as the trainer's default)")
    ap.add_argument("--no-recompute", dest="recompute", action="store_const", const="false")
    ap.add_argument("--auto-recompute", dest="recompute", action="store_const", const="auto")
    ap.add_argument("--gpus", type=int, default=1, help="mesh over the first N local devices (0 = all)")
    ap.add_argument("--ep-size", type=int, default=1, help="expert parallelism: groups of N devices split the experts")
    ap.add_argument("--zero-level", type=int, choices=(0, 1, 2, 3), default=ParallelConfig().zero_level)
    for o in OFFLOADS:
        ap.add_argument(f"--offload-{o}", action="store_true")
    ap.add_argument("--full-ft", action="store_true", help="full fine-tuning (fp32 masters), no LoRA")
    ap.add_argument("--optimizer", choices=("adamw", "adamw_8bit"), default="adamw")
    ap.add_argument("--baseline-tps", type=float, help="1-GPU tokens/s: report the scaling efficiency")
    ap.add_argument("--recipe", choices=("bf16", "fp8-hybrid", "nvfp4"), default="bf16", help="precision recipe")
    ap.add_argument("--qlora", choices=("bnb", "fp8", "fp4"), help="QLoRA base format (LoRA only)")
    ap.add_argument("--kernels", help="comma list of DecoderConfig.kernels ('none' for all-XLA; default: the model's)")
    ap.add_argument("--max-segments", type=int, default=-1, help="packed attention's bound on a row's segments "
                    "(default -1: the trainer's, the most documents of any row plus one); 0: the dense same-document "
                    "mask")
    ap.add_argument("--unroll-layers", choices=("auto", "true", "false"), default="auto",
                    help="the trainer's `unroll_layers` (default auto: picked with recompute auto; else the loop)")
    ap.add_argument("--trace", help="also profile two steps into this directory (jax.profiler, perfetto json)")
    ap.add_argument("--long-docs", action="store_true", help="one document of --seq tokens a row (no packing)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.max_segments < -1:
        ap.error(f"--max-segments {a.max_segments}: use -1 (the data's bound), 0 (the dense mask) or a positive bound")
    kernels = None if a.kernels is None else tuple(k for k in a.kernels.split(",") if k and k != "none")
    offload = tuple(o for o in OFFLOADS if getattr(a, f"offload_{o}"))
    recompute = {"true": True, "false": False}.get(a.recompute, a.recompute)
    res = run(a.size, a.steps, recompute, a.batch, a.accum, a.seq, gpus=a.gpus, zero_level=a.zero_level,
              offload=offload, full_ft=a.full_ft, optimizer=a.optimizer, baseline_tps=a.baseline_tps,
              recipe=a.recipe, kernels=kernels, qlora=a.qlora, max_segments=a.max_segments, long_docs=a.long_docs,
              trace_dir=a.trace, unroll={"auto": None, "true": True, "false": False}[a.unroll_layers], layers=a.layers,
              ep_size=a.ep_size)
    plain = res["gpus"] == 1 and not (offload or a.full_ft or a.optimizer != "adamw" or a.baseline_tps or a.qlora)
    print(json.dumps(res))
    print(table_line(res, plain))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
