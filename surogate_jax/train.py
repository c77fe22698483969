"""TrainState, the pure train/eval steps, and the training loop shared by `sft` and `pretrain`.

State: `params` holds the frozen base in model dtype (LoRA) or nothing (full fine-tuning, where
the forward casts the fp32 masters in `trainable`); `trainable` is what the optimizer updates
(adapters, or master weights); plus optax state, step and RNG. The step is one pure function,
jitted once over an explicit mesh with NamedShardings and the state donated. Gradient
accumulation runs inside it as a `lax.scan` over the micro-batches; the summed token CE of every
micro-batch is divided by the supervised-token count of the whole step, so accumulating equals one
big batch. Data parallelism comes from the batch sharding over the mesh's "data" axis (one
device by default); XLA inserts the gradient all-reduce.

Precision recipes (precision/recipe.py): `quant` holds the fp8-hybrid delayed-scaling state (the
model's "fp8" collection; {} otherwise). The step differentiates w.r.t. (trainable, quant): the
quant "gradient" carries each GEMM's observed amaxes (already max-reduced over data shards by the
op), micro-batches combine them with a max (fp8.combine_observations, not a sum), and fp8.update
rolls the histories and recomputes the scales once per optimizer step. For LoRA under a recipe
the frozen base kernels are quantized once in `init_state` (recipe.cache_frozen_weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .loss import cross_entropy_sum
from .models import Decoder, DecoderConfig, moe
from .offload import Streamer, num_layers
from .optim.fused import apply_fused, global_norm
from .parallel import Layout, make_mesh  # noqa: F401  (make_mesh: re-exported)
from .precision import fp8 as fp8_lib
from .precision import recipe as recipe_lib

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")
# moe.router_losses' names -> the step's metric names (metrics.jsonl)
ROUTER_METRICS = {"aux_loss": "aux_loss", "z_loss": "router_z_loss", "expert_load": "expert_load"}


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    trainable: Any
    opt_state: Any
    rng: jax.Array  # raw key data (uint32), so Orbax can save it
    quant: Any = flax.struct.field(default_factory=dict)  # fp8 delayed-scaling state ({} without)
    # offload_grads with streaming: the fp32 gradient accumulator, a pinned_host buffer that the
    # step overwrites (first micro-batch) and adds into. Not checkpointed (its content is scratch);
    # {} otherwise. Why: a zero-initialized accumulator made inside the step was materialized in
    # device memory by XLA for the largest leaves (H100, 8B full FT: f32 [36, ...] broadcasts in the
    # buffer assignment). This buffer took 2 GiB off that step's temporaries, not all of it: the
    # 8B all-offload step still does not fit one H100.
    grad_buf: Any = flax.struct.field(default_factory=dict)
    # The first step (1-based) whose loss or gradient norm was not finite, 0 while all were; set
    # inside the step (and returned in its metrics) so the host reads it only when it logs or saves.
    # Not checkpointed ({} = off).
    first_nonfinite: Any = flax.struct.field(default_factory=dict)


def variables(model: Decoder, params: Any, trainable: Any, quant: Any = None) -> dict:
    """The forward's variables: base + adapters (LoRA), or masters cast to the model's param dtype;
    plus the recipe's fp8 state when there is one. Leaves already in the compute dtype (the
    streamed bf16 working copy of offload_master) stay as they are: the model casts every weight
    to that dtype on use, and an up-cast here made XLA keep fp32 copies of the whole layer stack
    and its gradient on the device (found in the buffer assignment of the 8B step)."""
    if model.config.lora is not None:
        v = {"params": params, "lora": trainable}
    else:
        dtype, compute = model.config.param_dtype, jnp.dtype(model.config.dtype)
        v = {"params": jax.tree.map(lambda x: x if x.dtype == compute else x.astype(dtype), trainable)}
    if quant:
        v[recipe_lib.FP8_COLLECTION] = quant
    return v


def lm_head(cfg: DecoderConfig, params: dict) -> tuple[jax.Array, str]:
    """(head, its layout): a tied embedding table goes in as is ([V, D], "VD"): its transpose would be
    a copy, and so would the transposed gradient."""
    return (params["embedding"], "VD") if cfg.tie_word_embeddings else (params["lm_head"], "DV")


def batch_loss(model: Decoder, params, trainable, batch: dict, rng, quant: Any = None) -> tuple[jax.Array, jax.Array]:
    """(sum of token CE over supervised targets, their count) for one micro-batch."""
    ce_sum, n_tokens, _ = _forward_loss(model, params, trainable, batch, rng, quant)
    return ce_sum, n_tokens


def train_loss(model: Decoder, params, trainable, batch: dict, rng, quant: Any = None,
               router_weight: jax.Array | float = 0.0) -> tuple[jax.Array, tuple[jax.Array, jax.Array, dict]]:
    """What the train step differentiates for one micro-batch: (CE sum + router_weight x (the MoE router losses
    times their coefficients), (supervised tokens, the CE sum alone, router metrics: {} for a dense model)).
    router_weight puts the router losses, means over a micro-batch, on the CE sum's scale (the step divides by the
    step's token count)."""
    ce_sum, n_tokens, router = _forward_loss(model, params, trainable, batch, rng, quant)
    if not router:
        return ce_sum, (n_tokens, ce_sum, {})
    cfg = model.config
    extra = cfg.router_aux_loss_coef * router["aux_loss"] + cfg.router_z_loss_coef * router["z_loss"]
    return ce_sum + router_weight * extra, (n_tokens, ce_sum, jax.lax.stop_gradient(router))


