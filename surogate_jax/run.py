"""One training run end to end, shared by `python -m surogate_jax.sft` and `.pretrain`.

config -> checks (model config, output and checkpoint dirs, resume metadata, batch size) ->
output_dir lock -> tokenizer + data -> mesh -> model + weights (HF load, or random init for
pre-training) -> TrainState (or the newest readable checkpoint) -> jitted step loop with logging,
eval, async checkpoints and stop signals -> exports (PEFT adapter, merged model, or full model).
Nothing that exists before the run is overwritten: checkpoints are resumed
(resume_from_checkpoint: true) or refused, files a surogate_jax run did not write are refused, and
exports are written atomically. A non-finite step is never saved; SIGTERM / SIGINT save and stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import parallel as par
from . import train as T
from .atomic import atomic_file, probe_creatable
from .checkpoint import Checkpointer, abstract_like
from .config import ConfigError, SFTConfig
from .errors import ModelLoadError, SurogateError
from .hf import (
    abstract_params,
    checkpoint_qlora,
    dequantize_base,
    is_prequantized,
    load_pretrained,
    read_hf_config,
    resolve_model_dir,
    save_pretrained,
)
from .lock import OutputLock, is_marked
from .lora import DTYPES, count, init_adapters, lora_spec, merge, save_peft, take_router
from .metrics import (
    PlateauWatch,
    RunLogger,
    Throughput,
    check_backends,
    device_peak_flops,
    flops_per_token,
    peak_memory_bytes,
    router_note,
)
from .metrics import truncate as truncate_metrics
from .models import Decoder, config_from_hf, config_to_hf, expert_shape
from .names import EXPERT_PROJECTIONS, QLORA_FORMATS
from .ops import attention as attention_op
from .optim import make_optimizer
from .precision import fp8
from .precision import recipe as recipe_lib
from .qlora import base as qlora_base
from .qlora.base import QloraSpec
from .stop import Interrupted, StopSignals

log = logging.getLogger("surogate_jax")
EXPORTS = ("adapter", "merged", "model")
BATCH_BYTES_PER_TOKEN = 2 * (4 * 4 + 1)  # ids, targets, positions, segments (int32) + mask; stacked copy


def resolve_model(name: str) -> Path:
    if name.startswith("builtin:"):
        from .builtin_models import resolve

        return resolve(name)
    return resolve_model_dir(name)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # missing/corrupt tokenizer files
        raise ModelLoadError(f"{model_dir}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


OWN_FILES = ("config.json", "metrics.jsonl", "summary.json", "training_plot.png")


def check_output(cfg: SFTConfig) -> tuple[Path, Checkpointer]:
    """Checks output_dir and checkpoint_dir before anything is written (nothing is created here):
    both writable; checkpoints only resumed when resume_from_checkpoint allows it; files of ours
    (config.json, metrics.jsonl, ...) that a surogate_jax run did not write are never replaced."""
    out = Path(cfg.run.output_dir)
    for key, d in (("output_dir", out), ("checkpoint_dir", Path(cfg.run.checkpoint_dir or out))):
        _check_writable(key, d)
    ckpt = Checkpointer(cfg.run.checkpoint_dir or out, keep=cfg.run.save_total_limit)
    has_ckpt = ckpt.latest_step() is not None
    if has_ckpt and not cfg.run.resume_from_checkpoint:
        raise ConfigError(f"output_dir {str(out)!r} already holds checkpoints; set resume_from_checkpoint: true "
                          "to continue that run, or use a new output_dir")
    existing = [d for d in EXPORTS if (out / d).exists()]
    if existing and not has_ckpt:
        raise ConfigError(f"output_dir {str(out)!r} already holds {existing}; use a new output_dir")
    foreign = [f for f in OWN_FILES if (out / f).exists()]
    if foreign and not has_ckpt and not is_marked(out):
        raise ConfigError(f"output_dir {str(out)!r} already holds {', '.join(foreign)}, not written by a surogate_jax "
                          "run; use a new output_dir (nothing there was changed)")
    return out, ckpt


def _check_writable(key: str, d: Path) -> None:
    """`d` exists as a writable directory, or can be created (the probe leaves everything as it was)."""
    try:
        probe_creatable(d)
    except NotADirectoryError as e:
        raise ConfigError(f"{key}={str(d)!r} cannot be created: {e.filename!r} is not a directory") from None
    except OSError as e:
        raise ConfigError(f"{key}={str(d)!r} cannot be written ({e.strerror or e})") from None


def check_host_memory(cfg: SFTConfig, n_local_devices: int) -> None:
    """A step's batch is built in host memory: refuse sizes that cannot fit before any work."""
    r = cfg.run
    tokens = r.gradient_accumulation_steps * r.per_device_train_batch_size * n_local_devices * cfg.model.sequence_len
    need = tokens * BATCH_BYTES_PER_TOKEN
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if need > have // 2:
        raise ConfigError(f"per_device_train_batch_size={r.per_device_train_batch_size} x gradient_accumulation_steps="
                          f"{r.gradient_accumulation_steps} x sequence_len={cfg.model.sequence_len} x "
                          f"{n_local_devices} device(s) = {tokens:,} tokens a step need about {need / 1e9:.1f} GB of "
                          f"host memory for the batch alone; this machine has {have / 1e9:.1f} GB: lower them")


