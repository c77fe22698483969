"""The shared llama-like decoder behind Llama 3.x, Qwen2.5 and Qwen3 dense models.

One pure Flax Linen module family; the variants (llama.py, qwen2.py, qwen3.py) only translate an HF
config into a `DecoderConfig` and say which features are on:
  - grouped-query attention with HF's non-interleaved ("rotate half") RoPE, incl. `llama3` scaled
    frequencies (Llama 3.1 paper / HF `_compute_llama3_parameters`);
  - optional q/k/v biases (Qwen2.5) and per-head q/k RMSNorm before RoPE (Qwen3);
  - SwiGLU MLP, pre-norm residual blocks, tied or untied LM head.
Layers are stacked with `nn.scan` (params get a leading `layers` axis; `unroll_layers` unrolls its loop) and can be
rematerialized; parameters are plain arrays (parallel.py shards them by shape). Norms call `surogate_jax.ops.rms_norm`
(our CUDA kernel on GPU, its pure-JAX reference elsewhere). Attention goes through
`surogate_jax.ops.attention`: cuDNN flash attention on GPU for bf16/fp16, XLA otherwise.

Packed rows: `segment_ids [B, T]` (contiguous runs of equal ids = one document) restrict attention to the
token's own document, and `positions [B, T]` restart per document, so a packed row computes exactly what each
document would alone. With `max_segments` set, cuDNN computes only each document's own blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.names import EXPERT_PROJECTIONS, PROJECTIONS, REMAT_POLICIES
from surogate_jax.ops import add_rms_norm, fp8_formats, grouped_matmul, rms_norm, rope_qk, swiglu, swiglu_lora
from surogate_jax.ops import attention as attention_op
from surogate_jax.ops._sharding import EXPERT_AXIS, data_axes, expert_parallel, on_shards
from surogate_jax.precision import recipe as recipe_lib
from surogate_jax.precision.recipe import QuantRecipe
from surogate_jax.qlora import base as qlora_base
from surogate_jax.qlora.base import QloraSpec

from . import moe

Dtype = Any

# "offload_residual": "full" with each layer's input (the residual stream) kept in pinned host memory.
# The fused kernels the model runs by default on GPU; the other ops use XLA's own fusion of their
# pure-JAX reference (same math). Measured on an H100 inside the jitted LoRA train step
# (benchmarks/kernels_in_model.py): once the
# FFI handlers declare themselves CUDA-graph safe, rope (q/k-norm + RoPE) and the two norms are at
# least as fast as XLA's fusion (0.6B: 314.8 / 317.7 ms per step vs 318.2 ms). A plain swiglu
# kernel is 3% slower there: handed a custom call, XLA must write gate, up and their gradients'
# sum, which it otherwise fuses with the LoRA adds, the remat's silu(g)*u and both gradients.
# swiglu_lora takes the frozen GEMM output and the LoRA factors instead and forms the LoRA
# products in-kernel (0.6B: 311.4 vs 312.6 ms with full recompute, 295.5 vs 295.7 without), so
# under LoRA on gate_proj + up_proj (no recipe) it is the
# default; full fine-tuning keeps SwiGLU on XLA's fusion ("swiglu" opts in the plain kernel).
# `DecoderConfig.kernels` overrides.
# swiglu_lora takes gate and up as one GEMM output (the two frozen kernels concatenated each step,
# as XLA's dot merger does for small dots) or as two. At Qwen3-8B (2 x 100 MB) the concatenation
# made the step 2.4% slower than XLA's two GEMMs (1705 vs 1666 ms), so above this size the MLP
# runs two GEMMs and hands the op both outputs (1.7B-8B: level with or up to 0.8% faster than
# XLA's fusion).
PACK_GATE_UP_MAX_BYTES = 16 << 20
MODEL_KERNELS = ("rope", "rms_norm", "add_rms_norm", "swiglu", "swiglu_lora")
DEFAULT_KERNELS: tuple[str, ...] = ("rope", "rms_norm", "add_rms_norm", "swiglu_lora")



@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """`llama3` frequency scaling (the only scaled RoPE type we implement)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the named projections: y = x W + (alpha / rank) * (dropout(x) A) B.

    A [in..., rank] starts kaiming-uniform(a=sqrt(5)) over fan-in, i.e. U(+-1/sqrt(fan_in)), and B
    [rank, out...] at zero (LoRA paper / PEFT's default), so training starts from the base model.
    Adapters live in the `lora` variable collection (in `dtype`, fp32 masters by default); dropout
    runs only when the caller passes a "dropout" rng."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    # MoE: the router is trained too; its kernel then lives in the `lora` collection (mlp/gate/kernel, in `dtype`)
    train_router: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything that shapes the math of the decoder; nothing about training."""

    model_type: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    # Mixture-of-experts feed-forward when num_experts > 0 (models/moe.py: top-k of num_experts experts of
    # moe_intermediate_size, drop-free, as Qwen3-MoE) in the layers `sparse_layer` picks, the dense MLP of
    # intermediate_size in the others; not yet with a precision recipe.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Weights of the MoE router losses that train.train_loss adds (models/moe.py): the load-balancing aux loss (HF's
    # router_aux_loss_coef, so it round-trips through config.json) and the z-loss.
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Numerics and execution (not part of the HF math).
    dtype: Dtype = jnp.float32  # activations / matmul inputs
    param_dtype: Dtype = jnp.float32
    attention_impl: str = "auto"  # "auto" | "cudnn" | "xla"
    # A bound on the segments (documents, a padding run) of any packed row: lets cuDNN skip the blocks between
    # documents (ops/attention.py); None: the dense same-segment mask. The data loader guarantees it.
    max_segments: int | None = None
    remat_policy: str = "none"  # one of REMAT_POLICIES
    # The layers as straight-line code rather than a loop (same params, stacked). A loop writes each layer's saved
    # activations into stacked buffers and copies them back out for the backward (and slices every weight); unrolled
    # they stay where they were made. H100, Qwen3-0.6B LoRA step: 219 -> 161 ms, copies 34 -> 4 ms; it costs 2x the
    # compile time and, with recomputation, more memory (XLA's schedule is free to run recomputations early).
    unroll_layers: bool = False
    kernels: tuple[str, ...] = DEFAULT_KERNELS  # ops of MODEL_KERNELS that run our CUDA kernels on GPU
    lora: LoraSpec | None = None
    # QLoRA: the seven projections' frozen base weights stored quantized (surogate_jax/qlora/); needs `lora`.
    qlora: QloraSpec | None = None
    # qlora_offload_experts: the quantized experts arrive in pinned host memory and each MoE layer copies its own
    # to the device where it uses them (forward, and the backward's recomputation: needs remat "full" in a loop);
    # without qlora it does nothing (a config with qlora replaced by None stays valid)
    offload_experts: bool = False
    # qlora_selective_expert_dequant: each MoE layer dequantizes only the experts that received tokens (forward and
    # backward; qlora.base.frozen_grouped); without qlora it does nothing
    selective_expert_dequant: bool = False
    # Precision recipe of the seven projections (precision/recipe.py); None = plain model dtype (bf16).
    recipe: QuantRecipe | None = None
    # The device mesh the ops split rows over (ops/_sharding.py); set when the train/eval step is built.
    mesh: Mesh | AbstractMesh | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.attention_impl not in attention_op.IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}: use one of {attention_op.IMPLS}")
        if self.max_segments is not None and (isinstance(self.max_segments, bool) or self.max_segments < 1):
            raise ValueError(f"max_segments={self.max_segments!r}: a positive int or None")
        if not set(self.kernels) <= set(MODEL_KERNELS):
            raise ValueError(f"kernels={self.kernels!r}: choose among {MODEL_KERNELS}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}: use one of {REMAT_POLICIES}")
        if self.decoder_sparse_step < 1 or not all(0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1 and mlp_only_layers="
                             f"{list(self.mlp_only_layers)} layer indices in [0, {self.num_layers})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                 f"{self.num_experts}] and moe_intermediate_size={self.moe_intermediate_size} >= 1")
        elif self.lora is not None and self.lora.train_router:
            raise ValueError("train_router applies to mixture-of-experts models (num_experts > 0)")
        if self.recipe is not None:
            self.recipe.check_model(self)
        if self.qlora is not None and self.recipe is not None and self.recipe.skips:
            raise ValueError("skip_quant_first_layers / skip_quant_last_layers keep layers' exact weights, which a "
                             f"QLoRA base ({self.qlora.format}) does not have; leave them at 0")

    def sparse_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the mixture of experts (transformers' Qwen3-MoE rule)."""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> int:
        """How many layers are mixture-of-experts (0: a dense model, or every layer in mlp_only_layers)."""
        return sum(self.sparse_layer(i) for i in range(self.num_layers))

    def layer_stacks(self) -> tuple[tuple[str, int, int, bool], ...]:
        """(module name, first layer, layers, sparse) per run of consecutive layers of one kind: each run is one
        nn.scan stack, named "layers" from layer 0 and "layers_<first>" after it (surogate_jax.names)."""
        runs = []
        for i in range(self.num_layers):
            if runs and runs[-1][3] == self.sparse_layer(i):
                name, start, n, sparse = runs[-1]
                runs[-1] = (name, start, n + 1, sparse)
            else:
                runs.append(("layers" if i == 0 else f"layers_{i}", i, 1, self.sparse_layer(i)))
        return tuple(runs)

    def impl(self, op: str) -> str | None:
        """impl argument for op: None (kernel on GPU, reference elsewhere) or "ref" (XLA fusion)."""
        return None if op in self.kernels else "ref"

    def replace(self, **kw) -> DecoderConfig:
        return dataclasses.replace(self, **kw)


def expert_shape(cfg: DecoderConfig, name: str) -> tuple[int, int, int]:
    """An MoE projection's stacked experts [E, out, in] in HF's layout (a QLoRA base quantizes them as one
    [E * out, in] weight)."""
    D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return (E, D, I) if name == "down_proj" else (E, I, D)


def projection_shape(cfg: DecoderConfig, name: str) -> tuple[int, int]:
    """A projection's weight shape in HF's layout [out, in] (what a QLoRA base quantizes)."""
    D, F, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}
    return shapes[name]