def _forward_loss(model: Decoder, params, trainable, batch: dict, rng, quant: Any = None):
    """(CE sum, supervised tokens, MoE router losses and load from moe.router_losses, or {})."""
    v = variables(model, params, trainable, quant)
    spec = model.config.lora
    rngs = {"dropout": rng} if spec is not None and spec.dropout > 0 and rng is not None else None
    recipe = model.config.recipe
    if recipe is not None and recipe.name == "nvfp4" and rng is not None:  # stochastic rounding of dY
        rngs = {**(rngs or {}), recipe_lib.QUANT_RNG: jax.random.fold_in(rng, 0x5A17)}
    args = (batch["input_ids"], batch["positions"], batch["segment_ids"])
    router = {}
    if model.config.moe_layers:
        hidden, inter = model.apply(v, *args, return_hidden=True, rngs=rngs, mutable=["intermediates"])
        router = moe.router_losses(inter["intermediates"]["router_stats"][0])
    else:
        hidden = model.apply(v, *args, return_hidden=True, rngs=rngs)
    head, layout = lm_head(model.config, v["params"])
    ce_sum, n_tokens = cross_entropy_sum(hidden, head, batch["targets"], batch["loss_mask"], head_layout=layout,
                                         mesh=model.config.mesh)
    return ce_sum, n_tokens, router


def with_mesh(model: Decoder, mesh: Mesh | None) -> Decoder:
    """`model` whose ops split rows over `mesh`'s data axes (DecoderConfig.mesh); None keeps its own."""
    if mesh is None or model.config.mesh == mesh:
        return model
    return model.clone(config=model.config.replace(mesh=mesh))


def make_train_step(model: Decoder, tx: optax.GradientTransformation, schedule: Callable,
                    layout: Layout | None = None) -> Callable:
    """step(state, batch with leading [grad_accum] axis) -> (state, metrics); pure, not jitted.
    `layout` (parallel.Layout): ZeRO-2 gradient sharding and host-offload placement in the step.
    Two steps share the micro-batch scan and the bookkeeping: the plain one (the whole state on the
    device) and the layer-streamed one (offloaded state crosses to the device one layer at a time,
    offload.py), picked when the step is traced. The model's ops run per data shard of the layout's
    mesh (with_mesh)."""
    layout = layout or Layout(None)
    model = with_mesh(model, layout.mesh)
    recipe = model.config.recipe
    margin = recipe.margin if recipe is not None else 0.0

    def step(state: TrainState, batch: dict):
        st = streamer(layout, state.trainable)
        if st is None:
            return _plain_step(model, tx, schedule, layout, margin, state, batch)
        return _streamed_step(model, tx, schedule, layout, margin, st, state, batch)

    return step