def write_json_atomic(path: Path, obj) -> None:
    with atomic_file(path) as f:
        json.dump(obj, f, indent=1, default=str)


def quant_recipe(cfg: SFTConfig) -> recipe_lib.QuantRecipe | None:
    """The precision recipe of the config (None: plain bf16 / model dtype GEMMs)."""
    return recipe_lib.QuantRecipe.from_config(cfg.precision)


def qlora_spec(cfg: SFTConfig, model_dir: Path) -> QloraSpec | None:
    """The QLoRA base format of this run: a pre-quantized checkpoint's own (it needs lora: true, and a qlora_* key,
    if any, must name the same format), else the one the qlora_* keys ask for, else None. Refused before any
    work: QLoRA from scratch (no base to quantize), skip_quant_* layers (they need the exact weights) and an FP8
    base on a GPU below SM89."""
    try:
        pre = checkpoint_qlora(model_dir, read_hf_config(model_dir))
    except ModelLoadError as e:
        raise ConfigError(str(e)) from None
    asked = QloraSpec.from_config(cfg.lora)
    if pre is not None and not cfg.lora.lora:
        raise ConfigError(f"model={cfg.model.model}: a pre-quantized checkpoint ({pre.describe()}) trains only "
                          "adapters over its frozen base: set lora: true")
    if pre is not None and asked is not None and asked.format != pre.format:
        key = next(k for k, f in QLORA_FORMATS.items() if f == asked.format)
        raise ConfigError(f"{key}: model={cfg.model.model} is pre-quantized as {pre.describe()}; remove {key} to "
                          "train over the checkpoint's own format")
    spec = pre or asked
    if spec is not None and cfg.model.from_scratch:
        raise ConfigError("qlora_*: from_scratch starts from random weights; QLoRA needs a pretrained base")
    r = quant_recipe(cfg)
    if spec is not None and r is not None and r.skips:
        raise ConfigError("skip_quant_first_layers / skip_quant_last_layers keep layers' exact weights, which a "
                          f"QLoRA base ({spec.describe()}) does not have; leave them at 0")
    check_qlora_device(spec)
    return spec


def with_recipe(model: Decoder, recipe: recipe_lib.QuantRecipe | None) -> Decoder:
    try:
        return Decoder(model.config.replace(recipe=recipe))
    except ValueError as e:  # e.g. nvfp4 on dims that are not multiples of 16
        raise ConfigError(str(e)) from None


def build_model(cfg: SFTConfig, model_dir: Path, mode: str, layout: par.Layout | None = None):
    """(model, frozen params, trainable) per the config: LoRA, full fine-tuning or from scratch.
    With a layout, pretrained weights stream from disk straight into their final sharding (ZeRO-3:
    no device ever holds the whole model). The model carries the config's precision recipe (for
    LoRA, train.init_state quantizes the frozen base once)."""
    model, params, trainable = _build_model(cfg, model_dir, mode, layout)
    model = Decoder(with_router_weights(cfg, model.config))
    return with_recipe(model, quant_recipe(cfg)), params, trainable


