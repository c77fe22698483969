"""The Qwen3 shapes and seed figures the model benchmarks share (no jax or torch import: the HF+PEFT peer reads it
without starting JAX on the GPU)."""

QWEN3 = {  # from the Qwen3 config.json files: hidden, intermediate, layers, heads, kv heads, tied
    "0.6b": (1024, 3072, 28, 16, 8, True),
    "1.7b": (2048, 6144, 28, 16, 8, True),
    "4b": (2560, 9728, 36, 32, 8, True),
    "8b": (4096, 12288, 36, 32, 8, False),
    "14b": (5120, 17408, 40, 40, 8, False),
    "32b": (5120, 25600, 64, 64, 8, False),
    "tiny": (64, 128, 2, 4, 2, True),  # CPU smoke tests of the scripts only (small vocab and head_dim too)
}
# Qwen3-MoE shapes (config.json): hidden, layers, heads, kv heads, experts, top-k, moe_intermediate, tied
QWEN3_MOE = {
    "30b-a3b": (2048, 48, 32, 4, 128, 8, 768, False),
    "tiny-moe": (64, 2, 4, 2, 8, 2, 32, False),  # CPU smoke tests of the scripts only
}
SEED_H100 = {  # seed table, NVIDIA H100 80GB HBM3, total tokens/s (Surogate BF16, Unsloth BF16)
    "0.6b": (53.9e3, 21.3e3), "1.7b": (32.8e3, 20.8e3), "4b": (15.9e3, 12.4e3),
    "8b": (10.2e3, 8.9e3), "14b": (6.0e3, 5.6e3), "32b": (float("nan"), float("nan")),
    "tiny": (float("nan"), float("nan")), "30b-a3b": (float("nan"), float("nan")),
    "tiny-moe": (float("nan"), float("nan")),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def vocab_size(size: str) -> int:
    return 2048 if size.startswith("tiny") else 151936


def head_dim(size: str) -> int:
    return 16 if size.startswith("tiny") else 128