def _plain_step(model, tx, schedule, layout: Layout, margin: float, state: TrainState, batch: dict):
    state = layout.fetch_state(state)  # offloaded trainable / optimizer state -> device (whole)

    def add(grads, g, i):
        grads = layout.constrain_grads(jax.tree.map(jnp.add, layout.grads_to_device(grads), g))
        return layout.grads_to_host(grads)

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), state.trainable)
    zeros = layout.grads_to_host(layout.constrain_grads(zeros))
    grads, obs, loss_sum, router, rng = _accumulate(model, state, state.trainable, batch, zeros, add)
    n_tokens, denom = _token_count(batch)
    grads = jax.tree.map(lambda g, t: (g / denom).astype(t.dtype), layout.grads_to_device(grads), state.trainable)
    grad_norm = global_norm(grads)
    # tx's fused path when it has one (adamw_8bit: the kernel writes the parameters in place, the
    # clip folded in as a gradient scale), else tx.update + optax.apply_updates
    trainable, opt_state = apply_fused(tx, grads, state.opt_state, state.trainable)
    return _finish(state, schedule, margin, obs, loss_sum, n_tokens, denom, grad_norm, rng, router,
                   trainable=trainable, opt_state=opt_state)


def _streamed_step(model, tx, schedule, layout: Layout, margin: float, st: Streamer, state: TrainState,
                   batch: dict):
    """Gradients, masters and optimizer state of one layer at a time on the device."""
    plan = layout.plan
    work = forward_weights(model, layout, state.trainable, st)  # the forward's weights on the device only
    use_buf = bool(jax.tree.leaves(state.grad_buf))
    if use_buf:  # the persistent host accumulator; the first micro-batch overwrites it
        zeros = state.grad_buf
    else:
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), state.trainable)
        zeros = layout.grads_to_host(layout.constrain_grads(zeros))

    def add(grads, g, i):
        return st.accumulate(grads, layout.constrain_grads(g), host=plan.offload_grads, shard=plan.shard_gradients,
                             first=(i == 0) if use_buf else None)

    grads, obs, loss_sum, router, rng = _accumulate(model, state, work, batch, zeros, add)
    n_tokens, denom = _token_count(batch)
    prep = lambda g, dtype: (g / denom).astype(dtype)
    dtypes = jax.tree.map(lambda t: t.dtype, state.trainable)
    grad_norm = jnp.sqrt(st.sum_squares(grads, prep, dtypes, host=plan.offload_grads, shard=plan.shard_gradients))
    trainable, opt_state = st.update(
        lambda g, s, t: apply_fused(tx, g, s, t, norm=grad_norm), tx.init, grads, state.opt_state,
        state.trainable, prep=prep, grads_host=plan.offload_grads, opt_host=plan.offload_optimizer,
        params_host=plan.offload_master)
    return _finish(state, schedule, margin, obs, loss_sum, n_tokens, denom, grad_norm, rng, router,
                   trainable=trainable, opt_state=opt_state, grad_buf=grads if use_buf else state.grad_buf)


