"""The HF transformers + PEFT peer: LoRA SFT tokens/s and peak memory at the seed configuration, to run in the
same GPU session as benchmarks/sft_throughput.py (the ratio is the figure; absolute numbers move between machines).

    python3 benchmarks/peer_hf_peft.py --size 0.6b [--gradient-checkpointing] [--steps 4] [--out f.jsonl]

What it runs: `Qwen3ForCausalLM` (or `Qwen3MoeForCausalLM` for the MoE shapes) built from the shapes of
benchmarks/_qwen3.py with random weights, bf16, SDPA attention (PyTorch's flash/efficient kernels); PEFT LoRA rank 16,
alpha 32, dropout 0 on the seven projections (adapters in fp32, PEFT's default autocast; MoE under transformers 5,
whose experts are stacked 3-D parameters: on q,k,v,o plus PEFT's `target_parameters` LoRA on the experts'
gate_up_proj and down_proj); torch.optim.AdamW (fused) at lr 2e-4 on the adapters;
rows of `seq` random tokens without packing (the peer has no packed-row attention mask; our benchmark's packed rows
do the same work or less), batch rows per micro-batch, grad-accum micro-batches per step, labels = inputs (HF's
shifted loss). Gradient checkpointing off by default (`--gradient-checkpointing`: HF's non-reentrant one, as our
full recompute). The first step (compile/autotune warm-up) is not timed; the median of the timed steps is.
Tokens/s = batch x seq x accum / step time; peak = torch.cuda.max_memory_allocated. `--device cpu --size tiny`
is a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _qwen3 import QWEN3, QWEN3_MOE, SEED_H100, TARGETS, head_dim, vocab_size


def build(size: str, device: str, gradient_checkpointing: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=vocab_size(size), head_dim=head_dim(size), rope_theta=1e6, max_position_embeddings=40960,
                  attn_implementation="sdpa")
    if size in QWEN3_MOE:
        D, L, H, KV, E, k, I, tied = QWEN3_MOE[size]
        cfg = Qwen3MoeConfig(hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                             num_key_value_heads=KV, tie_word_embeddings=tied, num_experts=E, num_experts_per_tok=k,
                             moe_intermediate_size=I, norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    else:
        D, F, L, H, KV, tied = QWEN3[size]
        cfg = Qwen3Config(hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                          num_key_value_heads=KV, tie_word_embeddings=tied, **common)
        cls = Qwen3ForCausalLM
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: an fp32 30B-A3B would not fit next to its bf16 copy
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    targets, params = list(TARGETS), None
    experts = getattr(model.model.layers[0].mlp, "experts", None)
    if hasattr(experts, "gate_up_proj"):  # transformers 5 stacks the experts: PEFT adapts the 3-D parameters
        targets, params = list(TARGETS[:4]), ["experts.gate_up_proj", "experts.down_proj"]
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM",
                      **({"target_parameters": params} if params else {}))
    model = get_peft_model(model, lora)
    model.train()
    return model


def run(size: str, steps: int, batch: int, accum: int, seq: int, device: str, gradient_checkpointing: bool) -> dict:
    import torch

    model = build(size, device, gradient_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=device != "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = [torch.randint(0, vocab_size(size), (batch, seq), generator=gen).to(device) for _ in range(accum)]

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    def step() -> float:
        total = 0.0
        for ids in rows:
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step()]
    sync()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    tokens = batch * seq * accum
    peak = torch.cuda.max_memory_allocated() / 1e9 if device != "cpu" else 0.0
    name = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    return dict(peer="hf+peft", size=size, device=name, torch=torch.__version__, batch=batch, accum=accum, seq=seq,
                gradient_checkpointing=gradient_checkpointing, step_s=sec, step_spread_s=max(times) - min(times),
                tokens_per_s=tokens / sec, peak_gb=peak, warmup_s=warmup_s, losses=losses,
                trainable_params=sum(p.numel() for p in params), seed_surogate_bf16=SEED_H100[size][0],
                seed_unsloth_bf16=SEED_H100[size][1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=[*QWEN3, *QWEN3_MOE], required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.steps < 1 or a.batch < 1 or a.accum < 1 or a.seq < 2:
        ap.error("--steps, --batch and --accum must be >= 1 and --seq >= 2")
    res = run(a.size, a.steps, a.batch, a.accum, a.seq, a.device, a.gradient_checkpointing)
    print(json.dumps(res))
    gc = "on" if res["gradient_checkpointing"] else "off"
    print(f"| Qwen3-{a.size.upper()} | HF+PEFT (checkpointing {gc}) | {res['tokens_per_s'] / 1e3:.1f}k "
          f"| {res['peak_gb']:.1f} GB | {res['step_s'] * 1e3:.0f} ms |")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