# ----------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] in float64 numpy (HF formula, llama3 scaling if set)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: DecoderConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, head_dim] in float32 (each frequency repeated for both halves)."""
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    ang_BTF = positions_BT.astype(jnp.float32)[..., None] * inv
    ang_BTK = jnp.concatenate([ang_BTF, ang_BTF], axis=-1)
    return jnp.cos(ang_BTK), jnp.sin(ang_BTK)


def apply_rope_qk(
    q_BTHK: jax.Array, k_BTGK: jax.Array, cos_BTK: jax.Array, sin_BTK: jax.Array,
    norm_wq_K: jax.Array | None = None, norm_wk_K: jax.Array | None = None, eps: float = 1e-6,
    impl: str | None = None, mesh: Mesh | AbstractMesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """HF rotate-half RoPE of q and k (after a per-head RMSNorm with weights norm_wq_K /
    norm_wk_K, if given), computed in float32 and rounded once to their dtype. Runs
    `surogate_jax.ops.rope_qk`: one fused CUDA launch for both on GPU (each way), the pure-JAX
    reference elsewhere; per data shard of `mesh`. cos/sin are rope_cos_sin's [B, T, K] tables."""
    return rope_qk(q_BTHK, k_BTGK, table=(cos_BTK, sin_BTK), norm_wq=norm_wq_K, norm_wk=norm_wk_K, eps=eps, impl=impl,
                   mesh=mesh)


class NormScale(nn.Module):
    """The weight `scale` [dim] of Qwen3's per-head q/k RMSNorm (HF `q_norm.weight` /
    `k_norm.weight`); the norm itself runs fused with RoPE (apply_rope_qk)."""

    dim: int
    param_dtype: Dtype

    @nn.compact
    def __call__(self):
        return _param(self, "scale", nn.initializers.ones, (self.dim,), self.param_dtype)


# ----------------------------------------------------------------------------------------------
# Layers


def _param(mod: nn.Module, name: str, init, shape, dtype):
    return mod.param(name, init, shape, dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned scale (HF `weight`)."""

    eps: float
    dtype: Dtype
    param_dtype: Dtype
    impl: str | None = None  # see DecoderConfig.impl
    mesh: Mesh | AbstractMesh | None = None  # see DecoderConfig.mesh

    @nn.compact
    def __call__(self, x):
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype
        )
        return rms_norm(x.astype(self.dtype), scale.astype(self.dtype), self.eps, impl=self.impl, mesh=self.mesh)


class AddRMSNorm(RMSNorm):
    """`s = x + residual; h = RMSNorm(s)` as one fused op; returns (h, s). Same `scale` param
    (HF `weight`) and numerics as RMSNorm applied to the rounded sum."""

    @nn.compact
    def __call__(self, x, residual):
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype
        )
        return add_rms_norm(x.astype(self.dtype), residual.astype(self.dtype), scale.astype(self.dtype), self.eps,
                            impl=self.impl, mesh=self.mesh)


class Linear(nn.Module):
    """x[..., in] @ kernel[in, *out] (+ bias[*out])."""

    out_shape: tuple[int, ...]
    cfg: DecoderConfig
    use_bias: bool = False
    in_dims: int = 1  # how many trailing dims of x are contracted

    @nn.compact
    def __call__(self, x, layer=None, *, lora_parts: bool = False, lora_x=None):
        """layer: this decoder layer's index (traced; the recipe's skip_quant_* layers need it).

        lora_parts: return (kernel, xa, lora_b) in cfg.dtype instead of y, for an op that forms
        `x @ kernel + scale * (xa @ lora_b)` itself (the MLP's `swiglu_lora`); needs LoRA on this
        projection, no recipe, no bias. Same parameters either way.
        lora_x: the LoRA branch's input when it is a separate array of x's values (swiglu_lora's
        split output), so the two branches' input gradients are not summed here."""
        cfg = self.cfg
        in_shape = x.shape[x.ndim - self.in_dims :]
        init = nn.initializers.normal(cfg.initializer_range)
        contract = (tuple(range(x.ndim - self.in_dims, x.ndim)), tuple(range(self.in_dims)))
        if cfg.qlora is not None and self.name in PROJECTIONS:  # a quantized base replaces the kernel's GEMM
            if lora_parts:
                raise ValueError(f"{self.name}: lora_parts needs a plain kernel, not a QLoRA base")
            y = self._qlora_matmul(x, in_shape, layer)
        elif cfg.recipe is not None and self.name in PROJECTIONS and self.has_variable("params", recipe_lib.KERNEL_NK):
            # fp8-hybrid's frozen cache in the [out, in] layout its forward GEMM reads (recipe.cache_frozen_weights)
            if lora_parts:
                raise ValueError(f"{self.name}: lora_parts needs a plain kernel, not a recipe's cache")
            wq = self.get_variable("params", recipe_lib.KERNEL_NK)
            y = self._recipe_matmul(x, wq, layer, kernel_nk_out=tuple(self.out_shape))
        else:
            kernel = _param(self, "kernel", init, (*in_shape, *self.out_shape), cfg.param_dtype)
            if lora_parts:
                if cfg.recipe is not None or self.use_bias or cfg.lora is None or self.name not in cfg.lora.targets:
                    raise ValueError(f"{self.name}: lora_parts needs LoRA on it, no recipe and no bias")
                xa, b = self._lora_factors(x, in_shape, contract)
                return kernel.astype(cfg.dtype), xa, b
            if cfg.recipe is not None and self.name in PROJECTIONS:
                y = self._recipe_matmul(x, kernel, layer)
            else:
                y = jax.lax.dot_general(x.astype(cfg.dtype), kernel.astype(cfg.dtype), (contract, ((), ())))
        if self.use_bias:
            bias = _param(self, "bias", nn.initializers.zeros, self.out_shape, cfg.param_dtype)
            y = y + bias.astype(cfg.dtype)
        if cfg.lora is not None and self.name in cfg.lora.targets:
            y = y + self._lora(x if lora_x is None else lora_x, in_shape, contract)
        return y

    def _recipe_matmul(self, x, kernel, layer, kernel_scale=None, kernel_nk_out=None):
        """The projection's GEMM under cfg.recipe: fetches its fp8 state ("fp8" collection), the
        frozen cache's kernel_scale and an rng for NVFP4 stochastic rounding, then calls the pure
        recipe_lib.linear."""
        cfg, r = self.cfg, self.cfg.recipe
        state = None
        if r.has_state:
            state = self.variable(recipe_lib.FP8_COLLECTION, "state", fp8_formats.init_matmul_state,
                                  r.amax_history).value
        key = None
        if r.name == "nvfp4":  # only the backward uses it; eval without the rng gets a fixed key
            key = self.make_rng(recipe_lib.QUANT_RNG) if self.has_rng(recipe_lib.QUANT_RNG) else jax.random.key(0)
        scale = kernel_scale
        if scale is None and self.has_variable("params", recipe_lib.KERNEL_SCALE):
            scale = self.get_variable("params", recipe_lib.KERNEL_SCALE)
        return recipe_lib.linear(r, x, kernel, in_dims=self.in_dims, dtype=cfg.dtype, fp8_state=state,
                                 kernel_scale=scale, key=key, layer=layer, num_layers=cfg.num_layers, mesh=cfg.mesh,
                                 kernel_nk_out=kernel_nk_out)

    def _qlora_matmul(self, x, in_shape, layer):
        """x @ W with W the quantized frozen base (HF layout [out, in], qlora.base); a fresh init quantizes a
        normal(initializer_range) weight. Under a recipe the dequantized W goes through the recipe's GEMM: fp8-hybrid
        and nvfp4 first quantize it as their frozen cache does (train.prepare_frozen), here per micro-batch and layer
        (fp8-hybrid: straight from the base into E4M3 in the [out, in] layout its forward GEMM reads)."""
        cfg, spec = self.cfg, self.cfg.qlora
        shape = (math.prod(self.out_shape), math.prod(in_shape))
        # One key for all of the weight's parts (each param's own rng would quantize a different weight); Flax
        # also calls the init of an existing param, abstractly, to check its shape: no key is drawn then.
        key = self.make_rng("params") if self.is_initializing() else jax.random.key(0)

        def init(_, name):
            w0 = nn.initializers.normal(cfg.initializer_range)(key, shape, jnp.float32)
            return qlora_base.quantize(spec, w0)[name]

        qp = {k: self.param(k, init, k) for k in qlora_base.param_names(spec)}
        if cfg.recipe is None:
            return qlora_base.frozen_matmul(spec, x, qp, in_dims=self.in_dims, out_shape=self.out_shape,
                                            dtype=cfg.dtype, mesh=cfg.mesh)
        if cfg.recipe.name == "fp8-hybrid":
            wq, scale = qlora_base.frozen_fp8_weight(spec, qp, shape, cfg.dtype, mesh=cfg.mesh)
            return self._recipe_matmul(x, wq, layer, kernel_scale=scale, kernel_nk_out=tuple(self.out_shape))
        kernel = qlora_base.base_kernel(spec, qp, in_shape, self.out_shape, cfg.dtype, mesh=cfg.mesh)
        if not cfg.recipe.quantizes:
            return self._recipe_matmul(x, kernel, layer)
        wq, scale = recipe_lib.cache_kernel(cfg.recipe, self.name, kernel[None], 1)
        return self._recipe_matmul(x, wq[0], layer, kernel_scale=scale[0])

    def _lora(self, x, in_shape, contract):
        xa, b = self._lora_factors(x, in_shape, contract)
        out = jax.lax.dot_general(xa, b, (((xa.ndim - 1,), (0,)), ((), ())))
        return (out * self.cfg.lora.scale).astype(self.cfg.dtype)

    def _lora_factors(self, x, in_shape, contract):
        """(dropout(x) @ lora_a, lora_b), both in cfg.dtype: the update is scale * (xa @ lora_b)."""
        cfg, spec = self.cfg, self.cfg.lora
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a_init = nn.initializers.uniform(2 * bound)  # U[0, 2b) shifted below to U[-b, b)
        a = self.variable(
            "lora", "lora_a",
            lambda: a_init(self.make_rng("lora"), (*in_shape, spec.rank), spec.dtype) - bound,
        ).value
        b = self.variable(
            "lora", "lora_b",
            lambda: nn.initializers.zeros(self.make_rng("lora"), (spec.rank, *self.out_shape), spec.dtype),
        ).value
        if spec.dropout > 0 and self.has_rng("dropout"):
            x = nn.Dropout(spec.dropout, deterministic=False)(x, rng=self.make_rng("dropout"))
        xa = jax.lax.dot_general(x.astype(cfg.dtype), a.astype(cfg.dtype), (contract, ((), ())))
        return xa, b.astype(cfg.dtype)


class Attention(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x_BTD, cos_BTK, sin_BTK, segs, layer=None):
        cfg = self.cfg
        H, KV, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = Linear((H, K), cfg, cfg.qkv_bias, name="q_proj")(x_BTD, layer)
        k = Linear((KV, K), cfg, cfg.qkv_bias, name="k_proj")(x_BTD, layer)
        v = Linear((KV, K), cfg, cfg.qkv_bias, name="v_proj")(x_BTD, layer)
        wq = wk = None
        if cfg.qk_norm:  # per-head RMSNorm, fused with RoPE
            wq = NormScale(K, cfg.param_dtype, name="q_norm")().astype(cfg.dtype)
            wk = NormScale(K, cfg.param_dtype, name="k_norm")().astype(cfg.dtype)
        q, k = apply_rope_qk(q.astype(cfg.dtype), k.astype(cfg.dtype), cos_BTK, sin_BTK, wq, wk, cfg.rms_norm_eps,
                             cfg.impl("rope"), cfg.mesh)
        o = attention_op.attention(q, k, v, segs, impl=cfg.attention_impl, mesh=cfg.mesh)
        return Linear((cfg.hidden_size,), cfg, in_dims=2, name="o_proj")(o, layer)


class MLP(nn.Module):
    cfg: DecoderConfig

    def _fused_lora(self) -> bool:
        """swiglu_lora applies: its kernel is on and LoRA (without a recipe) covers gate and up."""
        cfg = self.cfg
        return ("swiglu_lora" in cfg.kernels and cfg.recipe is None and cfg.qlora is None and cfg.lora is not None
                and {"gate_proj", "up_proj"} <= set(cfg.lora.targets))

    @nn.compact
    def __call__(self, x_BTD, layer=None):
        cfg = self.cfg
        F = cfg.intermediate_size
        gate_proj = Linear((F,), cfg, name="gate_proj")
        up_proj = Linear((F,), cfg, name="up_proj")
        if self._fused_lora():
            # The frozen GEMM(s) here; the LoRA products are formed in the kernel.
            wg, xa_g, bg = gate_proj(x_BTD, layer, lora_parts=True)
            wu, xa_u, bu = up_proj(x_BTD, layer, lora_parts=True)
            x = x_BTD.astype(cfg.dtype)
            if 2 * wg.size * wg.dtype.itemsize <= PACK_GATE_UP_MAX_BYTES:
                base = x @ jnp.concatenate([wg, wu], axis=-1)  # one GEMM, [B, T, 2F]
            else:
                # Two GEMMs. The barrier orders up's after gate's: else XLA's dot merger may fuse
                # them into one GEMM over concatenated kernels and slice its output into two
                # copies (seen at 0.6B: 321.6 ms per step against 310.4 packed).
                gate = x @ wg
                gate, wu = jax.lax.optimization_barrier((gate, wu))
                base = (gate, x @ wu)
            split = "down_proj" in cfg.lora.targets  # h feeds the down GEMM and its LoRA
            h = swiglu_lora(base, jnp.concatenate([xa_g, xa_u], axis=-1), jnp.stack([bg, bu]),
                            cfg.lora.scale, impl=cfg.impl("swiglu_lora"), split_output=split, mesh=cfg.mesh)
            if split:
                h, h_lora = h
                return Linear((cfg.hidden_size,), cfg, name="down_proj")(h, layer, lora_x=h_lora)
        else:
            gate = gate_proj(x_BTD, layer)
            up = up_proj(x_BTD, layer)
            # silu(gate) * up, fp32 math, one rounding
            h = swiglu(gate.astype(cfg.dtype), up.astype(cfg.dtype), impl=cfg.impl("swiglu"), mesh=cfg.mesh)
        return Linear((cfg.hidden_size,), cfg, name="down_proj")(h, layer)


ROUTER_STATS = ("counts", "probs", "z", "rows")  # moe.router_stats, in the order the per-shard block returns them


class SparseMoeMLP(nn.Module):
    """The MoE feed-forward (models/moe.py's `moe_mlp`: each token's top-k experts through grouped GEMMs), run per
    data shard: every device sorts and multiplies its own tokens. Params as HF names them: the router `gate` kernel
    [D, E]; `experts` gate_proj / up_proj [E, D, I], down_proj [E, I, D]. LoRA on gate/up/down_proj adapts every
    expert (A [E, in, r], B [E, r, out] in the `lora` collection under experts/<proj>). Returns (y, this layer's
    router statistics summed over the data shards' rows; `valid_BT` marks the rows that count). With an "expert" mesh
    axis (ep_size) each device of it holds E / ep experts and their adapters (moe.moe_mlp's ep_axis)."""

    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x_BTD, valid_BT=None):
        cfg = self.cfg
        D, k = cfg.hidden_size, cfg.num_experts_per_tok
        router_DE = _Router(cfg, name="gate")()
        experts, lora = _Experts(cfg, name="experts")()
        if cfg.qlora is None:
            experts = tuple(w if isinstance(w, dict) else w.astype(cfg.dtype) for w in experts)
        elif cfg.offload_experts:  # this layer's quantized experts, from pinned host memory
            experts = jax.device_put(experts, jax.memory.Space.Device)
        lora = {p: tuple(w.astype(cfg.dtype) for w in ab) for p, ab in lora.items()}
        lora_leaves, lora_def = jax.tree.flatten(lora)
        base_leaves, base_def = jax.tree.flatten(experts)  # three arrays, or three dicts of quantized parts
        scale = cfg.lora.scale if cfg.lora is not None else 0.0
        x_TD = x_BTD.reshape(-1, D).astype(cfg.dtype)
        m_T = jnp.ones(x_TD.shape[:1], jnp.float32) if valid_BT is None else valid_BT.reshape(-1).astype(jnp.float32)

        ep = expert_parallel(cfg.mesh)
        local = cfg.num_experts // max(ep, 1)  # the experts each device of an expert group holds
        if ep > 1 and cfg.qlora is not None and not all(
                qlora_base.splits_by_expert(cfg.qlora.experts(), expert_shape(cfg, p)) for p in EXPERT_PROJECTIONS):
            raise ValueError(f"expert parallelism over this QLoRA base ({cfg.qlora.describe()}): its blocks straddle "
                             "two experts, so the experts cannot be split")
        # LoRA dropout: one key per layer, folded with the shard's index inside (every shard its own masks)
        shards = math.prod(dict(cfg.mesh.shape)[a] for a in data_axes(cfg.mesh)) if cfg.mesh is not None else 1
        drop = cfg.lora is not None and cfg.lora.dropout > 0 and bool(lora) and self.has_rng("dropout")
        key = self.make_rng("dropout") if drop else jnp.zeros((2,), jnp.uint32)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # on_shards takes arrays: the key's raw words
            key = jax.random.key_data(key)

        fp8 = cfg.recipe is not None and cfg.recipe.name == "fp8-hybrid"  # recipe.check_model refuses the others
        fp8_impl = "ref" if fp8 and cfg.recipe.fp8_impl == "ref" else None

        def block(x_TD, router_ED, m_T, key, shard, *leaves):
            base = jax.tree.unflatten(base_def, leaves[:len(base_leaves)])
            if cfg.qlora is not None:  # each projection dequantized inside its grouped GEMM, forward and backward
                base = tuple(qlora_base.frozen_grouped(cfg.qlora.experts(), q, shape=(local, *expert_shape(cfg, p)[1:]),
                                                       dtype=cfg.dtype, fp8=fp8, fp8_impl=fp8_impl,
                                                       selective=cfg.selective_expert_dequant)
                             for p, q in zip(EXPERT_PROJECTIONS, base, strict=True))
            elif fp8:  # the cached frozen E4M3 experts, or trained ones quantized per call
                base = tuple(_fp8_experts(w, fp8_impl) for w in base)
            y_TD, st = moe.moe_mlp(x_TD, router_ED, *base, k=k, norm_topk_prob=cfg.norm_topk_prob, mask_T=m_T,
                                   swiglu_impl=cfg.impl("swiglu"),
                                   lora=jax.tree.unflatten(lora_def, leaves[len(base_leaves):]), lora_scale=scale,
                                   lora_dropout=(cfg.lora.dropout, jax.random.fold_in(jax.random.wrap_key_data(key),
                                                                                      shard[0])) if drop else None,
                                   ep_axis=EXPERT_AXIS if ep > 1 else None, ep_experts=local)
            return y_TD, *(st[n] for n in ROUTER_STATS)

        rest = (*base_leaves, *lora_leaves)
        y_TD, *stats = on_shards(block, x_TD, router_DE.T.astype(cfg.dtype), m_T, key,
                                 jnp.arange(shards, dtype=jnp.int32), *rest, mesh=cfg.mesh,
                                 batched=(True, False, True, False, True) + (False,) * len(rest),
                                 out_batched=(True, False, False, False, False),
                                 out_summed=(False, True, True, True, True),
                                 split_experts=(False,) * 5 + tuple(ep > 1 and jnp.ndim(a) > 0 for a in rest))
        return y_TD.reshape(x_BTD.shape), dict(zip(ROUTER_STATS, stats, strict=True))


def _fp8_experts(w, impl):
    """An expert stack's GEMM under fp8-hybrid as moe_mlp's callable (x, group_sizes) -> y: the frozen cache
    {kernel_nk, kernel_scale} or a plain [E, in, out] stack quantized per call (ops.grouped_matmul)."""
    if isinstance(w, dict):
        return jax.tree_util.Partial(functools.partial(_fp8_frozen_apply, impl), w[recipe_lib.KERNEL_NK],
                                     w[recipe_lib.KERNEL_SCALE])
    return jax.tree_util.Partial(functools.partial(_fp8_trained_apply, impl), w)


def _fp8_frozen_apply(impl, wq, scale, x, group_sizes):
    return grouped_matmul.grouped_matmul_fp8_frozen(x, wq, scale, group_sizes, impl=impl)


def _fp8_trained_apply(impl, w, x, group_sizes):
    return grouped_matmul.grouped_matmul_fp8(x, w, group_sizes, impl=impl)


class _Router(nn.Module):
    """The router's kernel [D, E]: a frozen param, or under LoRA with `train_router` a trainable `lora` variable."""

    cfg: DecoderConfig

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        init = nn.initializers.normal(cfg.initializer_range)
        shape = (cfg.hidden_size, cfg.num_experts)
        if cfg.lora is not None and cfg.lora.train_router:
            return self.variable("lora", "kernel", lambda: init(self.make_rng("lora"), shape, cfg.lora.dtype)).value
        return _param(self, "kernel", init, shape, cfg.param_dtype)


class _Experts(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self):
        """((gate [E, D, I], up [E, D, I], down [E, I, D]), {proj: (A [E, in, r], B [E, r, out])} for LoRA's
        expert targets). Under QLoRA each projection is instead a dict of its quantized parts: the [E * out, in]
        weight (qlora.base.expert_weights)."""
        cfg = self.cfg
        D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        init = nn.initializers.normal(cfg.initializer_range)
        shapes = {"gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}
        if cfg.qlora is None:
            weights = tuple(self._cached(p) or _param(self, p, init, (E, *shapes[p]), cfg.param_dtype)
                            for p in EXPERT_PROJECTIONS)
        else:
            def quantized(key, p):  # a fresh init quantizes a normal(initializer_range) weight
                E_, out, inp = expert_shape(cfg, p)
                return qlora_base.quantize(cfg.qlora.experts(), init(key, (E_ * out, inp), jnp.float32))

            weights = tuple(self.param(p, quantized, p) for p in EXPERT_PROJECTIONS)
        lora = {}
        spec = cfg.lora
        for p in EXPERT_PROJECTIONS if spec is not None else ():
            if p not in spec.targets:
                continue
            fan_in, fan_out = shapes[p]
            bound = 1.0 / math.sqrt(fan_in)  # as Linear's adapters: U(+-1/sqrt(in)), B = 0

            def fresh(fan_in=fan_in, fan_out=fan_out, bound=bound):
                a = nn.initializers.uniform(2 * bound)(self.make_rng("lora"), (E, fan_in, spec.rank), spec.dtype)
                return {"lora_a": a - bound, "lora_b": jnp.zeros((E, spec.rank, fan_out), spec.dtype)}

            ab = self.variable("lora", p, fresh).value
            lora[p] = (ab["lora_a"], ab["lora_b"])
        return weights, lora

    def _cached(self, p):
        """fp8-hybrid's frozen cache of projection p ({kernel_nk, kernel_scale}: recipe.cache_experts), or None."""
        if self.is_initializing() or not self.has_variable("params", p):
            return None
        v = self.get_variable("params", p)
        return v if isinstance(v, dict) and recipe_lib.KERNEL_SCALE in v else None


class DecoderLayer(nn.Module):
    cfg: DecoderConfig
    sparse: bool = False  # the feed-forward is SparseMoeMLP (cfg.sparse_layer)

    @nn.compact
    def __call__(self, x_BTD, cos_BTK, sin_BTK, segs, valid_BT=None, layer=None):
        cfg = self.cfg
        norm = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, mesh=cfg.mesh)
        x_BTD = checkpoint_name(x_BTD, "decoder_layer_input")  # what "offload_residual" sends to host
        h = RMSNorm(**norm, impl=cfg.impl("rms_norm"), name="input_layernorm")(x_BTD)
        attn_BTD = Attention(cfg, name="self_attn")(h, cos_BTK, sin_BTK, segs, layer)
        # One kernel reads attn_out and x and writes the new x and its norm. The closing
        # `x + mlp(h)` stays a plain add: fusing it with the next layer's input_layernorm would
        # need the un-added MLP output carried across the nn.scan boundary, i.e. two [B, T, D]
        # carries per layer that remat keeps, for saving one element-wise pass.
        h, x_BTD = AddRMSNorm(**norm, impl=cfg.impl("add_rms_norm"), name="post_attention_layernorm")(attn_BTD, x_BTD)
        stats = None
        if self.sparse:
            mlp, stats = SparseMoeMLP(cfg, name="mlp")(h, valid_BT)
        else:
            mlp = MLP(cfg, name="mlp")(h, layer)
        return x_BTD + mlp, stats


def _remat_policy(name: str):
    return {
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.dots_saveable,
        "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "offload_residual": jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["decoder_layer_input"],
            offload_src="device", offload_dst="pinned_host"),
    }[name]