def _accumulate(model: Decoder, state: TrainState, work, batch: dict, zeros, add: Callable):
    """The scan over micro-batches: (gradient sum, fp8 observations, CE sum, MoE router metrics averaged over the
    micro-batches ({} for a dense model), the next rng). `add(grads, g, i)` folds micro-batch i's gradients into the
    running sum. The router losses are means per micro-batch; weighted by (step tokens / micro-batches) they end up,
    after the step's division by its token count, as their mean over the micro-batches."""
    rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
    n_accum = batch["input_ids"].shape[0]
    router_weight = _token_count(batch)[1] / n_accum
    grad_fn = jax.value_and_grad(
        lambda t, q, mb, r: train_loss(model, state.params, t, mb, r, q, router_weight), argnums=(0, 1), has_aux=True)
    router0 = {k: jnp.zeros((), jnp.float32) for k in ROUTER_METRICS} if model.config.moe_layers else {}

    def micro(carry, xs):
        grads, obs, loss, router = carry
        mb, i = xs
        (_, (_, ce, r)), (g, o) = grad_fn(work, state.quant, mb, jax.random.fold_in(step_rng, i))
        obs = fp8_lib.combine_observations(obs, o)  # amaxes: max over micro-batches, not a sum
        router = {k: router[k] + r[k] for k in router}
        return (add(grads, g, i), obs, loss + ce, router), None  # the step reports CE; the router terms stand apart

    no_obs = jax.tree.map(jnp.zeros_like, state.quant)
    (grads, obs, loss_sum, router), _ = jax.lax.scan(
        micro, (zeros, no_obs, jnp.zeros((), jnp.float32), router0), (batch, jnp.arange(n_accum)))
    return grads, obs, loss_sum, {k: v / n_accum for k, v in router.items()}, rng


def _token_count(batch: dict):
    """(supervised tokens of the step, the loss denominator: at least 1)."""
    n_tokens = jnp.sum(batch["loss_mask"])
    return n_tokens, jnp.maximum(n_tokens, 1.0)


def _finish(state: TrainState, schedule: Callable, margin: float, obs, loss_sum, n_tokens, denom, grad_norm, rng,
            router: dict, **updates):
    """The new state (step, rng, fp8 scales, the non-finite flag and `updates`) and the metrics (MoE: plus the
    router's aux_loss, router_z_loss and expert_load)."""
    quant = fp8_lib.update(state.quant, obs, margin) if state.quant else state.quant
    loss = loss_sum / denom
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "supervised_tokens": n_tokens,
               **{ROUTER_METRICS[k]: v for k, v in router.items()}}
    flag = state.first_nonfinite
    if not isinstance(flag, dict):
        bad = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
        flag = jnp.where((flag == 0) & bad, state.step + 1, flag)
        metrics["first_nonfinite"] = flag  # read with the other metrics: no second transfer where the loop logs
    new = state.replace(step=state.step + 1, rng=jax.random.key_data(rng), quant=quant, first_nonfinite=flag,
                        **updates)
    return new, metrics


def streamer(layout: Layout, trainable) -> Streamer | None:
    """The layer streamer when `layout` streams and the trainable tree has a layer stack."""
    L = num_layers(trainable) if layout.stream else None
    return Streamer(layout, L) if L else None


def forward_weights(model: Decoder, layout: Layout, trainable, st: Streamer):
    """What the forward differentiates under offload_master: full fine-tuning's masters with the
    layer stack as its compute-dtype copy on the device (streamed from the host; the model casts
    every layer weight to that dtype before use, so values and gradients are unchanged; see
    offload.Streamer.working_copy), LoRA adapters as they are."""
    full_ft = model.config.lora is None
    dtype = model.config.dtype if full_ft else None
    if not layout.plan.offload_master:
        return trainable
    return st.working_copy(trainable, dtype, host=True, shard=layout.plan.shard_weights)


def make_eval_step(model: Decoder, layout: Layout | None = None) -> Callable:
    """step(state, batch) -> (loss sum, supervised tokens); the ops per data shard of the layout's mesh."""
    layout = layout or Layout(None)
    model = with_mesh(model, layout.mesh)

    def step(state: TrainState, batch: dict):
        st = streamer(layout, state.trainable)
        work = (layout.fetch_trainable(state.trainable) if st is None
                else forward_weights(model, layout, state.trainable, st))
        state = state.replace(trainable=work)
        return batch_loss(model, state.params, state.trainable, batch, None, state.quant)
    return step


