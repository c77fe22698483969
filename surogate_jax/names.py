"""Names the config reader checks and the layers that act on them share: one definition each.

No imports, so config.py (which must not import JAX) and the models, recipes and LoRA code all read
them from here.
"""

# The seven linear projections of a decoder layer: what LoRA adapts and what a recipe quantizes.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = PROJECTIONS[4:]  # an MoE expert's three, stacked over the experts

RECIPES = ("bf16", "fp8-hybrid", "nvfp4")
RECIPE_ALIASES = {"fp8_hybrid": "fp8-hybrid"}
FP4_BACKENDS = ("cutlass", "cudnn")

# The decoder's remat policies; a `recompute:` string may name the first four (offload_residual comes
# from its own key).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_residual")
RECOMPUTE_POLICIES = (*REMAT_POLICIES[:4], "auto")  # `recompute:` values besides true/false; auto: train.pick_remat

# QLoRA base-weight formats (surogate_jax/qlora/): the config key that selects each, and its block sizes.
QLORA_FORMATS = {"qlora_bnb": "nf4", "qlora_fp8": "fp8", "qlora_fp4": "fp4"}
NF4_BLOCK_SIZES = (64, 128, 256, 512)  # qlora_bnb_block_size: bitsandbytes' blockwise absmax blocks
FP8_BLOCK_SIZES = (64, 128, 256)  # qlora_block_size: square tiles sharing one FP8 scale


def layer_stack_start(key) -> int | None:
    """The first decoder layer of a stacked-layers module (nn.scan over consecutive layers of one kind): "layers"
    starts at 0, "layers_5" at 5 (a model whose MoE and dense layers alternate has one stack per run); None for
    any other key."""
    if key == "layers":
        return 0
    if isinstance(key, str) and key.startswith("layers_") and key[7:].isdigit():
        return int(key[7:])
    return None
