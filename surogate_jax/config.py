"""The only YAML reader: Surogate-compatible flat keys -> frozen, typed, sectioned dataclasses.

Users keep their Surogate configs: every key has the seed system's name and default (see
../shared/reference/surogate_inventory.md section 3). The file is flat; we group keys into
sections (`run`, `model`, `data`, `lora`, `optim`, `precision`) so each component receives only its
own. Strict: an unknown key is a `ConfigError` naming the closest valid key; a key given twice in the
file names both lines; a known Surogate key for a feature we have not built yet says "not supported
yet"; wrong types and impossible values say which key and why. Path keys get `~` and $VAR expanded,
and what would only fail after training (the exact-match file) is checked at load. No JAX import
here: this module is a leaf.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import SurogateError
from .names import (
    FP4_BACKENDS,
    FP8_BLOCK_SIZES,
    NF4_BLOCK_SIZES,
    PROJECTIONS,
    QLORA_FORMATS,
    RECIPE_ALIASES,
    RECIPES,
    RECOMPUTE_POLICIES,
)


class ConfigError(SurogateError, ValueError):
    """A config the user must fix (the message names the key)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# ---------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class DatasetConfig:
    """One entry of `datasets:` / `validation_datasets:` (Surogate's dataset keys)."""

    path: str
    type: str = "auto"  # auto | conversation | instruction | text
    subset: str | None = None
    split: str = "train"
    samples: int | None = None
    # conversation
    messages_field: str = "messages"
    system_field: str | None = None
    completion_field: str | None = None
    tools_field: str | None = None
    message_property_mappings: dict | None = None  # {"role": "from", "content": "value"}
    # instruction
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    system_prompt_type: str | None = None  # field | fixed
    system_prompt_field: str | None = None
    system_prompt: str | None = None
    prompt_format: str | None = None
    prompt_format_no_input: str | None = None
    # text
    text_field: str = "text"

    def __post_init__(self):
        _check(self.type in ("auto", "conversation", "instruction", "text"),
               f"datasets[].type={self.type!r}: use auto, conversation, instruction or text"
               + (" (preference data is not supported yet)" if self.type == "preference" else ""))
        _check(self.samples is None or self.samples > 0, f"datasets[].samples={self.samples}: must be > 0")
        _check(self.system_prompt_type in (None, "field", "fixed"),
               f"datasets[].system_prompt_type={self.system_prompt_type!r}: use field or fixed")
        # The formatter's settings (data/formats.py builds from them): checked here, once, at load.
        if self.type in ("conversation", "auto"):
            mapping = self.message_property_mappings or {}
            unknown = sorted(set(mapping) - {"role", "content"})
            _check(not unknown,
                   f"datasets[].message_property_mappings: unknown keys {unknown}; use role and content")
            bad = [k for k, v in mapping.items() if not isinstance(v, str)]
            _check(not bad,
                   f"datasets[].message_property_mappings: the values of {bad} must be field names (strings)")
        if self.type in ("instruction", "auto"):
            kind = self.system_prompt_type or (
                "field" if self.system_prompt_field else "fixed" if self.system_prompt else None)
            _check(kind != "field" or bool(self.system_prompt_field),
                   "datasets[].system_prompt_type=field needs system_prompt_field (the column holding the system "
                   "prompt)")
            _check(kind != "fixed" or bool(self.system_prompt),
                   "datasets[].system_prompt_type=fixed needs system_prompt (the text of the system prompt)")
            for k in ("prompt_format", "prompt_format_no_input"):
                fmt = getattr(self, k)
                try:
                    if fmt is not None:
                        fmt.format(instruction="i", input="x")
                except (KeyError, IndexError, ValueError) as e:
                    raise ConfigError(f"datasets[].{k}={fmt!r} is not a valid format string (use the placeholders "
                                      f"{{instruction}} and {{input}}): {e!r}") from None


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "output"
    run_name: str | None = None
    checkpoint_dir: str | None = None  # default: output_dir
    resume_from_checkpoint: bool = True
    save_steps: int = 50
    save_total_limit: int = 5
    num_epochs: int = 3
    max_steps: int = -1
    eval_steps: int = 100
    logging_steps: int = 1
    per_device_train_batch_size: int = 2
    gradient_accumulation_steps: int = 4
    train_seed: int = 1234
    eval_seed: int = 1234
    report_to: list[str] | None = None
    wandb_project: str | None = None
    wandb_name: str | None = None
    recompute: bool | str = "auto"  # true/false, or a remat policy name (RECOMPUTE_POLICIES); auto: train.pick_remat
    # The decoder layers as straight-line code instead of a loop (DecoderConfig.unroll_layers): faster steps, twice the
    # compile time. auto: recompute auto picks it with the policy; with an explicit recompute, the loop.
    unroll_layers: bool | str = "auto"
    # surogate_jax additions: greedy exact-match accuracy on held-out chat rows after training.
    exact_match_file: str | None = None
    exact_match_samples: int = 100

    def __post_init__(self):
        for k in ("save_steps", "logging_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                  "num_epochs"):
            _check(getattr(self, k) >= 1, f"{k}={getattr(self, k)}: must be >= 1")
        _check(self.max_steps == -1 or self.max_steps >= 1, f"max_steps={self.max_steps}: use -1 (epochs) or >= 1")
        _check(self.eval_steps >= 0, f"eval_steps={self.eval_steps}: must be >= 0 (0 disables eval)")
        _check(self.save_total_limit >= 1, f"save_total_limit={self.save_total_limit}: must be >= 1")
        for k in ("train_seed", "eval_seed"):  # numpy's Generator refuses negative seeds (data split, shuffle)
            _check(0 <= getattr(self, k) < 2**63 - 1, f"{k}={getattr(self, k)}: must be in [0, 2**63 - 1)")
        _check(self.exact_match_samples >= 1, f"exact_match_samples={self.exact_match_samples}: must be >= 1")
        for r in self.report_to or []:
            _check(r in ("wandb", "tensorboard"), f"report_to: {r!r} is not supported (use wandb or tensorboard)")
        _check(isinstance(self.recompute, bool) or self.recompute in RECOMPUTE_POLICIES,
               f"recompute={self.recompute!r}: use true, false or one of {RECOMPUTE_POLICIES}")
        _check(isinstance(self.unroll_layers, bool) or self.unroll_layers == "auto",
               f"unroll_layers={self.unroll_layers!r}: use true, false or auto")




@dataclass(frozen=True)
class ModelConfig:
    model: str = ""
    from_scratch: bool = False
    sequence_len: int = 1024
    init_projections_to_zero: bool = False

    def __post_init__(self):
        _check(bool(self.model), "model: required (an HF model directory or hub id)")
        _check(self.sequence_len >= 2, f"sequence_len={self.sequence_len}: must be >= 2")


@dataclass(frozen=True)
class DataConfig:
    datasets: tuple[DatasetConfig, ...] = ()
    validation_datasets: tuple[DatasetConfig, ...] = ()
    validation_split_ratio: float = 0.1
    sample_packing: bool = True
    loss_scale: str = "default"  # default | last_round | all
    dataloader_num_workers: int = 0  # 0: min(#CPU, 8)

    def __post_init__(self):
        _check(len(self.datasets) > 0, "datasets: at least one dataset is required")
        _check(self.dataloader_num_workers >= 0,
               f"dataloader_num_workers={self.dataloader_num_workers}: must be >= 0 (0 = min(#CPU, 8))")
        _check(0.0 <= self.validation_split_ratio < 1.0,
               f"validation_split_ratio={self.validation_split_ratio}: must be in [0, 1)")
        _check(self.loss_scale in ("default", "last_round", "all"),
               f"loss_scale={self.loss_scale!r}: use default, last_round or all"
               + (" (thinking_only / final_only are not supported yet)"
                  if self.loss_scale in ("thinking_only", "final_only") else ""))


@dataclass(frozen=True)
class LoraConfig:
    lora: bool = True
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("all",)
    merge_adapter: bool = False
    train_router: bool = False  # MoE: the router trained too (its weights join the adapter, as PEFT's modules_to_save)
    # QLoRA: the frozen base's seven projections stored quantized (surogate_jax/qlora/); at most one format.
    qlora_bnb: bool = False  # NF4, bitsandbytes-exact
    qlora_bnb_block_size: int = 64
    qlora_bnb_double_quant: bool = True
    qlora_fp8: bool = False  # E4M3 with one fp32 scale per square tile (HF fine-grained FP8)
    qlora_block_size: int = 128
    qlora_fp4: bool = False  # NVFP4, 16x16 tiles
    qlora_four_over_six: bool = True
    # MoE under QLoRA: the quantized experts stay in pinned host memory, each layer's copied in where it is used
    qlora_offload_experts: bool = False
    # MoE under QLoRA: each layer dequantizes only the experts that received tokens, forward and backward
    qlora_selective_expert_dequant: bool = False

    def __post_init__(self):
        _check(self.lora_rank >= 1, f"lora_rank={self.lora_rank}: must be >= 1")
        _check(0.0 <= self.lora_dropout < 1.0, f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        valid = set(PROJECTIONS) | {"all"}
        bad = [t for t in self.lora_target_modules if t not in valid]
        _check(not bad, f"lora_target_modules: unknown {bad}; use 'all' or some of {list(PROJECTIONS)}")
        on = [k for k in QLORA_FORMATS if getattr(self, k)]
        _check(len(on) <= 1, f"{' and '.join(on)}: pick one QLoRA base format")
        _check(not on or self.lora, f"{on[0] if on else ''}: QLoRA trains adapters over a quantized frozen base; "
               "it needs lora: true")
        _check(not self.train_router or self.lora, "train_router: unfreezes an MoE router under LoRA; full fine-tuning "
               "(lora: false) trains the router anyway: remove the key")
        _check(self.qlora_bnb_block_size in NF4_BLOCK_SIZES,
               f"qlora_bnb_block_size={self.qlora_bnb_block_size}: use one of {list(NF4_BLOCK_SIZES)}")
        _check(self.qlora_block_size in FP8_BLOCK_SIZES,
               f"qlora_block_size={self.qlora_block_size}: use one of {list(FP8_BLOCK_SIZES)}")

    @property
    def qlora_format(self) -> str | None:
        """"nf4" | "fp8" | "fp4" when a qlora_* key is on, else None."""
        return next((f for k, f in QLORA_FORMATS.items() if getattr(self, k)), None)

    @property
    def targets(self) -> tuple[str, ...]:
        return PROJECTIONS if "all" in self.lora_target_modules else tuple(self.lora_target_modules)




@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw_8bit"  # Surogate's default: adamw (fp32 moments) | adamw_8bit | normuon
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.999
    adamw_epsilon: float = 1e-8
    lr_scheduler_type: str = "linear"  # constant | linear | cosine | wsd
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    cooldown_steps: int = 0
    final_lr_fraction: float = 0.0
    wsd_decay_steps_fraction: float = 0.1
    # NorMuon (optimizer: normuon): momentum, neuron-wise second-moment EMA, sign-agreeing weight decay.
    normuon_momentum: float = 0.95
    normuon_beta2: float = 0.95
    normuon_cautious_wd: bool = True
    # Mixture-of-experts router losses (models/moe.py): the load-balancing aux loss's weight (None: the model's
    # config.json router_aux_loss_coef, 0.001 for Qwen3-MoE) and the router z-loss's (ST-MoE; 0: off).
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        ok = ("adamw", "adamw_8bit", "normuon")
        _check(self.optimizer in ok, f"optimizer={self.optimizer!r}: use one of {', '.join(ok)}")
        for k in ("adamw_beta1", "adamw_beta2"):
            _check(0.0 <= getattr(self, k) < 1.0, f"{k}={getattr(self, k)}: must be in [0, 1)")
        for k in ("normuon_momentum", "normuon_beta2"):
            _check(0.0 <= getattr(self, k) < 1.0, f"{k}={getattr(self, k)}: must be in [0, 1)")
        _check(self.learning_rate > 0, f"learning_rate={self.learning_rate}: must be > 0")
        _check(self.lr_scheduler_type in ("constant", "linear", "cosine", "wsd"),
               f"lr_scheduler_type={self.lr_scheduler_type!r}: use constant, linear, cosine or wsd")
        _check(0.0 <= self.warmup_ratio < 1.0, f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        _check(self.warmup_steps >= 0 and self.cooldown_steps >= 0, "warmup_steps / cooldown_steps must be >= 0")
        _check(0.0 <= self.final_lr_fraction <= 1.0, f"final_lr_fraction={self.final_lr_fraction}: must be in [0, 1]")
        _check(0.0 < self.wsd_decay_steps_fraction <= 1.0,
               f"wsd_decay_steps_fraction={self.wsd_decay_steps_fraction}: must be in (0, 1]")
        _check(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm}: must be >= 0 (0 disables)")
        for k in ("router_aux_loss_coef", "router_z_loss_coef"):
            v = getattr(self, k)
            _check(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                 and v >= 0), f"{k}={v!r}: must be a number >= 0 (0 turns the loss off)")


DTYPES = ("bf16", "fp32", "fp16")
# The seed's mixed-precision tables (002 "Precision & Recipes"): the values each knob takes and, per
# recipe, what the GEMMs use. Only the bf16 recipe respects matmul_dtype / gradient_dtype.
MATMUL_DTYPES = ("fp32", "bf16", "e4m3")
GRADIENT_DTYPES = ("fp32", "bf16", "e5m2")
FORCED = {"fp8-hybrid": ("e4m3", "e5m2"), "nvfp4": ("e2m1", "e2m1")}  # (forward, backward) GEMM formats
# Allowed GEMM dispatches (A, B, C): fp32 x fp32 -> fp32, bf16 x bf16 -> fp32 | bf16, e4m3 x e4m3 -> fp32 |
# bf16 (FP8 forward), e4m3 x e5m2 -> bf16 (FP8 backward; the fp8-hybrid recipe).


@dataclass(frozen=True)
class PrecisionConfig:
    recipe: str = "bf16"  # bf16 | fp8-hybrid (alias fp8_hybrid) | nvfp4
    model_dtype: str = "bf16"  # parameter + activation dtype of the base model
    lora_dtype: str = "fp32"  # adapter master weights
    master_dtype: str | None = None  # full fine-tuning master weights (default fp32)
    matmul_dtype: str | None = None  # bf16 recipe: GEMM operand dtype (default model_dtype)
    gradient_dtype: str | None = None  # bf16 recipe: backward GEMM dtype (default matmul_dtype)
    fp8_amax_history: int = 1024  # fp8-hybrid delayed scaling history length
    skip_quant_first_layers: int = 0  # decoder layers kept in the model dtype (fp8-hybrid, nvfp4)
    skip_quant_last_layers: int = 0
    fp4_backend: str = "cutlass"  # nvfp4: recorded (native FP4 GEMMs go through cuBLASLt on SM100+; emulated below)
    fp4_four_over_six: bool = True
    no_fp4_stochastic_rounding: bool = False

    def __post_init__(self):
        recipe = RECIPE_ALIASES.get(self.recipe, self.recipe)
        _check(recipe in RECIPES, f"recipe={self.recipe!r}: use bf16, fp8-hybrid (alias fp8_hybrid) or nvfp4")
        object.__setattr__(self, "recipe", recipe)
        for k in ("model_dtype", "lora_dtype"):
            _check(getattr(self, k) in DTYPES, f"{k}={getattr(self, k)!r}: use one of {DTYPES}")
        _check(self.master_dtype in (None, *DTYPES), f"master_dtype={self.master_dtype!r}: use one of {DTYPES}")
        _check(self.matmul_dtype in (None, *MATMUL_DTYPES),
               f"matmul_dtype={self.matmul_dtype!r}: use one of {MATMUL_DTYPES} (e5m2 / fp16 / e2m1 are not "
               "forward GEMM formats)")
        _check(self.gradient_dtype in (None, *GRADIENT_DTYPES),
               f"gradient_dtype={self.gradient_dtype!r}: use one of {GRADIENT_DTYPES} (fp16 / e4m3 / e2m1 are not "
               "gradient formats)")
        if recipe in FORCED:
            fwd, bwd = FORCED[recipe]
            _check(self.matmul_dtype in (None, fwd if fwd in MATMUL_DTYPES else None)
                   and self.gradient_dtype in (None, bwd if bwd in GRADIENT_DTYPES else None),
                   f"recipe {recipe} forces its GEMM formats ({fwd} forward, {bwd} backward): "
                   f"matmul_dtype={self.matmul_dtype!r} / gradient_dtype={self.gradient_dtype!r} "
                   "are not allowed with it; "
                   f"leave them unset{f' (or {fwd} / {bwd})' if recipe == 'fp8-hybrid' else ''}, or use recipe: bf16 "
                   "with matmul_dtype / gradient_dtype in fp32 or bf16")
        else:
            _check(self.matmul_dtype != "e4m3" and self.gradient_dtype != "e5m2",
                   f"matmul_dtype={self.matmul_dtype!r} / gradient_dtype={self.gradient_dtype!r} under recipe bf16: "
                   "the only FP8 dispatches (e4m3 x e4m3 forward, e4m3 x e5m2 backward) are the fp8-hybrid recipe; "
                   "set recipe: fp8-hybrid, or use fp32 / bf16 for matmul_dtype and gradient_dtype")
        _check(self.fp8_amax_history >= 1, f"fp8_amax_history={self.fp8_amax_history}: must be >= 1")
        for k in ("skip_quant_first_layers", "skip_quant_last_layers"):
            _check(getattr(self, k) >= 0, f"{k}={getattr(self, k)}: must be >= 0")
        _check(self.fp4_backend in FP4_BACKENDS, f"fp4_backend={self.fp4_backend!r}: use cutlass or cudnn")


@dataclass(frozen=True)
class DistributedConfig:
    """Surogate's `distributed:` block (multi-node through Ray; examples/ray_launch.py reads it)."""

    ray_address: str = "auto"
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0: all GPUs of each node
    worker_output_dir: str | None = None

    def __post_init__(self):
        _check(self.num_nodes >= 1, f"distributed.num_nodes={self.num_nodes}: must be >= 1")
        _check(self.gpus_per_node >= 0, f"distributed.gpus_per_node={self.gpus_per_node}: must be >= 0 (0 = all)")


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism, ZeRO, host offload (Surogate's keys and semantics; see parallel.py)."""

    zero_level: int = 1  # 0 DDP (our extension), 1 optimizer state, 2 + gradients, 3 + weights sharded
    shard_weights: bool = False
    shard_gradients: bool = False
    offload_optimizer: bool = False
    offload_master: bool = False
    offload_grads: bool = False
    offload_residual: bool = False
    gpus: int = 1  # devices of a single-process run; 0 = all
    # Expert parallelism: groups of ep_size devices split each MoE layer's experts (divides the devices and the
    # experts; parallel.make_mesh)
    ep_size: int = 1
    distributed: DistributedConfig | None = None

    def __post_init__(self):
        _check(self.zero_level in (0, 1, 2, 3), f"zero_level={self.zero_level}: use 1, 2 or 3 (0 = plain DDP)")
        _check(self.gpus >= 0, f"gpus={self.gpus}: must be >= 0 (0 = all)")
        _check(not isinstance(self.ep_size, bool) and isinstance(self.ep_size, int) and self.ep_size >= 1,
               f"ep_size={self.ep_size!r}: must be an integer >= 1 (1 = no expert parallelism)")
        _check(self.ep_size == 1 or not (self.offload_optimizer or self.offload_master or self.offload_grads),
               f"ep_size={self.ep_size} with offload_optimizer / offload_master / offload_grads is not built yet")
        _check(not self.offload_grads or self.zero_level >= 2 or self.shard_gradients,
               "offload_grads: true needs sharded gradients (zero_level >= 2 or shard_gradients: true)")


@dataclass(frozen=True)
class SFTConfig:
    run: RunConfig
    model: ModelConfig
    data: DataConfig
    lora: LoraConfig
    optim: OptimConfig
    precision: PrecisionConfig
    parallel: ParallelConfig = ParallelConfig()
    source: str | None = None  # the YAML path it came from

    def to_flat(self) -> dict:
        """Back to Surogate's flat key layout (what we save next to checkpoints)."""
        flat: dict[str, Any] = {}
        for section in (self.run, self.model, self.data, self.lora, self.optim, self.precision, self.parallel):
            for f in dataclasses.fields(section):
                v = getattr(section, f.name)
                if f.name in ("datasets", "validation_datasets"):
                    v = [_nondefault(d) for d in v]
                elif dataclasses.is_dataclass(v):
                    v = dataclasses.asdict(v)
                elif isinstance(v, tuple):
                    v = list(v)
                flat[f.name] = v
        return flat


def _nondefault(d: DatasetConfig) -> dict:
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d)
            if getattr(d, f.name) != f.default or f.name == "path"}


SECTIONS = {
    "run": RunConfig, "model": ModelConfig, "data": DataConfig,
    "lora": LoraConfig, "optim": OptimConfig, "precision": PrecisionConfig, "parallel": ParallelConfig,
}
KEY_SECTION = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
ALIASES = {"torch_dtype": "model_dtype"}

# Surogate keys we recognize but whose feature is another issue's work.
NOT_YET = frozenset(
    """use_fused_rope adapter_path adapter_init_mode
    offload_saved_tensors offload_quants persistent_quants cpu_training
    use_zero_copy use_write_combined parallelism sequence_chunks
    long_context lmhead_chunks auto_lmhead_chunks lmhead_drop_ignored_rows attn_bwd_chunks
    distillation auto_lr_reduction early_stop epoch_adjustment max_model_len rope_scaling
    train_vision""".split()
)
# Surogate keys that are accepted and have no effect here (documented as inert or GPU-graph knobs).
INERT = frozenset(
    """apply_recommended_values use_cuda_graphs padding_free log_gpu_util debug_time_breakdown
    debug_memory_breakdown log_file""".split()
)


# ---------------------------------------------------------------------------------------------
# Loading


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        return isinstance(value, (list, tuple)) and all(_type_ok(v, item) for v in value)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return True


def _coerce(cls, key: str, value: Any, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    tp = hints[key]
    if typing.get_origin(tp) is tuple and isinstance(value, str):
        value = [value]  # lora_target_modules: all
    if key in ("datasets", "validation_datasets"):
        return _datasets(value, key)
    if key == "distributed":
        return _distributed(value)
    if isinstance(value, str) and _type_ok(1.0, tp) and not _type_ok("", tp):
        try:  # PyYAML (YAML 1.1) reads 2e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if not _type_ok(value, tp):
        raise ConfigError(f"{where}{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if isinstance(value, int) and not isinstance(value, bool) and float in typing.get_args(tp) + (tp,):
        value = float(value)
    if typing.get_origin(tp) is tuple:
        value = tuple(value)
    if key in PATH_KEYS.get(cls, ()) and isinstance(value, str):
        value = _expand_path(f"{where}{key}", value, hub_ok=key == "model")
    return value


# Path-valued keys: `~` and $VAR / ${VAR} are expanded at load, so every consumer sees the real path.
PATH_KEYS = {RunConfig: ("output_dir", "checkpoint_dir", "exact_match_file"), ModelConfig: ("model",),
             DatasetConfig: ("path",), DistributedConfig: ("worker_output_dir",)}
LOCAL_PREFIXES = ("~", "$", "/", "./", "../")  # a `model:` value starting so is a path, not a hub id or builtin:
_ENV_VAR = re.compile(r"\$(\w+|\{([^}]*)\})", re.ASCII)  # what os.path.expandvars substitutes


def _expand_path(key: str, value: str, *, hub_ok: bool = False) -> str:
    """`value` with ~ and environment variables expanded; empty paths and unset variables are errors.
    hub_ok: only values that look like local paths are expanded (hub ids and builtin: pass through)."""
    if not value.strip():
        name = key.rsplit(".", 1)[-1]
        hint = ("an HF model directory, hub id or builtin:NAME" if name == "model" else "name a path, or remove the key"
                if name in ("checkpoint_dir", "exact_match_file", "worker_output_dir") else "name a path")
        raise ConfigError(f"{key}: must not be empty ({hint})")
    if hub_ok and not value.startswith(LOCAL_PREFIXES):
        return value
    for m in _ENV_VAR.finditer(value):
        name = m.group(2) if m.group(2) is not None else m.group(1)
        if name not in os.environ:
            raise ConfigError(f"{key}={value!r}: environment variable ${name} is not set "
                              "(set it, or write the path out)")
    out = os.path.expanduser(os.path.expandvars(value))
    if out.startswith("~"):
        raise ConfigError(f"{key}={value!r}: cannot expand {out.split('/')[0]!r} (no such user)")
    if not out.strip():
        raise ConfigError(f"{key}={value!r}: is empty once its environment variables are expanded")
    return out


def _type_name(tp) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _datasets(value: Any, key: str) -> tuple[DatasetConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of dataset entries, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(DatasetConfig)}
    out = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]."
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{key}[{i}]: expected a mapping with at least 'path', got {entry!r}")
        for k in entry:
            if k not in known:
                raise ConfigError(f"{where}{k}: unknown dataset key{_suggest(k, known)}")
        if "path" not in entry:
            raise ConfigError(f"{key}[{i}]: 'path' is required")
        kwargs = {k: _coerce(DatasetConfig, k, v, where) for k, v in entry.items()}
        try:
            out.append(DatasetConfig(**kwargs))
        except ConfigError as e:  # name the entry: datasets[] -> datasets[i]
            raise ConfigError(str(e).replace("datasets[].", where, 1)) from None
    return tuple(out)


def _distributed(value: Any) -> DistributedConfig | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"distributed: expected a mapping (ray_address, num_nodes, gpus_per_node, "
                          f"worker_output_dir), got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(DistributedConfig)}
    for k in value:
        if k not in known:
            raise ConfigError(f"distributed.{k}: unknown key{_suggest(k, known)}")
    return DistributedConfig(**{k: _coerce(DistributedConfig, k, v, "distributed.") for k, v in value.items()})


def _suggest(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` from the command line; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def config_from_dict(raw: dict, *, defaults: dict | None = None, source: str | None = None) -> SFTConfig:
    """Flat Surogate-style dict -> SFTConfig. `defaults` lets an entry point change defaults
    (e.g. pretraining: from_scratch true, lora false, loss_scale all)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping of keys to values, got {type(raw).__name__}")
    for alias, key in ALIASES.items():
        _check(alias not in raw or key not in raw, f"{alias} and {key}: the same key under two names; keep one")
    merged = {**(defaults or {}), **raw}
    per_section: dict[str, dict] = {s: {} for s in SECTIONS}
    valid = set(KEY_SECTION) | set(ALIASES) | NOT_YET | INERT
    for key, value in merged.items():
        if not isinstance(key, str):
            raise ConfigError(f"config key {key!r} is not a string")
        key = ALIASES.get(key, key)
        if key in NOT_YET:
            if key in raw and value not in (None, False, 0, "", [], {}):
                raise ConfigError(f"{key}: not supported yet (remove it, or set it to its default)")
            continue
        if key in INERT:
            continue
        if key not in KEY_SECTION:
            raise ConfigError(f"{key}: unknown config key{_suggest(key, valid)}")
        cls = SECTIONS[KEY_SECTION[key]]
        per_section[KEY_SECTION[key]][key] = _coerce(cls, key, value, "")
    try:
        sections = {name: SECTIONS[name](**kw) for name, kw in per_section.items()}
    except TypeError as e:  # a dataclass refused its arguments
        raise ConfigError(str(e)) from None
    if sections["data"].validation_datasets and "validation_split_ratio" not in merged:
        sections["data"] = dataclasses.replace(sections["data"], validation_split_ratio=0.0)
    if sections["run"].exact_match_file is not None:
        _check_exact_match_file(sections["run"].exact_match_file, sections["run"].exact_match_samples)
    return SFTConfig(**sections, source=source)


def _check_exact_match_file(path: str, samples: int) -> None:
    """The rows run.exact_match_report reads after training: every line JSON, the first `samples` of them chat
    rows ending with the assistant's answer (generate.split_row's shape)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"exact_match_file={path}: file not found")
    try:
        lines = [(n, line) for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"exact_match_file={path}: cannot be read ({e})") from None
    _check(bool(lines), f"exact_match_file={path}: has no rows (one JSON chat row per line)")
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"exact_match_file={path}: line {n} is not valid JSON ({e.msg})") from None
        if i >= samples:
            continue
        messages = row.get("messages") if isinstance(row, dict) else None
        last = messages[-1] if isinstance(messages, list) and len(messages) >= 2 else None
        _check(isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str),
               f"exact_match_file={path}: line {n}: expected {{\"messages\": [...]}} with a prompt and a last "
               "assistant message with string content")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in any mapping (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<:` merges are meant to be overridden by explicit keys
                key, line = self.construct_object(key_node, deep=False), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if first is not None:
                    lines = f"lines {first} and {line}" if first != line else f"line {line}"
                    raise ConfigError(f"key {key!r} is given twice ({lines}); keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] = (), *, defaults: dict | None = None) -> SFTConfig:
    """Reads a YAML file, applies `key=value` overrides (they replace file keys), validates everything."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{p}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of keys to values")
    for item in overrides:
        key, value = parse_override(item)
        for k in [k for k in raw if k != key and ALIASES.get(k, k) == ALIASES.get(key, key)]:
            del raw[k]  # an override of torch_dtype replaces the file's model_dtype (and the reverse)
        raw[key] = value
    return config_from_dict(raw, defaults=defaults, source=str(p))


__all__ = [
    "PROJECTIONS", "ConfigError", "DataConfig", "DatasetConfig", "DistributedConfig", "LoraConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig", "SFTConfig", "config_from_dict", "load_config",
    "parse_override",
]