# ---------------------------------------------------------------------------------------------
# Mesh, shardings, placement (the rules live in parallel.py)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, accum_axis: bool) -> NamedSharding:
    rows = tuple(a for a in mesh.axis_names)  # "data", and "expert" under expert parallelism: both split the batch
    return NamedSharding(mesh, P(None, rows) if accum_axis else P(rows))


def global_batch(mesh: Mesh, local: dict, accum_axis: bool) -> dict:
    """Process-local numpy rows -> global jax arrays sharded over the data axis."""
    sharding = batch_sharding(mesh, accum_axis)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k])) for k in BATCH_KEYS}


def abstract_state(tx, params: Any, trainable: Any, quant: Any = None) -> TrainState:
    """ShapeDtypeStructs of the TrainState that init_state builds (no computation)."""
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=jax.tree.map(sds, params),
                      trainable=jax.tree.map(sds, trainable), opt_state=jax.eval_shape(tx.init, trainable),
                      rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
                      quant=jax.tree.map(sds, quant or {}))


def prepare_frozen(model: Decoder, params: Any) -> Any:
    """LoRA under a quantizing recipe: the frozen base with the seven projections' kernels
    quantized once (recipe.cache_frozen_weights). Else `params`. One stacked kernel at a time
    (jitted, its input donated): the device holds the remaining base plus one kernel's cache, not
    the whole base and the whole cache (at 8B that was the run's peak: 24 GB vs a 12 GB step)."""
    cfg = model.config
    if cfg.lora is None or cfg.recipe is None or not cfg.recipe.quantizes or recipe_lib.is_cached(params):
        return params
    jitted = {}

    def cache_one(proj, w):
        if proj not in jitted:
            one = (recipe_lib.cache_experts if proj == recipe_lib.EXPERTS
                   else lambda w: recipe_lib.cache_kernel(cfg.recipe, proj, w, cfg.num_layers))
            jitted[proj] = jax.jit(one, donate_argnums=(0,))
        return jitted[proj](w)

    return recipe_lib.cache_frozen_weights(params, cfg.recipe, cfg.num_layers, cache_one)


def init_state(model: Decoder, tx, params: Any, trainable: Any, seed: int, mesh: Mesh,
               layout: Layout | None = None) -> TrainState:
    """Places the state per `layout` (default: everything replicated on the mesh). The train step
    donates the state, so arrays passed in here may be consumed (device_put onto the same device
    does not copy). The optimizer state is built where it will live (sharded, or in host memory)."""
    layout = layout or Layout(mesh)
    params = prepare_frozen(model, params)
    quant = recipe_lib.init_quant_state(model)
    abstract = abstract_state(tx, params, trainable, quant)
    sh = layout.state_shardings(abstract)
    sh = sh.replace(quant=jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract.quant))  # replicated
    params = jax.device_put(params, sh.params)
    on_device = jax.tree.map(lambda s: s.with_memory_kind("device") if s.memory_kind else s, sh.trainable)
    trainable = jax.device_put(trainable, on_device)
    opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(trainable)
    trainable = jax.device_put(trainable, sh.trainable)  # to pinned_host when offload_master
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), sh.step), params=params, trainable=trainable,
                      opt_state=opt_state, rng=jax.device_put(jax.random.key_data(jax.random.key(seed)), sh.rng),
                      quant=jax.device_put(quant, sh.quant), grad_buf=grad_buffer(layout, abstract.trainable),
                      first_nonfinite=fresh_flag(mesh))


def fresh_flag(mesh: Mesh) -> jax.Array:
    """TrainState.first_nonfinite of a run that has seen only finite steps."""
    return jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))


def grad_buffer(layout: Layout, trainable) -> Any:
    """TrainState.grad_buf: fp32 zeros like `trainable` in pinned_host memory when the layout
    streams with offload_grads (filled from host numpy, never staged on the device), else {}."""
    if not (layout.stream and layout.plan.offload_grads and num_layers(trainable)):
        return {}
    sh = layout.grad_shardings(trainable, host=True)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(
        x.shape, s, lambda idx, x=x: np.zeros(x.shape, np.float32)[idx]), trainable, sh)