def _build_model(cfg: SFTConfig, model_dir: Path, mode: str, layout: par.Layout | None = None):
    model_dtype = DTYPES[cfg.precision.model_dtype]
    master = DTYPES[cfg.precision.master_dtype or "fp32"]
    remat = par.remat_policy(cfg.run.recompute, cfg.parallel.offload_residual)
    remat = "full" if remat == "auto" else remat  # recompute: auto picks once the step can be compiled (_train)
    spec = lora_spec(cfg.lora, cfg.precision.lora_dtype)
    qspec = qlora_spec(cfg, model_dir)
    if cfg.model.from_scratch:
        dcfg = config_from_hf(read_hf_config(model_dir), dtype=model_dtype, param_dtype=master, remat_policy=remat)
        model = Decoder(dcfg)
        # LoRA on a random base is allowed (odd, but well defined): the base then takes the model dtype
        init = random_init(model, layout, trainable=spec is None, dtype=None if spec is None else model_dtype,
                           zero_projections=cfg.model.init_projections_to_zero)
        params = init(jax.random.key(cfg.run.train_seed))
    elif spec is not None:
        model, params = load_pretrained(model_dir, dtype=model_dtype, remat_policy=remat, qlora=qspec,
                                        shardings=_weight_shardings(model_dir, model_dtype, layout, trainable=False,
                                                                    qlora=qspec))
        if qspec is not None:
            log.info("qlora: %s, quantized %s%s", qspec.describe(),
                     "in the checkpoint" if is_prequantized(read_hf_config(model_dir)) else "while loading",
                     "; each MoE layer dequantizes only the experts that got tokens"
                     if cfg.lora.qlora_selective_expert_dequant else "")
    else:
        model, params = load_pretrained(model_dir, dtype=master, compute_dtype=model_dtype, remat_policy=remat,
                                        shardings=_weight_shardings(model_dir, master, layout, trainable=True))
    if spec is None:
        return model, {}, params
    model = Decoder(model.config.replace(lora=spec, offload_experts=cfg.lora.qlora_offload_experts,
                                         selective_expert_dequant=cfg.lora.qlora_selective_expert_dequant))
    trainable = init_adapters(model, jax.random.key(cfg.run.train_seed + 1), jnp.zeros((1, 1), jnp.int32))
    if spec.train_router:  # the loaded router joins the trained tree (lora.merge / save_peft put it back out)
        params, trainable = take_router(params, trainable, spec.dtype)
    return model, params, trainable


def random_init(model: Decoder, layout: par.Layout | None, *, trainable: bool, dtype=None,
                zero_projections: bool = False):
    """key -> random weights of `model`, jitted with the layout's shardings as its out_shardings, so
    each device computes only its own shard (ZeRO-3 never holds the whole model on one device).
    dtype: cast the weights (a frozen base in the model dtype); zero_projections: o_proj and
    down_proj start at zero (`init_projections_to_zero`)."""
    ids = jnp.zeros((1, 1), jnp.int32)

    def init(key):
        params = nn.meta.unbox(model.init(key, ids)["params"])
        if zero_projections:
            params = jax.tree_util.tree_map_with_path(
                lambda p, x: jnp.zeros_like(x) if any(getattr(k, "key", None) in ("o_proj", "down_proj") for k in p)
                else x, params)
        return params if dtype is None else jax.tree.map(lambda x: x.astype(dtype), params)

    shardings = None
    if layout is not None and layout.mesh is not None:
        shardings = layout.weight_shardings(jax.eval_shape(init, jax.random.key(0)), trainable=trainable)
    return jax.jit(init, out_shardings=shardings)


def _weight_shardings(model_dir: Path, dtype, layout: par.Layout | None, *, trainable: bool,
                      qlora: QloraSpec | None = None):
    if layout is None:
        return None
    abstract = abstract_params(Decoder(config_from_hf(read_hf_config(model_dir), dtype=dtype, param_dtype=dtype,
                                                      qlora=qlora)))
    return layout.weight_shardings(abstract, trainable=trainable)


def check_qlora_device(spec: QloraSpec | None, device=None) -> None:
    """An FP8 base (qlora_fp8 or an FP8 checkpoint) is stored in E4M3, which GPUs below SM89 do not have: refused,
    naming the GPU and the formats that work there."""
    if spec is not None and spec.format == "fp8":
        fp8.check_fp8_supported(device, what="an FP8 QLoRA base (qlora_fp8, or a checkpoint quantized to FP8)",
                                instead="use qlora_bnb (NF4) or qlora_fp4")


def check_moe(cfg: SFTConfig, dcfg) -> None:
    """The mixture-of-experts keys against the model: router loss weights, train_router and ep_size only on an MoE
    model, ep_size dividing its experts; on one, only the fp8-hybrid recipe (without skipped layers)."""
    o, ep = cfg.optim, cfg.parallel.ep_size
    if not dcfg.num_experts:
        set_keys = [k for k in ("router_aux_loss_coef", "router_z_loss_coef") if getattr(o, k)]
        set_keys += ["train_router"] if cfg.lora.train_router else []
        set_keys += [f"ep_size={ep}"] if ep > 1 else []
        if set_keys:
            raise ConfigError(f"{set_keys[0]}: applies to mixture-of-experts models; model={cfg.model.model} is dense "
                              f"({dcfg.model_type}); remove the key")
        return
    what = f"model={cfg.model.model} is a mixture-of-experts model ({dcfg.model_type}, {dcfg.num_experts} experts)"
    recipe = quant_recipe(cfg)
    if recipe is not None:
        try:
            recipe.check_model(dcfg)
        except ValueError as e:
            raise ConfigError(f"{what}: {e}") from None
    if dcfg.num_experts % ep:
        raise ConfigError(f"ep_size={ep}: must divide the {dcfg.num_experts} experts of model={cfg.model.model}")


