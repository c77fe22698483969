"""Precision recipes inside the model: which GEMMs are quantized, how, and the state they carry.

Recipes (Surogate's `recipe:` key; seed 002 "Precision & Recipes"):
  bf16        GEMMs in the model dtype (the default; `DecoderConfig.recipe` stays None and nothing
              changes). With `matmul_dtype` / `gradient_dtype` different from the model dtype the
              seven projections run a mixed-dtype GEMM (`mixed_linear`: forward in matmul_dtype,
              the backward GEMMs in gradient_dtype, fp32 accumulation).
  fp8-hybrid  E4M3 activations and weights forward, E5M2 dY backward, per-tensor delayed scaling
              (`surogate_jax.ops.fp8_matmul`, state in precision/fp8.py).
  nvfp4       NVFP4 operands (1x16 blocks for x and dY, 16x16 tiles for W, stochastic rounding for
              dY, 16-point RHT on the wgrad inputs, 4/6 block scales) (ops/nvfp4_quantize.py). GEMMs:
              native cuBLASLt block-scaled FP4 on SM100+ GPUs (ops/nvfp4_matmul.py; compiled,
              not run on hardware in this project), emulated elsewhere (Hopper and CPU have no FP4
              tensor cores): quantize, dequantize to bf16, bf16 GEMM.

What is quantized: only the seven projections inside the decoder layers (q, k, v, o, gate, up,
down). The embedding, lm_head, attention, norms and the LoRA branch stay in the model dtype, as in
the seed system. `skip_quant_first_layers` / `skip_quant_last_layers` keep edge decoder layers
plain: the layer stack is one `nn.scan`, so each projection receives its layer index and chooses
with `lax.cond` between the quantized and the plain GEMM (only when a skip count is > 0).

State:
  * fp8-hybrid: one `Fp8MatmulState` per projection in the Flax variable collection "fp8"
    (`FP8_COLLECTION`), stacked [L] by the scan. The train step keeps it in `TrainState.quant`,
    differentiates w.r.t. it (the "gradient" carries the observed amaxes), combines micro-batches
    with `fp8.combine_observations` (max) and applies `fp8.update` once per optimizer step.
  * nvfp4: no state (current scaling); the stochastic rounding draws from the Flax rng stream
    "quant" (`QUANT_RNG`), split per layer (without that rng, e.g. in eval, a fixed key is used:
    it only matters for the backward).

Frozen base weights (LoRA): `cache_frozen_weights` quantizes the seven kernels ONCE when the state
is built and adds a per-layer `kernel_scale` next to each kernel (its presence marks a cache):
  * fp8-hybrid: E4M3 values with current scaling per layer, scale = 448 / max|W_l| (a kernel of
    float8_e4m3fn: half the bf16 memory, no per-step weight cast, no wgrad GEMM:
    `ops.fp8_matmul.fp8_matmul_frozen`), stored as `kernel_nk` [L, out, in] (K = prod(in), N =
    prod(out)): the layout the forward GEMM reads, so only the backward's dX transposes it, where
    [L, in..., out...] made every forward and recomputed forward transpose it. With skip counts > 0
    the skipped layers must keep their exact weights, so the stacked `kernel` keeps its shape and the
    model dtype and holds the E4M3 values (exactly representable) in the quantized layers;
  * nvfp4: the 16x16-tile quantize-dequantized weights (`nvfp4_matmul.fake_quantize_weight`, bf16 values),
    used by `nvfp4_matmul.nvfp4_linear_frozen` (same forward and dX as quantizing every step).
Full fine-tuning quantizes the master weights every step (delayed scaling for fp8).

Mixture-of-experts layers (fp8-hybrid only): the experts' three grouped GEMMs run in FP8 with CURRENT scaling
(ops/grouped_matmul.py: one scale per call for the sorted activations and dY, one per expert for the weights), so
they carry no state in the "fp8" collection; the router stays in the model dtype. LoRA caches each frozen expert
stack once as {kernel_nk: E4M3 [L, E, out, in], kernel_scale: [L, E]} under the projection's name
(`cache_experts`); full fine-tuning quantizes the trained experts every call; a QLoRA base goes from its codes to
E4M3 per layer (qlora.base). Layers kept plain by skip_quant_* are not supported there (refused).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from surogate_jax.names import EXPERT_PROJECTIONS, FP4_BACKENDS, PROJECTIONS, RECIPE_ALIASES, RECIPES, layer_stack_start
from surogate_jax.ops import fp8_formats, nvfp4_matmul, nvfp4_quantize
from surogate_jax.ops.grouped_matmul import expert_scales
from surogate_jax.precision import fp8

_log = logging.getLogger("surogate_jax")
KERNEL_NK = "kernel_nk"  # fp8-hybrid's frozen cache in the [L, out, in] layout (module docstring)

IN_DIMS = {"o_proj": 2}  # trailing dims of x a projection contracts (1 for the others)
FP8_COLLECTION = "fp8"
QUANT_RNG = "quant"
KERNEL_SCALE = "kernel_scale"
EXPERTS = "experts"  # the MoE module whose gate/up/down_proj stacks fp8-hybrid caches (cache_experts)
FP8_IMPLS = (None, "auto", "ffi", "xla", "ref")
MATMUL_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """The precision recipe of the decoder's seven projections (hashable: part of DecoderConfig).

    name: "bf16" | "fp8-hybrid" | "nvfp4".
    fp8_impl: fp8_matmul backend, None = auto (ffi on GPU, reference elsewhere), "ffi", "xla", "ref".
    amax_history / margin: delayed scaling (fp8_amax_history; new scale = 448 / max(hist) / 2^margin).
    skip_first / skip_last: decoder layers kept plain at each end (skip_quant_*_layers).
    fp4_four_over_six / fp4_stochastic / fp4_backend / fp4_impl: NVFP4 knobs. fp4_backend names
      Surogate's CUTLASS or cuDNN FP4 kernels, which we do not have: both values select the
      native cuBLASLt FP4 GEMM on SM100+ GPUs and the emulated GEMM elsewhere (nvfp4_matmul.py);
      fp4_impl is the quantizer backend (None = CUDA kernels on GPU, reference elsewhere; "ref"
      also forces the emulated GEMM).
    matmul_dtype / gradient_dtype: "fp32" | "bf16" GEMM dtypes under the bf16 recipe (None = the
      model dtype / matmul_dtype); the fp8 and nvfp4 recipes force their own formats.
    """

    name: str = "bf16"
    fp8_impl: str | None = None
    amax_history: int = fp8_formats.DEFAULT_AMAX_HISTORY
    margin: float = 0.0
    skip_first: int = 0
    skip_last: int = 0
    fp4_four_over_six: bool = True
    fp4_stochastic: bool = True
    fp4_backend: str = "cutlass"
    fp4_impl: str | None = None
    matmul_dtype: str | None = None
    gradient_dtype: str | None = None

    def __post_init__(self):
        name = RECIPE_ALIASES.get(self.name, self.name)
        object.__setattr__(self, "name", name)
        if name not in RECIPES:
            raise ValueError(f"recipe={self.name!r}: use one of {RECIPES}")
        if self.fp8_impl not in FP8_IMPLS:
            raise ValueError(f"fp8_impl={self.fp8_impl!r}: use one of {FP8_IMPLS}")
        if self.amax_history < 1:
            raise ValueError(f"fp8_amax_history={self.amax_history}: must be >= 1")
        if self.skip_first < 0 or self.skip_last < 0:
            raise ValueError(f"skip_quant_first_layers={self.skip_first}, "
                             f"skip_quant_last_layers={self.skip_last}: must be >= 0")
        if self.fp4_backend not in FP4_BACKENDS:
            raise ValueError(f"fp4_backend={self.fp4_backend!r}: use one of {FP4_BACKENDS}")
        for k in ("matmul_dtype", "gradient_dtype"):
            v = getattr(self, k)
            if v is not None and (name != "bf16" or v not in MATMUL_DTYPES):
                raise ValueError(f"{k}={v!r}: only the bf16 recipe takes {k} (fp32 or bf16); "
                                 f"recipe {name} forces its own formats")

    @classmethod
    def from_config(cls, pc: Any, *, model_dtype: str | None = None, fp8_impl: str | None = None,
                    fp4_impl: str | None = None) -> QuantRecipe | None:
        """The recipe a `config.PrecisionConfig` asks for, or None (plain bf16: nothing to do).
        Under bf16, matmul_dtype / gradient_dtype equal to the model dtype are no-ops."""
        name = RECIPE_ALIASES.get(pc.recipe, pc.recipe)
        model_dtype = model_dtype or pc.model_dtype
        mm, gd = None, None
        if name == "bf16":
            mm = pc.matmul_dtype if pc.matmul_dtype not in (None, model_dtype) else None
            gd = pc.gradient_dtype if pc.gradient_dtype not in (None, mm or model_dtype) else None
            if mm is None and gd is None:
                return None
        return cls(name=name, fp8_impl=fp8_impl, amax_history=pc.fp8_amax_history,
                   skip_first=pc.skip_quant_first_layers, skip_last=pc.skip_quant_last_layers,
                   fp4_four_over_six=pc.fp4_four_over_six, fp4_stochastic=not pc.no_fp4_stochastic_rounding,
                   fp4_backend=pc.fp4_backend, fp4_impl=fp4_impl, matmul_dtype=mm, gradient_dtype=gd)

    @property
    def quantizes(self) -> bool:
        return self.name != "bf16"

    @property
    def has_state(self) -> bool:
        """Whether the model carries a delayed-scaling state (the "fp8" collection)."""
        return self.name == "fp8-hybrid"

    @property
    def skips(self) -> bool:
        return self.quantizes and (self.skip_first > 0 or self.skip_last > 0)

    def layer_quantized(self, layer: Any, num_layers: int) -> Any:
        """Whether decoder layer `layer` (int or traced int) runs quantized GEMMs."""
        return (layer >= self.skip_first) & (layer < num_layers - self.skip_last)

    def check_model(self, cfg: Any) -> None:
        """Shape requirements for the decoder config `cfg` (ValueError naming the dims); on a mixture-of-experts
        model only fp8-hybrid, without skipped layers."""
        if getattr(cfg, "num_experts", 0):
            if self.name == "bf16":
                raise ValueError("matmul_dtype / gradient_dtype on a mixture-of-experts model: its expert GEMMs run "
                                 "in the model dtype only; leave them unset")
            if self.name != "fp8-hybrid":
                raise ValueError(f"recipe {self.name} on a mixture-of-experts model: only fp8-hybrid runs the "
                                 "experts' grouped GEMMs quantized; use recipe: fp8-hybrid or bf16")
            if self.skips:
                raise ValueError("skip_quant_first_layers / skip_quant_last_layers on a mixture-of-experts model: "
                                 "its expert GEMMs have no plain per-layer branch; leave them at 0")
        if self.name != "nvfp4":
            return
        dims = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                "num_heads * head_dim": cfg.num_heads * cfg.head_dim,
                "num_kv_heads * head_dim": cfg.num_kv_heads * cfg.head_dim}
        bad = {k: v for k, v in dims.items() if v % nvfp4_quantize.BLOCK}
        if bad:
            raise ValueError(f"recipe nvfp4 needs every projection dim to be a multiple of {nvfp4_quantize.BLOCK} "
                             f"(NVFP4 blocks of 16 along the GEMM reduction); this model has {bad}")

    def describe(self) -> str:
        parts = [self.name]
        if self.name == "fp8-hybrid":
            parts.append(f"amax history {self.amax_history}, impl {self.fp8_impl or 'auto'}")
        if self.name == "nvfp4":
            gemm = ("native FP4 GEMMs (cuBLASLt, SM100+)" if nvfp4_matmul.native_available(impl=self.fp4_impl)
                    else "emulated GEMMs (native FP4 needs SM100+, not run on hardware here)")
            parts.append(f"4/6 {'on' if self.fp4_four_over_six else 'off'}, stochastic rounding "
                         f"{'on' if self.fp4_stochastic else 'off'}, {gemm}")
        if self.skips:
            parts.append(f"first {self.skip_first} / last {self.skip_last} layers plain")
        if self.matmul_dtype or self.gradient_dtype:
            parts.append(f"matmul {self.matmul_dtype or 'model dtype'}, "
                         f"gradients {self.gradient_dtype or 'matmul dtype'}")
        return "; ".join(parts)


def check_device(recipe: QuantRecipe | None, device: Any = None) -> None:
    """At run start: fp8-hybrid on an NVIDIA GPU below SM89 raises fp8.Fp8UnsupportedError
    (naming the GPU and `recipe: bf16`); nvfp4 logs its one line saying whether the GEMMs run
    natively (SM100+) or emulated."""
    if recipe is None:
        return
    if recipe.name == "fp8-hybrid":
        fp8.check_fp8_supported(device, recipe="fp8-hybrid")
    elif recipe.name == "nvfp4":
        nvfp4_matmul.log_emulation()


# ------------------------------------------------------------------------------------------------
# The GEMM of one projection


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mixed(x2, w2, matmul_dtype, gradient_dtype, out_dtype):
    return jnp.matmul(x2.astype(matmul_dtype), w2.astype(matmul_dtype),
                      preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_fwd(x2, w2, matmul_dtype, gradient_dtype, out_dtype):
    return _mixed(x2, w2, matmul_dtype, gradient_dtype, out_dtype), (x2, w2)


def _mixed_bwd(matmul_dtype, gradient_dtype, out_dtype, res, dy):
    x2, w2 = res
    g = dy.astype(gradient_dtype)
    dx = jnp.matmul(g, w2.astype(gradient_dtype).T, preferred_element_type=jnp.float32).astype(x2.dtype)
    dw = jnp.matmul(x2.astype(gradient_dtype).T, g, preferred_element_type=jnp.float32).astype(w2.dtype)
    return dx, dw


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def mixed_linear(x2: jax.Array, w2: jax.Array, matmul_dtype, gradient_dtype, out_dtype) -> jax.Array:
    """y [M, N] = x2 [M, K] @ w2 [K, N] with operands in matmul_dtype (fp32 accumulation, one
    rounding to out_dtype); backward: dY rounded to gradient_dtype, dX = dY W^T and dW = X^T dY
    with operands in gradient_dtype (fp32 accumulation); dx in x2.dtype, dw in w2.dtype."""
    return _mixed(x2, w2, jnp.dtype(matmul_dtype), jnp.dtype(gradient_dtype), jnp.dtype(out_dtype))


def _quantized_2d(recipe: QuantRecipe, x2, w2, state, kernel_scale, key, dtype, mesh, w_layout="kn"):
    """The recipe's GEMM on x2 [M, K] (dtype) and w2 [K, N] (w_layout "nk": a frozen E4M3 w2 [N, K]); output
    [M, N] in dtype; the quantized ops split x2's rows over mesh's data axes."""
    from surogate_jax.ops.fp8_matmul import fp8_matmul, fp8_matmul_frozen

    if recipe.name == "fp8-hybrid":
        if kernel_scale is not None:  # frozen, cached E4M3 (kept in the model dtype when layers are skipped)
            wq = w2 if w2.dtype == jnp.dtype(fp8_formats.E4M3) else w2.astype(fp8_formats.E4M3)
            return fp8_matmul_frozen(x2, wq, kernel_scale, state, impl=recipe.fp8_impl, out_dtype=dtype, mesh=mesh,
                                     w_layout=w_layout)
        return fp8_matmul(x2, w2, state, impl=recipe.fp8_impl, out_dtype=dtype, mesh=mesh)
    if recipe.name == "nvfp4":
        kw = {"four_over_six": recipe.fp4_four_over_six, "stochastic_grad": recipe.fp4_stochastic,
              "impl": recipe.fp4_impl, "mesh": mesh}
        if kernel_scale is not None:
            return nvfp4_matmul.nvfp4_linear_frozen(x2, w2, key, **kw).astype(dtype)
        return nvfp4_matmul.nvfp4_linear_emulated(x2, w2, key, **kw).astype(dtype)
    mm = MATMUL_DTYPES[recipe.matmul_dtype] if recipe.matmul_dtype else dtype
    gd = MATMUL_DTYPES[recipe.gradient_dtype] if recipe.gradient_dtype else mm
    return mixed_linear(x2, w2, mm, gd, dtype)


def linear(recipe: QuantRecipe, x: jax.Array, kernel: jax.Array, *, in_dims: int, dtype: Any,
           fp8_state: fp8_formats.Fp8MatmulState | None = None, kernel_scale: jax.Array | None = None,
           key: jax.Array | None = None, layer: jax.Array | None = None, num_layers: int | None = None,
           mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
           kernel_nk_out: tuple[int, ...] | None = None) -> jax.Array:
    """y [..., out...] = x [..., in...] @ kernel [in..., out...] under `recipe` (one projection of
    one decoder layer; the caller fetches state, kernel_scale and key, this function is pure).
    kernel_nk_out: the kernel is instead a frozen E4M3 [prod(out), prod(in)] (a QLoRA base dequantized in its
    HF layout, fp8-hybrid with kernel_scale, no skipped layers) and this is out's shape.

    x is cast to `dtype` (the model dtype), reshaped to [N, prod(in)] and the kernel to
    [prod(in), prod(out)] (o_proj contracts two dims). With skip counts > 0 and `layer` given,
    `lax.cond` picks the plain GEMM (the model's exact bf16 expression) for skipped layers.
    mesh: the device mesh the fp8 / nvfp4 ops split rows over (DecoderConfig.mesh; None: whole)."""
    n_in = x.ndim - in_dims
    in_shape = x.shape[n_in:]
    if kernel_nk_out is not None:
        out_shape = tuple(kernel_nk_out)
        if tuple(kernel.shape) != (math.prod(out_shape), math.prod(in_shape)):
            raise ValueError(f"linear: x {x.shape} does not contract with an [out, in] kernel {kernel.shape}")
        if recipe.name != "fp8-hybrid" or kernel_scale is None or recipe.skips:
            raise ValueError("linear: an [out, in] kernel is the frozen E4M3 GEMM of fp8-hybrid only (kernel_scale "
                             "given, no skipped layers)")
    else:
        out_shape = kernel.shape[in_dims:]
        if tuple(kernel.shape[:in_dims]) != tuple(in_shape):
            raise ValueError(f"linear: x {x.shape} does not contract with kernel {kernel.shape} over {in_dims} dim(s)")
    k, n = math.prod(in_shape), math.prod(out_shape)
    layout = "kn" if kernel_nk_out is None else "nk"

    def quant(x, kernel, state, scale, key):
        w2 = kernel.reshape(k, n) if layout == "kn" else kernel
        y2 = _quantized_2d(recipe, x.astype(dtype).reshape(-1, k), w2, state, scale, key, dtype, mesh, layout)
        return y2.reshape(*x.shape[:n_in], *out_shape)

    def plain(x, kernel, state, scale, key):
        contract = (tuple(range(n_in, x.ndim)), tuple(range(in_dims)))
        return jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), (contract, ((), ())))

    operands = (x, kernel, fp8_state, kernel_scale, key)
    if recipe.skips and layer is not None:
        if num_layers is None:
            raise ValueError("linear: num_layers is needed with skip_quant_first_layers / skip_quant_last_layers")
        return jax.lax.cond(recipe.layer_quantized(layer, num_layers), quant, plain, *operands)
    return quant(*operands)


# ------------------------------------------------------------------------------------------------
# State: the fp8 collection, the frozen-weight cache


def init_quant_state(model: Any, example_ids: jax.Array | None = None) -> dict:
    """The model's "fp8" collection (scale 1, empty histories, stacked [L]), or {} when the
    recipe has no state. Only that collection is computed (the params are traced and dropped)."""
    recipe = getattr(model.config, "recipe", None)
    if recipe is None or not recipe.has_state:
        return {}
    import flax.linen as nn

    ids = jnp.zeros((1, 1), jnp.int32) if example_ids is None else example_ids

    def init():
        v = model.init({"params": jax.random.key(0), "lora": jax.random.key(0)}, ids)
        return nn.meta.unbox(v[FP8_COLLECTION])

    return jax.jit(init)()


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def is_cached(params: Any) -> bool:
    """Whether `params` already holds a frozen-weight cache (a `kernel_scale` leaf)."""
    return any(_path_keys(p)[-1] == KERNEL_SCALE for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def cached_kernel_name(recipe: QuantRecipe) -> str:
    """The param name of a projection's cached frozen kernel: `kernel_nk` ([L, out, in] E4M3) under fp8-hybrid
    without skipped layers, else `kernel` (w's own shape)."""
    return KERNEL_NK if recipe.name == "fp8-hybrid" and not recipe.skips else "kernel"


def cache_kernel(recipe: QuantRecipe, proj: str, w: jax.Array, num_layers: int):
    """(cached kernel, kernel_scale [L]) of one stacked kernel w [L, in..., out...]; the cached kernel is
    [L, prod(out), prod(in)] when cached_kernel_name(recipe) is `kernel_nk`, else w's shape."""
    L = w.shape[0]
    in_dims = IN_DIMS.get(proj, 1)
    k = math.prod(w.shape[1:1 + in_dims])
    layers_q = recipe.layer_quantized(jnp.arange(L), num_layers)
    bshape = (L,) + (1,) * (w.ndim - 1)
    if recipe.name == "fp8-hybrid":
        scale = fp8_formats.current_scale(fp8_formats.amax(w.reshape(L, -1), axis=1))
        q = fp8_formats.quantize(w, scale.reshape(bshape), fp8_formats.E4M3)
        if not recipe.skips:
            return q.reshape(L, k, -1).swapaxes(1, 2), scale
        return jnp.where(layers_q.reshape(bshape), q.astype(w.dtype), w), scale
    # nvfp4: per layer, the 2-D [in, out] matrix in 16x16 tiles (global scale per layer)
    def one(wl):
        wq = nvfp4_matmul.fake_quantize_weight(wl.reshape(k, -1), four_over_six=recipe.fp4_four_over_six,
                                        impl=recipe.fp4_impl)
        return wq.reshape(wl.shape).astype(w.dtype)

    q = jax.lax.map(one, w)
    s_dec = jax.lax.map(lambda wl: 1.0 / nvfp4_quantize.global_encode_scale(
        jnp.max(jnp.abs(wl.astype(jnp.float32))), recipe.fp4_four_over_six), w)
    return jnp.where(layers_q.reshape(bshape), q, w), s_dec.astype(jnp.float32)


def cache_experts(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp8-hybrid's frozen cache of one stacked expert projection w [L, E, in, out]: (E4M3 [L, E, out, in] (HF
    layout, what the grouped FP8 GEMM reads), scales [L, E]: 448 / max|w_le|)."""
    s = expert_scales(w, axes=(2, 3))
    return fp8_formats.quantize(jnp.swapaxes(w, 2, 3), s[:, :, None, None], fp8_formats.E4M3), s


def _in_layer_stack(path) -> bool:
    return any(layer_stack_start(p) is not None for p in path)


def cache_frozen_weights(params: Any, recipe: QuantRecipe | None, num_layers: int,
                         cache_one: Callable | None = None) -> Any:
    """Frozen base params with the seven projections' kernels quantized once (see the module
    docstring); each cached kernel gets a sibling `kernel_scale` f32 [L]. Returns `params`
    unchanged for recipes without quantization or when already cached. cache_one(proj, w) ->
    (cached, scale) replaces the per-kernel quantization (train.prepare_frozen passes a jitted,
    input-donating one, so only one kernel's two copies exist at a time). Under fp8-hybrid the MoE
    experts' stacks are cached too (`cache_experts`; cache_one gets proj `EXPERTS` for them)."""
    if recipe is None or not recipe.quantizes or is_cached(params):
        return params

    def walk(node, path):
        if not isinstance(node, Mapping):
            return node
        out = {}
        for key, v in node.items():
            if (recipe.name == "fp8-hybrid" and path and path[-1] == EXPERTS and key in EXPERT_PROJECTIONS
                    and _in_layer_stack(path) and hasattr(v, "ndim")):
                wq, scale = cache_one(EXPERTS, v) if cache_one is not None else cache_experts(v)
                out[key] = {KERNEL_NK: wq, KERNEL_SCALE: scale}
            elif (key == "kernel" and path and path[-1] in PROJECTIONS and _in_layer_stack(path)
                    and hasattr(v, "ndim")):
                out[cached_kernel_name(recipe)], out[KERNEL_SCALE] = (
                    cache_one(path[-1], v) if cache_one is not None else cache_kernel(recipe, path[-1], v, num_layers))
            else:
                out[key] = walk(v, (*path, key))
        return out

    return walk(params, ())


def dequantize_cache(params: Any, recipe: QuantRecipe, num_layers: int, shapes: Any) -> Any:
    """Best effort inverse of `cache_frozen_weights` (drops `kernel_scale`; fp8 kernels become
    q / scale in float32 in the quantized layers, NVFP4 kernels already hold dequantized values).
    shapes: the uncached params' tree (arrays or ShapeDtypeStructs), for each `kernel`'s shape.
    Lossy: the original weights are not recoverable from the cache."""
    def walk(node, like):
        if not isinstance(node, Mapping):
            return node
        if KERNEL_SCALE in node and not isinstance(like, Mapping):  # an expert stack (cache_experts)
            s = node[KERNEL_SCALE][:, :, None, None]
            return (node[KERNEL_NK].astype(jnp.float32) / s).swapaxes(2, 3)
        if KERNEL_SCALE in node:
            name = KERNEL_NK if KERNEL_NK in node else "kernel"
            k, s = node[name], node[KERNEL_SCALE]
            out = {kk: v for kk, v in node.items() if kk not in (name, KERNEL_SCALE)}
            if name == KERNEL_NK:  # [L, N, K] -> [L, in..., out...]
                k = k.swapaxes(1, 2).reshape(like["kernel"].shape)
            if recipe.name == "fp8-hybrid":
                b = (-1,) + (1,) * (k.ndim - 1)
                mask = recipe.layer_quantized(jnp.arange(k.shape[0]), num_layers).reshape(b)
                kf = k.astype(jnp.float32)
                out["kernel"] = jnp.where(mask, kf / s.reshape(b), kf)
            else:
                out["kernel"] = k
            return out
        return {kk: walk(v, like[kk]) for kk, v in node.items()}

    return walk(params, shapes)