def jit_train_step(model, tx, schedule, mesh: Mesh, state: TrainState, layout: Layout | None = None):
    """The jitted step: in/out shardings = the state's own (so ZeRO layouts and host memory kinds
    persist across steps), the batch split over "data", the state donated."""
    step = make_train_step(model, tx, schedule, layout or Layout(mesh))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = {k: batch_sharding(mesh, True) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated(mesh)),
                   donate_argnums=(0,))


# recompute: auto tries these (remat policy, layers unrolled), fastest first; the last is taken whatever it needs.
# H100, LoRA tokens/s: the layer loop's copies make "none" slower than "dots" (0.6B 74.9k vs 76.2k, 8B 13.41k vs
# 13.52k), unrolled "none" is fastest (0.6B 101.7k, 4B 26.1k vs 20.7k); unrolled "full" needs more than the loop's
# "full" (14B bf16 temporaries 30.5 GB), so the loop's "full" is the fallback.
AUTO_REMAT_CHOICES = (("none", True), ("dots", True), ("dots", False), ("full", False))
AUTO_REMAT_HEADROOM = 0.9  # of the free memory: room for what XLA's estimate leaves out (workspaces)


class StepBytes(NamedTuple):
    """XLA's buffer assignment of one call of a compiled step, per device: the bytes it holds (arguments + outputs -
    donated aliases + temporaries), its arguments, and its temporaries (one contiguous allocation)."""

    total: int
    arguments: int
    temp: int