class Decoder(nn.Module):
    """Causal LM: int32 tokens [B, T] -> logits [B, T, vocab] (or final hidden states)."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, input_ids, positions=None, segment_ids=None, *, return_hidden: bool = False):
        cfg = self.config
        B, T = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        embed = _param(
            self,
            "embedding",
            nn.initializers.normal(cfg.initializer_range),
            (cfg.vocab_size, cfg.hidden_size),
            cfg.param_dtype,
        )
        x_BTD = jnp.take(embed, input_ids, axis=0).astype(cfg.dtype)
        cos_BTK, sin_BTK = rope_cos_sin(cfg, positions)

        # Initializing unrolled gives the same params at ~15x the time (28 layers: 6 -> 91 s on CPU).
        unroll = cfg.unroll_layers and not self.is_initializing()
        layer_cls = DecoderLayer
        if cfg.remat_policy != "none":
            # Inside a loop XLA cannot merge a recomputation with the forward it repeats; unrolled it would, and the
            # recomputation would save nothing.
            layer_cls = nn.remat(DecoderLayer, policy=_remat_policy(cfg.remat_policy), prevent_cse=unroll)
        # The layer index is a scanned input only when the recipe skips edge layers (lax.cond per layer).
        skips = cfg.recipe is not None and cfg.recipe.skips
        segs = segment_ids  # with a bound: each segment's start and length, once for every layer
        if segment_ids is not None and cfg.max_segments is not None:
            segs = attention_op.segments(segment_ids, cfg.max_segments)
        # MoE: the rows that count in the router statistics (padding, segment id 0, does not)
        valid_BT = segment_ids > 0 if cfg.num_experts and segment_ids is not None else None
        router_stats = []
        for name, start, n, sparse in cfg.layer_stacks():  # one scan per run of dense or MoE layers
            stack = nn.scan(
                layer_cls,
                variable_axes={"params": 0, "lora": 0, recipe_lib.FP8_COLLECTION: 0},
                split_rngs={"params": True, "lora": True, "dropout": True, recipe_lib.QUANT_RNG: True},
                in_axes=(nn.broadcast,) * 4 + ((0,) if skips else ()),
                length=n,
                unroll=n if unroll else 1,
            )
            layer_ids = (jnp.arange(start, start + n, dtype=jnp.int32),) if skips else ()
            x_BTD, stats = stack(cfg, sparse, name=name)(x_BTD, cos_BTK, sin_BTK, segs, valid_BT, *layer_ids)
            if stats is not None:
                router_stats.append(stats)
        if router_stats:  # [sparse layers, ...] per statistic; train.batch_loss reads them (moe.router_losses)
            self.sow("intermediates", "router_stats",
                     jax.tree.map(lambda *s: jnp.concatenate(s), *router_stats))
        x_BTD = RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, cfg.impl("rms_norm"), cfg.mesh,
                        name="norm")(x_BTD)
        if return_hidden:
            return x_BTD
        if cfg.tie_word_embeddings:
            head_DV = embed.T
        else:
            head_DV = _param(
                self,
                "lm_head",
                nn.initializers.normal(cfg.initializer_range),
                (cfg.hidden_size, cfg.vocab_size),
                cfg.param_dtype,
            )
        return jnp.einsum("btd,dv->btv", x_BTD, head_DV.astype(cfg.dtype))