def check_offload_experts(cfg: SFTConfig, dcfg, qspec: QloraSpec | None) -> None:
    """qlora_offload_experts: a QLoRA base's MoE experts in host memory, each layer copying its own in, in the
    forward and again in the backward's recomputation (so: recompute true or auto, the layers in a loop)."""
    if not cfg.lora.qlora_offload_experts:
        return
    r, why = cfg.run, _no_quantized_experts(cfg, dcfg, qspec)
    if why is None and r.recompute not in (True, "auto", "full"):
        why = ("the backward must recompute each layer from its input (recompute: true or auto, got "
               f"recompute: {r.recompute!r})")
    if why is None and r.unroll_layers is True:
        why = "the layers must run in a loop (unroll_layers: false or auto)"
    if why:
        raise ConfigError(f"qlora_offload_experts: streams a QLoRA base's MoE experts from host memory; {why}")


def _no_quantized_experts(cfg: SFTConfig, dcfg, qspec: QloraSpec | None) -> str | None:
    """Why the run has no quantized MoE experts (a dense model, an unquantized base), or None."""
    if not dcfg.num_experts:
        return f"model={cfg.model.model} is dense ({dcfg.model_type})"
    if qspec is None:
        return "the base is not quantized (no qlora_* key, no pre-quantized checkpoint)"
    return None


def check_selective_expert_dequant(cfg: SFTConfig, dcfg, qspec: QloraSpec | None) -> None:
    """qlora_selective_expert_dequant: each MoE layer dequantizes only the experts that received tokens, so it needs
    MoE layers and a quantized base."""
    if not cfg.lora.qlora_selective_expert_dequant:
        return
    why = _no_quantized_experts(cfg, dcfg, qspec)
    if why:
        raise ConfigError(f"qlora_selective_expert_dequant: dequantizes a QLoRA base's MoE experts that got tokens; "
                          f"{why}")


def with_router_weights(cfg: SFTConfig, dcfg):
    """The decoder config with the run's router loss weights (an MoE model; the model's aux weight by default)."""
    if not dcfg.num_experts:
        return dcfg
    aux = cfg.optim.router_aux_loss_coef
    return dcfg.replace(router_aux_loss_coef=dcfg.router_aux_loss_coef if aux is None else float(aux),
                        router_z_loss_coef=float(cfg.optim.router_z_loss_coef))


def run_meta(cfg: SFTConfig, model_dir: Path, mode: str) -> dict:
    """What a checkpoint must match to be resumed (known before any weight or data is loaded)."""
    hf_cfg = read_hf_config(model_dir)
    dcfg = config_from_hf(hf_cfg)
    arch = config_to_hf(dcfg)
    spec = lora_spec(cfg.lora, cfg.precision.lora_dtype)
    check_moe(cfg, dcfg)
    meta = {"mode": mode, "model": json.dumps(arch, sort_keys=True),
            "lora": None if spec is None else (f"r={spec.rank},alpha={spec.alpha},targets={sorted(spec.targets)}"
                                               + (",train_router" if spec.train_router else "")),
            "sequence_len": cfg.model.sequence_len, "optimizer": cfg.optim.optimizer}
    qspec = qlora_spec(cfg, model_dir)
    check_offload_experts(cfg, dcfg, qspec)
    check_selective_expert_dequant(cfg, dcfg, qspec)
    if qspec is not None:  # the quantized base is not in the checkpoint, but the adapters were trained over it
        meta["qlora"] = qspec.describe()
        ep = cfg.parallel.ep_size
        if ep > 1 and not all(qlora_base.splits_by_expert(qspec.experts(), expert_shape(dcfg, p))
                              for p in EXPERT_PROJECTIONS):
            raise ConfigError(f"ep_size={ep} over this QLoRA base ({qspec.describe()}): its blocks straddle two of "
                              f"model={cfg.model.model}'s experts, so they cannot be split; use ep_size: 1")
    r = quant_recipe(cfg)
    if r is not None and r.quantizes:  # its state / cached base are part of the checkpoint (bf16: key absent)
        meta["recipe"] = f"{r.name},amax_history={r.amax_history},skip={r.skip_first}/{r.skip_last}"
    return meta