def step_bytes(compiled) -> StepBytes | None:
    """The compiled step's StepBytes; None where XLA gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    g = lambda k: int(getattr(m, k, 0) or 0)
    total = g("argument_size_in_bytes") + g("output_size_in_bytes") - g("alias_size_in_bytes") + g("temp_size_in_bytes")
    return StepBytes(total, g("argument_size_in_bytes"), g("temp_size_in_bytes"))


def device_memory(mesh: Mesh) -> dict | None:
    """The tightest memory figures of this process's devices of `mesh`: bytes_limit, bytes_in_use and (where the
    allocator says) largest_free_block_bytes and pool_bytes; None where the backend reports no limit (CPU)."""
    out: dict = {}
    for d in mesh.devices.flat:
        if d.process_index != jax.process_index():
            continue
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if not out or free < out["bytes_limit"] - out["bytes_in_use"]:
            out = {k: int(stats[k]) for k in ("bytes_limit", "bytes_in_use", "largest_free_block_bytes", "pool_bytes")
                   if k in stats}
            out.setdefault("bytes_in_use", 0)
    return out or None


def step_fits(need: StepBytes, mem: dict) -> bool:
    """Whether a step of `need` runs in `mem` (device_memory's figures, taken while its arguments are allocated):
    its bytes fit AUTO_REMAT_HEADROOM of the limit less what else is in use, and its temporaries fit the largest
    free block (a fragmented pool can hold the bytes but not the one allocation)."""
    if need.total > AUTO_REMAT_HEADROOM * (mem["bytes_limit"] - other_use(need, mem)):
        return False
    return need.temp <= free_block(mem)


def other_use(need: StepBytes, mem: dict) -> int:
    """Device bytes held by anything but the step's own (already allocated) arguments."""
    return max(0, mem["bytes_in_use"] - need.arguments)


def free_block(mem: dict) -> float:
    """The largest allocation `mem` can serve: its largest free block, or a new region where the pool may still grow
    (XLA_PYTHON_CLIENT_PREALLOCATE=false); unbounded where the allocator says neither."""
    block = mem.get("largest_free_block_bytes")
    if block is None:
        return float("inf")
    return max(block, mem["bytes_limit"] - mem["pool_bytes"]) if "pool_bytes" in mem else block


def auto_unroll(cfg: DecoderConfig, unroll: bool | None) -> bool | None:
    """`unroll_layers: auto` for this model: QLoRA on MoE experts keeps the layer loop. Qwen3-30B-A3B NF4 on an H100:
    the unrolled step asked for 116 GB after 2.4 min of compiling, the loop's 31.5 GB. Not traced in the HLO; the
    excess is about what all 48 layers' experts take in bf16 (58 GB), as if XLA kept each layer's dequantized
    experts from the forward for the backward instead of dequantizing again."""
    if unroll is None and cfg.num_experts and cfg.qlora is not None:
        return False
    return unroll


def remat_choices(unroll: bool | None) -> tuple[tuple[str, bool], ...]:
    """The (policy, unrolled) pairs `recompute: auto` tries under `unroll_layers` (None: auto)."""
    if unroll is None:
        return AUTO_REMAT_CHOICES
    return (("none", True), ("dots", True), ("full", True)) if unroll else (("dots", False), ("full", False))


def pick_remat(model, tx, schedule, mesh: Mesh, state: TrainState, layout: Layout, batch: dict,
               memory: dict | None = None, unroll: bool | None = None):
    """(model, compiled step, note) for `recompute: auto`: the first of remat_choices(unroll) whose compiled step
    fits (`step_fits`) the device memory (`memory`: device_memory's figures, default this process's devices' as
    each compilation leaves them: autotuning grows the pool), else the last. batch: arrays or ShapeDtypeStructs (with
    shardings) of one step's batch. Compiles each choice it tries (nothing runs); without known memory figures it
    takes the last choice without trying the others."""
    mem = device_memory(mesh) if memory is None else memory
    # streamed experts are copied in again by the recomputation only: nothing of a layer may be saved
    choices = (("full", False),) if model.config.offload_experts else remat_choices(unroll)
    tried = []
    for policy, unrolled in choices if mem else choices[-1:]:
        m = model.clone(config=model.config.replace(remat_policy=policy, unroll_layers=unrolled))
        compiled = jit_train_step(m, tx, schedule, mesh, state, layout).lower(state, batch).compile()
        if mem and memory is None:
            mem = device_memory(mesh) or mem
        need = step_bytes(compiled)
        fits = mem is not None and need is not None and step_fits(need, mem)
        name = f"{'unrolled' if unrolled else 'loop'} {policy}"
        tried.append(f"{name} {need.total / 1e9:.1f} GB (temp {need.temp / 1e9:.1f})" if need is not None
                     else f"{name} ? GB")
        if fits or (policy, unrolled) == choices[-1]:
            if mem:
                block = free_block(mem)
                others = other_use(need, mem) if need is not None else mem["bytes_in_use"]
                budget = (f"{AUTO_REMAT_HEADROOM:.0%} of {mem['bytes_limit'] / 1e9:.1f} GB less "
                          f"{others / 1e9:.1f} GB in other use"
                          + (f"; largest free block {block / 1e9:.1f} GB" if block != float("inf") else ""))
            else:
                budget = "no device memory limit known"
            return m, compiled, f"recompute auto: {name} (step needs: {', '.join(tried)}; budget {budget})"
    raise AssertionError("unreachable: the last choice is always taken")


def abstract_batch(mesh: Mesh, accum: int, rows: int, seq: int) -> dict:
    """ShapeDtypeStructs of a global step batch [accum, rows, seq] as global_batch builds it."""
    sh = batch_sharding(mesh, True)
    dtype = {"loss_mask": jnp.float32}
    return {k: jax.ShapeDtypeStruct((accum, rows, seq), dtype.get(k, jnp.int32), sharding=sh) for k in BATCH_KEYS}


def jit_eval_step(model, mesh: Mesh, state: TrainState, layout: Layout | None = None):
    step = make_eval_step(model, layout or Layout(mesh))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = {k: batch_sharding(mesh, False) for k in BATCH_KEYS}
    return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=replicated(mesh))