def run(cfg: SFTConfig, mode: str = "sft") -> dict:
    """Checks everything that can be checked, then (holding output_dir's lock) tokenizes, builds
    the state, trains and exports. Until the loop starts the run writes nothing but the
    tokenization cache: a run refused on the way leaves output_dir as it found it."""
    with StopSignals() as stop:  # from the start: a SIGTERM during the checks is one line too, not a silent kill
        return _checked_run(cfg, mode, stop)


def _checked_run(cfg: SFTConfig, mode: str, stop: StopSignals) -> dict:
    par.initialize_distributed()  # before anything touches a device
    check_launch(cfg)
    check_backends(cfg.run)
    recipe_lib.check_device(quant_recipe(cfg))  # fp8 below SM89: error naming the GPU; nvfp4: "emulated"
    devices = par.run_devices(cfg.parallel.gpus)
    if len(devices) % cfg.parallel.ep_size:
        raise ConfigError(f"ep_size={cfg.parallel.ep_size}: must divide the run's {len(devices)} device(s) (gpus: "
                          f"{cfg.parallel.gpus})")
    model_dir = resolve_model(cfg.model.model)
    meta = run_meta(cfg, model_dir, mode)  # reads and checks the model's config.json
    out, ckpt = check_output(cfg)
    if ckpt.latest_step() is not None:
        ckpt.check_meta(meta)
    mesh = par.make_mesh(devices, cfg.parallel.ep_size)
    check_host_memory(cfg, sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index()))
    tokenizer = load_tokenizer(model_dir)
    check_exact_match(cfg, tokenizer, model_dir)
    lock = OutputLock(out) if jax.process_index() == 0 else contextlib.nullcontext(_NoLock())
    with lock as held:
        return _train(cfg, mode, model_dir, meta, out, ckpt, mesh, tokenizer, stop, held)


def _train(cfg: SFTConfig, mode: str, model_dir: Path, meta: dict, out: Path, ckpt: Checkpointer, mesh, tokenizer,
           stop: StopSignals, lock) -> dict:
    from .data import BatchLoader, build_datasets

    seq = cfg.model.sequence_len
    train_docs, val_docs = build_datasets(cfg.data, tokenizer, sequence_len=seq, cache_dir=out / "tokenized",
                                          seed=cfg.run.train_seed, mode=mode)
    st = train_docs.stats
    log.info("data: %d documents, %d tokens (%d supervised); %d rows skipped, %d documents truncated to %d tokens",
             st.get("docs", len(train_docs)), st.get("tokens", 0), st.get("supervised_tokens", 0),
             st.get("rows_skipped", 0), st.get("truncated_docs", 0), seq)

    layout = par.Layout(mesh, dataclasses.replace(par.Plan.from_config(cfg.parallel),
                                                  offload_experts=cfg.lora.qlora_offload_experts))
    model, params, trainable = build_model(cfg, model_dir, mode, layout)
    per_process_rows = par.process_local_rows(cfg.run.per_device_train_batch_size, mesh)
    accum = cfg.run.gradient_accumulation_steps
    loader = BatchLoader(train_docs, batch_size=per_process_rows, sequence_len=seq, packing=cfg.data.sample_packing,
                         seed=cfg.run.train_seed, process_index=jax.process_index(), process_count=jax.process_count())
    # packed attention computes only each document's own blocks, for a static bound on a row's segments
    packed = loader.max_segments <= attention_op.MAX_PACKED_SEGMENTS
    model = model.clone(config=model.config.replace(max_segments=loader.max_segments if packed else None))
    steps_per_epoch = max(loader.batches_per_epoch() // accum, 1)
    total = cfg.run.max_steps if cfg.run.max_steps > 0 else cfg.run.num_epochs * steps_per_epoch
    tx, schedule = make_optimizer(cfg.optim, total, mesh=mesh if layout.plan.shard_optimizer else None)
    state = T.init_state(model, tx, params, trainable, cfg.run.train_seed, mesh, layout)
    del params, trainable
    start = 0
    if ckpt.latest_step() is not None:
        restored, data_state, start = ckpt.restore(abstract_like(state))  # without the scratch fields
        state = restored.replace(grad_buf=state.grad_buf, first_nonfinite=state.first_nonfinite)
        loader.restore(data_state)
        log.info("resumed from %s at step %d", ckpt.dir, start)
    n_dev = mesh.devices.size
    log.info("model: %s, %s trainable parameters (%s); %d steps (%d per epoch), %d x %d x %d tokens per step on "
             "%d device(s)",
             model.config.model_type, f"{count(state.trainable):,}", "LoRA" if model.config.lora else "full",
             total, steps_per_epoch, accum, cfg.run.per_device_train_batch_size * n_dev, seq, n_dev)
    unroll = T.auto_unroll(model.config, None if cfg.run.unroll_layers == "auto" else cfg.run.unroll_layers)
    if cfg.run.recompute == "auto" and not cfg.parallel.offload_residual:
        rows = cfg.run.per_device_train_batch_size * n_dev
        model, step_fn, note = T.pick_remat(model, tx, schedule, mesh, state, layout,
                                            T.abstract_batch(mesh, accum, rows, seq), unroll=unroll)
        log.info("%s", note)
    else:
        model = model.clone(config=model.config.replace(unroll_layers=bool(unroll)))
        step_fn = T.jit_train_step(model, tx, schedule, mesh, state, layout)
    log.info("parallel: %s; %d process(es); remat %s, layers %s; attention: %s", layout.describe(),
             jax.process_count(), model.config.remat_policy, "unrolled" if model.config.unroll_layers else "in a loop",
             f"packed, at most {loader.max_segments} segments a row" if packed else
             f"dense same-document mask (rows hold up to {loader.max_segments} segments, over the packed path's "
             f"{attention_op.MAX_PACKED_SEGMENTS})")
    if model.config.recipe is not None:
        log.info("precision: %s", model.config.recipe.describe())

    eval_fn = T.jit_eval_step(model, mesh, state, layout) if val_docs is not None else None
    tokens_per_step = accum * cfg.run.per_device_train_batch_size * n_dev * seq
    flops = flops_per_token(model.config, seq, frozen_base=model.config.lora is not None)
    peak = device_peak_flops()

    lock.commit()  # from here on the run writes its outputs
    if jax.process_index() == 0:
        write_json_atomic(out / "config.json", cfg.to_flat())
    log_dir, log_cfg = log_target(cfg, out)
    dropped = truncate_metrics(log_dir / "metrics.jsonl", start)
    if dropped:
        log.info("metrics.jsonl: dropped %d records after step %d (re-done by this run)", dropped, start)
    logger = RunLogger(log_dir, log_cfg, total_steps=total, start_step=start, config_flat=cfg.to_flat())
    plateau = PlateauWatch()
    last_eval = None
    timer = Throughput()

    def next_batch():
        local = [next(loader) for _ in range(accum)]
        return T.global_batch(mesh, {k: np.stack([b[k] for b in local]) for k in T.BATCH_KEYS}, True)

    try:
        with stop.at_step_boundary():
            batch = next_batch() if start < total else None
            m: dict = {}  # the last logged step's metrics
            for step in range(start, total):
                state, metrics = step_fn(state, batch)  # dispatched: the device runs while the host goes on
                done = step + 1
                data_state, epoch = loader.state(), loader.epoch  # where the data stands after this step
                batch = next_batch() if done < total else None  # the next step's rows, built during this one
                ckpt.check_errors()  # a failed background save stops the run here, not at the next save
                logged = done % cfg.run.logging_steps == 0 or done == total or done == start + 1
                if logged:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    bad = int(m.pop("first_nonfinite"))
                    sec = timer.update(done)  # None until a step after the compiled first one
                    m.update(step=done, epoch=epoch,
                             tokens_per_s=tokens_per_step / sec if sec else None,
                             mfu=flops * tokens_per_step / sec / peak if (peak and sec) else None)
                    logger.log(m)
                    check_finite(bad, ckpt, cfg)
                    logger.progress(done, m)
                    warning = plateau.update(done, m["loss"], m["lr"])
                    if warning:
                        logger.write(f"warning: step {done}: {warning}")
                stopping = stop_agreed(stop, logged)
                if not stopping and eval_fn is not None and cfg.run.eval_steps and (
                        done % cfg.run.eval_steps == 0 or done == total):
                    last_eval = evaluate(eval_fn, state, val_docs, rows=per_process_rows, seq=seq, mesh=mesh)
                    logger.log({"step": done, "eval_loss": last_eval})
                    logger.write(f"step {done}: eval loss {last_eval:.4f}{router_note(m)}")
                if stopping or done % cfg.run.save_steps == 0 or done == total:
                    if not logged:  # never save a non-finite state (a logged step was checked above)
                        check_finite(int(jax.device_get(state.first_nonfinite)), ckpt, cfg)
                    ckpt.save(done, state, data_state, meta)
                if stopping:
                    ckpt.wait()
                    raise Interrupted(stop.signum, f"stopped by {stop.name} after step {done}: checkpoint saved in "
                                                   f"{ckpt.dir}; run the same command to resume")
            ckpt.wait()
    finally:
        logger.close()
        ckpt.close(quiet=True)
    summary = {"steps": total, "output_dir": str(out), "eval_loss": last_eval}
    # Exports read whole arrays: sharded-across-processes or host-offloaded leaves become numpy
    # (collective: every process takes part).
    state = state.replace(params=par.host_view(state.params), trainable=par.host_view(state.trainable), opt_state=None)
    if jax.process_index() == 0:
        summary.update(export(cfg, model, model_dir, state, out))
        if cfg.run.exact_match_file:
            summary["exact_match"] = exact_match_report(cfg, model, state, tokenizer)
    peak_mem = peak_memory_bytes()
    if peak_mem:
        summary["peak_memory_gb"] = peak_mem / 1e9
    if jax.process_index() == 0:
        write_json_atomic(out / "summary.json", summary)
    return summary


class _NoLock:
    """What processes other than 0 hold instead of the output lock (process 0 holds it for the run)."""

    def commit(self) -> None:
        pass


class NonFiniteError(SurogateError):
    """The loss or gradient norm of a step was NaN or infinite; nothing after the last good checkpoint is saved."""


def check_finite(bad: int, ckpt: Checkpointer, cfg: SFTConfig) -> None:
    """Raises NonFiniteError when `bad` (TrainState.first_nonfinite as read on the host: the first step
    with a non-finite loss or gradient norm, 0 for none) names a step."""
    if not bad:
        return
    ckpt.wait()
    last = ckpt.latest_step()
    where = (f"the last good checkpoint is step {last} in {ckpt.dir} (run the same command to resume from it)"
             if last is not None else "no checkpoint was saved")
    raise NonFiniteError(f"the loss or gradient norm is not finite at step {bad} (learning_rate "
                         f"{cfg.optim.learning_rate:g}, max_grad_norm {cfg.optim.max_grad_norm:g}); stopped without "
                         f"saving it: {where}. Lower learning_rate, or check the data around that step")


def stop_agreed(stop: StopSignals, logged: bool) -> bool:
    """Whether every process stops after this step. One process: as soon as a signal came. Several:
    they agree at logged steps (the loop syncs there anyway), since a checkpoint is collective."""
    if jax.process_count() == 1:
        return stop.requested()
    if not logged:
        return False
    from jax.experimental import multihost_utils

    signums = np.asarray(multihost_utils.process_allgather(np.int32(stop.signum or 0)))
    if signums.any() and stop.signum is None:
        stop.signum = int(signums[signums > 0][0])
    return bool(signums.any())


def log_target(cfg: SFTConfig, out: Path):
    """(directory, run config) of this process's RunLogger. Process 0 logs to output_dir; the others
    to distributed.worker_output_dir (Surogate's key) or output_dir/workers/process_<i>, without
    report_to backends, so one run has one metrics.jsonl, plot and W&B run."""
    pid = jax.process_index()
    if pid == 0:
        return out, cfg.run
    d = cfg.parallel.distributed
    where = Path(d.worker_output_dir) if d is not None and d.worker_output_dir else out / "workers"
    where = where / f"process_{pid}"
    where.mkdir(parents=True, exist_ok=True)
    return where, dataclasses.replace(cfg.run, report_to=None)


def check_launch(cfg: SFTConfig) -> None:
    """A `distributed:` block with several nodes needs a multi-process launch (Ray or SLURM)."""
    d = cfg.parallel.distributed
    if d is not None and d.num_nodes > 1 and jax.process_count() == 1:
        raise ConfigError(f"distributed.num_nodes={d.num_nodes} but this is a single process: launch the run with "
                          "`python examples/ray_launch.py <config>` (Ray) or srun (examples/slurm_multinode.sh); "
                          "see README 'Scaling'")


def evaluate(eval_fn, state, docs, *, rows: int, seq: int, mesh) -> float:
    from .data import BatchLoader

    loader = BatchLoader(docs, batch_size=rows, sequence_len=seq, packing=False, seed=0, shuffle=False,
                        process_index=jax.process_index(), process_count=jax.process_count())
    total, n = 0.0, 0.0
    for b in loader.one_pass():
        loss, cnt = eval_fn(state, T.global_batch(mesh, b, False))
        total, n = total + float(loss), n + float(cnt)
    return total / max(n, 1.0)


def unquantized_base(cfg: SFTConfig, model_dir: Path, params, model: Decoder):
    """The frozen base as loaded (for merging / generation) when the state holds the recipe's
    quantized cache: re-read from model_dir (a random from-scratch base cannot be re-read: its
    dequantized cache is used, with a warning). A QLoRA base is re-read too when model_dir holds bf16 weights;
    a pre-quantized checkpoint has no other weights than its quantized ones: those are dequantized."""
    if model.config.qlora is not None:
        if is_prequantized(read_hf_config(model_dir)):
            return dequantize_base(model, params, DTYPES[cfg.precision.model_dtype])[1]
        return load_pretrained(model_dir, dtype=DTYPES[cfg.precision.model_dtype])[1]
    if not recipe_lib.is_cached(params):
        return params
    if cfg.model.from_scratch:
        log.warning("merging into the recipe's quantized copy of the random base (from_scratch): the merged "
                    "weights carry its quantization error")
        plain = model.clone(config=model.config.replace(lora=None, recipe=None, mesh=None))
        shapes = jax.eval_shape(lambda: plain.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
        return recipe_lib.dequantize_cache(params, model.config.recipe, model.config.num_layers, shapes)
    _, base = load_pretrained(model_dir, dtype=DTYPES[cfg.precision.model_dtype])
    return base


def export(cfg: SFTConfig, model: Decoder, model_dir: Path, state, out: Path) -> dict:
    spec = model.config.lora
    base = dataclasses.replace(model.config, lora=None, recipe=None, qlora=None)
    if spec is not None:
        adapter = save_peft(out / "adapter", model, state.trainable, base_model=cfg.model.model, overwrite=True)
        res = {"adapter": str(adapter)}
        if cfg.lora.merge_adapter:
            merged = merge(unquantized_base(cfg, model_dir, state.params, model), state.trainable, spec)
            res["merged"] = str(save_pretrained(out / "merged", Decoder(base), merged, overwrite=True,
                                                copy_side_files_from=model_dir))
        return res
    dtype = DTYPES[cfg.precision.model_dtype]
    params = jax.tree.map(lambda x: x.astype(dtype), state.trainable)
    return {"model": str(save_pretrained(out / "model", Decoder(base.replace(param_dtype=dtype)), params,
                                         overwrite=True, copy_side_files_from=model_dir))}


def exact_match_rows(cfg: SFTConfig) -> list[dict]:
    """The held-out rows the exact-match check uses (config.py checked the file at load)."""
    text = Path(cfg.run.exact_match_file).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()][:cfg.run.exact_match_samples]


def check_exact_match(cfg: SFTConfig, tokenizer, model_dir: Path) -> None:
    """What the exact-match check would refuse after training (no chat template or stop token, a
    prompt plus answer longer than the model's positions), refused before any work."""
    if not cfg.run.exact_match_file:
        return
    from .generate import encode_prompts, split_row, stop_token_ids

    try:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template to render the prompts with")
        stop_token_ids(tokenizer)
        split = [split_row(r, i) for i, r in enumerate(exact_match_rows(cfg))]
        prompt_len = max(len(ids) for ids in encode_prompts(tokenizer, [p for p, _ in split]))
        answer_len = max(len(tokenizer(e, add_special_tokens=False)["input_ids"]) for _, e in split) + 2
    except Exception as e:  # noqa: BLE001 - the user's rows or template (jinja errors included)
        raise ConfigError(f"exact_match_file={cfg.run.exact_match_file}: {e}") from None
    max_pos = read_hf_config(model_dir).get("max_position_embeddings")
    if isinstance(max_pos, int) and prompt_len + answer_len > max_pos:
        raise ConfigError(f"exact_match_file={cfg.run.exact_match_file}: a prompt of {prompt_len} tokens plus an "
                          f"answer of up to {answer_len} exceeds the model's max_position_embeddings={max_pos}")


def exact_match_report(cfg: SFTConfig, model: Decoder, state, tokenizer) -> float:
    from .generate import exact_match

    path = Path(cfg.run.exact_match_file)
    rows = exact_match_rows(cfg)
    spec = model.config.lora
    plain = Decoder(dataclasses.replace(model.config, lora=None, recipe=None, qlora=None))  # generation: unquantized
    params = (merge(unquantized_base(cfg, resolve_model(cfg.model.model), state.params, model), state.trainable, spec)
              if spec is not None else T.variables(model, {}, state.trainable)["params"])
    acc, examples = exact_match(plain, params, tokenizer, rows, max_samples=cfg.run.exact_match_samples)
    log.info("exact match on %d held-out prompts from %s: %.1f%%", len(rows), path.name, 100 * acc)
    for prompt, want, got in examples[:3]:
        log.info("  %r -> %r (expected %r)", prompt, got, want)
    return acc

