"""HF model directories <-> (Decoder, params): `load_pretrained` and `save_pretrained`.

Loading streams: each parameter (for the stacked layer leaves, one [L, ...] group) is filled from
memory-mapped safetensors views into one host buffer of the target dtype, moved to its device or
sharding, and freed before the next, so host memory peaks near one parameter group, never two
copies of the model. Saving streams the other way, one leaf at a time. Everything a user can get
wrong (path, config, truncated or missing files, shapes) raises `ModelLoadError` with the place.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .atomic import atomic_directory
from .errors import ModelLoadError
from .models import Decoder, check_hf_config, config_from_hf, config_to_hf, expert_shape, projection_shape
from .models import hf_names as names
from .names import FP8_BLOCK_SIZES
from .qlora import base as qlora_base
from .qlora.base import QloraSpec
from .safetensors_io import NAMES, CheckpointReader, write_file

log = logging.getLogger("surogate_jax")

# Files worth carrying next to exported weights (tokenizer, chat template, generation defaults).
SIDE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|.*\.model|"
    r"generation_config\.json|chat_template\.(jinja|json))$"
)


def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """A local directory as is; `org/name` through huggingface_hub (safetensors and json only)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"{p}: not a model directory (expected a folder with config.json)")
        return p
    s = str(path_or_id)
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", s) and not s.startswith("."):
        try:
            from huggingface_hub import snapshot_download

            return Path(
                snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
            )
        except Exception as e:  # network, auth, unknown repo: all one user-facing failure
            raise ModelLoadError(
                f"{s}: no such local directory, and downloading it from the Hugging Face hub failed "
                f"({type(e).__name__}: {e}); pass a local directory when offline"
            ) from None
    raise ModelLoadError(f"{s}: no such directory")


def read_hf_config(model_dir: Path) -> dict:
    """config.json of a model directory as a dict whose family and sizes are known to be usable
    (ModelLoadError naming the file, the field and the value otherwise)."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir}: not a model directory (no config.json)")
    try:
        d = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object")
    check_hf_config(d, str(cfg_path))
    return d


def abstract_params(model: Decoder) -> Any:
    """Shapes/dtypes of the parameter tree (no allocation)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return nn.meta.unbox(variables["params"])


def _leaf_path(key_path) -> tuple[str, ...]:
    return tuple(k.key for k in key_path)


def _load_leaf(reader: CheckpointReader, path, sds, sharding) -> jax.Array:
    host = np.empty(sds.shape, sds.dtype)
    for idx, name in names.hf_slots(path, sds.shape):
        shape = sds.shape[len(idx):]
        w = reader.get(name)
        want = names.hf_shape(path, shape)
        if w.shape != want:
            raise ModelLoadError(f"{reader.dir}: tensor {name!r} has shape {list(w.shape)}, "
                                 f"config implies {list(want)}")
        host[idx] = names.from_hf(path, w, shape)
    out = jax.device_put(host, sharding) if sharding is not None else jnp.asarray(host)
    del host
    return out


def is_prequantized(hf_cfg: dict) -> bool:
    """Whether config.json declares quantized weights (`checkpoint_qlora` says which format, or refuses it)."""
    return hf_cfg.get("quantization_config") is not None


def checkpoint_qlora(model_dir: Path, hf_cfg: dict) -> QloraSpec | None:
    """The QLoRA base format of a pre-quantized checkpoint (config.json's `quantization_config`), or None for a
    plain one. Reads bitsandbytes 4-bit NF4 (its block size from the first layer's quant state) and fine-grained
    FP8 with square tiles; any other format is a ModelLoadError naming it."""
    if not is_prequantized(hf_cfg):
        return None
    qc = hf_cfg["quantization_config"]
    where = model_dir / "config.json"
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method == "bitsandbytes":
        if not qc.get("load_in_4bit") or qc.get("bnb_4bit_quant_type", "fp4") != "nf4":
            raise ModelLoadError(f"{where}: a bitsandbytes checkpoint that is not 4-bit NF4 (load_in_4bit="
                                 f"{qc.get('load_in_4bit')}, bnb_4bit_quant_type={qc.get('bnb_4bit_quant_type')!r}); "
                                 "we read 4-bit NF4 bitsandbytes checkpoints and fine-grained fp8 ones")
        from .qlora import nf4  # noqa: PLC0415

        reader = CheckpointReader(model_dir)
        name = names.hf_name(("layers", "self_attn", "q_proj", "kernel"), 0)
        shape = projection_shape(config_from_hf(hf_cfg), "q_proj")
        _, block, dq = nf4.from_hf(_prefixed(reader, name, _NF4_PARTS), shape)
        moe_dq = False if dq and config_from_hf(hf_cfg).num_experts else None  # see _stacked_experts
        return QloraSpec("nf4", block, dq, expert_double_quant=moe_dq)
    if method == "fp8":
        bs = qc.get("weight_block_size")
        if not (isinstance(bs, list) and len(bs) == 2 and bs[0] == bs[1] and bs[0] in FP8_BLOCK_SIZES):
            raise ModelLoadError(f"{where}: quantization_config.weight_block_size={bs!r}: we read square tiles of "
                                 f"{list(FP8_BLOCK_SIZES)} ([128, 128] in the Qwen3 FP8 checkpoints)")
        return QloraSpec("fp8", bs[0])
    raise ModelLoadError(f"{where}: quantization_config.quant_method={method!r} is not a format we read; we read "
                         "bitsandbytes 4-bit NF4 (quant_method bitsandbytes) and fine-grained FP8 (quant_method fp8)")


_NF4_PARTS = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
              "weight.quant_state.bitsandbytes__nf4")


def _prefixed(reader: CheckpointReader, weight_name: str, parts: tuple[str, ...]) -> dict[str, np.ndarray]:
    """{part: tensor} of one quantized weight, e.g. 'weight.absmax' -> '<module>.weight.absmax' (parts the
    checkpoint lacks are left out: the format's reader says which it needs)."""
    module = weight_name.removesuffix(".weight")
    have = set(reader.names())
    return {p: reader.get(f"{module}.{p}") for p in parts if f"{module}.{p}" in have}


def _load_quantized(reader: CheckpointReader, parent, sds: dict, spec: QloraSpec, shape: tuple[int, int],
                    prequantized: bool, quantize, shardings: dict, used: set,
                    experts: int = 0) -> dict[str, jax.Array]:
    """One projection's stacked QLoRA parameters [L, ...]: per layer, either the checkpoint's quantized parts or
    its bf16/fp32 weight quantized on the default device (`quantize`, jitted); host memory holds one layer's
    weight plus the stacked quantized parts, never the stacked bf16 weights. experts > 0: an MoE projection, the
    layer's per-expert tensors stacked into one [experts * out, in] weight (qlora.base.expert_weights)."""
    L = next(iter(sds.values())).shape[0]
    host = {k: np.empty(s.shape, s.dtype) for k, s in sds.items()}
    for i in range(L):
        name = names.hf_name(parent, i, 0) if experts else names.hf_name((*parent, "kernel"), i)
        if prequantized and experts:
            parts = _stacked_experts(reader, parent, i, experts, shape, spec, used)
        elif prequantized:
            fmt = qlora_base.format_module(spec.format)
            if spec.format == "nf4":
                got = _prefixed(reader, name, _NF4_PARTS)
                try:
                    parts, block, dq = fmt.from_hf(got, shape)
                except ValueError as e:
                    raise ModelLoadError(f"{reader.dir}: {name}: {e}") from None
                if (block, dq) != (spec.block_size, spec.double_quant):
                    raise ModelLoadError(f"{reader.dir}: {name}: blocks of {block}, double quantization {dq}; layer 0"
                                         f" has {spec.block_size}, {spec.double_quant} (one format per checkpoint)")
            else:
                got = _prefixed(reader, name, ("weight", "weight_scale_inv"))
                try:
                    parts = fmt.from_hf(got, shape, spec.block_size)
                except ValueError as e:
                    raise ModelLoadError(f"{reader.dir}: {name}: {e}") from None
            used.update(f"{name.removesuffix('.weight')}.{p}" for p in got)
        else:
            one = (shape[0] // experts, shape[1]) if experts else shape
            each = [names.hf_name(parent, i, e) for e in range(experts)] if experts else [name]
            ws = []
            for n in each:
                w = reader.get(n)
                if tuple(w.shape) != one:
                    raise ModelLoadError(f"{reader.dir}: tensor {n!r} has shape {list(w.shape)}, config implies "
                                         f"{list(one)}")
                ws.append(w)
            parts = quantize(ws[0] if len(ws) == 1 else np.concatenate(ws))
            used.update(each)
        for k in host:
            host[k][i] = np.asarray(parts[k])
    out = {}
    for k, h in host.items():
        sh = shardings.get(k)
        out[k] = jax.device_put(h, sh) if sh is not None else jnp.asarray(h)
    return out


def _stacked_experts(reader: CheckpointReader, parent, layer: int, experts: int, shape: tuple[int, int],
                     spec: QloraSpec, used: set) -> dict[str, np.ndarray]:
    """A layer's per-expert pre-quantized tensors as one stacked [experts * out, in] weight, exactly. Fine-grained
    FP8: the experts' weights and scale tiles are rows of the stacked weight's when out is a multiple of the tile.
    bitsandbytes NF4: the codes and blocks concatenate; under double quantization each expert has its own offset,
    which one stacked weight cannot hold, so the experts' absmax is stored in fp32 as bnb dequantizes it
    (`spec.double_quant` off: QloraSpec.expert_double_quant)."""
    out, inp = shape[0] // experts, shape[1]
    first = names.hf_name(parent, layer, 0)
    if spec.format == "fp8" and out % spec.block_size:
        raise ModelLoadError(f"{reader.dir}: {first}: experts of {out} rows are not whole {spec.block_size}-row scale "
                             "tiles; such an FP8 checkpoint cannot be stacked exactly")
    fmt = qlora_base.format_module(spec.format)
    each = []
    for e in range(experts):
        name = names.hf_name(parent, layer, e)
        got = _prefixed(reader, name, _NF4_PARTS if spec.format == "nf4" else ("weight", "weight_scale_inv"))
        try:
            if spec.format == "nf4":
                parts, block, dq = fmt.from_hf(got, (out, inp))
                if block != spec.block_size:
                    raise ValueError(f"blocks of {block}; layer 0 has {spec.block_size} (one format per checkpoint)")
                if dq:
                    parts = {"nf4_codes": parts["nf4_codes"], "nf4_absmax": np.asarray(fmt.double_quant_absmax(parts))}
            else:
                parts = fmt.from_hf(got, (out, inp), spec.block_size)
        except ValueError as err:
            raise ModelLoadError(f"{reader.dir}: {name}: {err}") from None
        each.append(parts)
        used.update(f"{name.removesuffix('.weight')}.{p}" for p in got)
    if set(each[0]) != set(qlora_base.param_names(spec)):
        raise ModelLoadError(f"{reader.dir}: {first}: the experts hold {sorted(each[0])}, the model expects "
                             f"{sorted(qlora_base.param_names(spec))}")
    return {k: np.concatenate([p[k] for p in each]) for k in each[0]}


def load_pretrained(
    path_or_id: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    compute_dtype: Any = None,
    attention_impl: str = "auto",
    remat_policy: str = "none",
    shardings: Any = None,
    qlora: QloraSpec | None = None,
) -> tuple[Decoder, Any]:
    """Loads an HF Llama 3 / Qwen2.5 / Qwen3 / Qwen3-MoE causal LM directory or hub id.

    Args:
      dtype: parameter dtype (weights are converted while streaming).
      compute_dtype: activation / matmul dtype; defaults to `dtype`.
      shardings: optional pytree (like the params) of `jax.sharding.Sharding`s to place each leaf.
      qlora: store the seven projections of every layer in this QLoRA format, quantized one layer's weight at a
        time on the default device while loading. A pre-quantized checkpoint (bitsandbytes NF4, fine-grained
        FP8: `checkpoint_qlora`) loads in its own format whatever this says, unless it names another format
        (ModelLoadError).
    Returns:
      (model, params): `model.apply({"params": params}, input_ids_BT)` gives logits [B, T, vocab].
    """
    model_dir = resolve_model_dir(path_or_id)
    hf_cfg = read_hf_config(model_dir)
    pre = checkpoint_qlora(model_dir, hf_cfg)
    if pre is not None and qlora is not None and qlora.format != pre.format:
        raise ModelLoadError(f"{model_dir}: the checkpoint is pre-quantized as {pre.describe()}; a {qlora.format} "
                             f"base was asked for (leave the qlora_* keys off to train over the checkpoint's format)")
    qlora = pre or qlora
    cfg = config_from_hf(
        hf_cfg,
        dtype=jnp.dtype(compute_dtype or dtype),
        param_dtype=jnp.dtype(dtype),
        attention_impl=attention_impl,
        remat_policy=remat_policy,
        qlora=qlora,
    )
    model = Decoder(cfg)
    abstract = abstract_params(model)
    reader = CheckpointReader(model_dir)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shard_leaves = treedef.flatten_up_to(shardings) if shardings is not None else [None] * len(leaves)
    qnames = set(qlora_base.param_names(qlora)) if qlora is not None else set()
    loaded, used, groups = [None] * len(leaves), set(), {}
    for idx, ((kp, sds), sh) in enumerate(zip(leaves, shard_leaves, strict=True)):
        path = _leaf_path(kp)
        if path[-1] in qnames:
            groups.setdefault(path[:-1], {})[path[-1]] = (idx, sds, sh)
            continue
        loaded[idx] = _load_leaf(reader, path, sds, sh)
        used.update(name for _, name in names.hf_slots(path, sds.shape))
    quantize = jax.jit(lambda w: qlora_base.quantize(qlora, w)) if qlora is not None else None
    for n, (parent, group) in enumerate(groups.items(), 1):
        t0 = time.perf_counter()
        experts = cfg.num_experts if names.is_experts(parent) else 0
        spec = qlora
        if experts:
            E, out, inp = expert_shape(cfg, parent[-1])
            shape, spec = (E * out, inp), qlora.experts()
        else:
            shape = projection_shape(cfg, parent[-1])
        arrays = _load_quantized(reader, parent, {k: g[1] for k, g in group.items()}, spec, shape, pre is not None,
                                 quantize, {k: g[2] for k, g in group.items()}, used, experts)
        for k, (idx, _, _) in group.items():
            loaded[idx] = arrays[k]
        log.info("qlora: %s %s (%d/%d) in %.1f s", "read" if pre is not None else "quantized", "/".join(parent),
                 n, len(groups), time.perf_counter() - t0)
    unused = sorted(set(reader.names()) - used)
    if unused:
        log.info("%s: %d checkpoint tensors not used (e.g. %s)", model_dir, len(unused), unused[:3])
    return model, jax.tree_util.tree_unflatten(treedef, loaded)


def dequantize_base(model: Decoder, params: Any, dtype: Any = None) -> tuple[Decoder, Any]:
    """A QLoRA model's frozen base as a plain one: (model without `qlora`, params whose seven projections are
    `kernel` leaves again, dequantized into `dtype` (default: the model's param dtype)). One stacked projection
    at a time; a plain model comes back unchanged."""
    cfg = model.config
    if cfg.qlora is None:
        return model, params
    plain = Decoder(cfg.replace(qlora=None))
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    shapes = {_leaf_path(kp): sds for kp, sds in jax.tree_util.tree_flatten_with_path(abstract_params(plain))[0]}
    qnames = set(qlora_base.param_names(cfg.qlora))

    def convert(tree, path=()):
        if not isinstance(tree, dict):
            return tree
        if qnames & set(tree) and names.is_experts(path):  # [L, E, in, out] from [L] x the [E * out, in] weight
            E, out, inp = expert_shape(cfg, path[-1])

            def one(q):
                return jnp.swapaxes(qlora_base.expert_weights(cfg.qlora.experts(), q, (E, out, inp), dtype), 1, 2)

            return jax.jit(jax.vmap(one))({k: tree[k] for k in qnames & set(tree)})
        if qnames & set(tree):
            kernel = shapes[(*path, "kernel")]
            per_layer = kernel.shape[1:] if names.is_stacked((*path, "kernel")) else kernel.shape
            n_in = 2 if path[-1] == "o_proj" else 1
            one = functools.partial(qlora_base.base_kernel, cfg.qlora, in_shape=per_layer[:n_in],
                                    out_shape=per_layer[n_in:], dtype=dtype)
            q = {k: tree[k] for k in qnames}
            fn = jax.jit(jax.vmap(one) if names.is_stacked((*path, "kernel")) else one)
            return {**{k: v for k, v in tree.items() if k not in qnames}, "kernel": fn(q)}
        return {k: convert(v, (*path, k)) for k, v in tree.items()}

    return plain, convert(nn.meta.unbox(params))


def _hf_entries(params, save_dtype):
    """(name, dtype, shape, producer) per HF tensor, grouped by our leaf so one leaf is on host at a time."""
    out = []
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = _leaf_path(kp)
        dtype = np.dtype(save_dtype or leaf.dtype)
        for idx, name in names.hf_slots(path, leaf.shape):
            out.append((name, dtype, names.hf_shape(path, leaf.shape[len(idx):]), path, leaf, idx))
    return out


def _stream(entries):
    host_of, host = None, None
    for _, dtype, _, path, leaf, idx in entries:
        if leaf is not host_of:
            host_of, host = leaf, np.asarray(jax.device_get(leaf))
        yield names.to_hf(path, host[idx]).astype(dtype, copy=False)


def save_pretrained(
    out_dir: str | os.PathLike,
    model: Decoder,
    params: Any,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
    copy_side_files_from: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes config.json + safetensors (sharded with an index above `max_shard_bytes`) that
    transformers' `AutoModelForCausalLM.from_pretrained` loads. The directory is assembled in a
    temporary sibling and renamed into place, so a failure never leaves a half-written model; an
    existing non-empty `out_dir` is refused unless `overwrite=True`."""
    out = Path(out_dir).expanduser()
    cfg = model.config
    if cfg.qlora is not None:
        raise ValueError("save_pretrained writes plain weights; this model's base is QLoRA-quantized "
                         f"({cfg.qlora.describe()}): merge or dequantize it first (lora.merge)")
    params = nn.meta.unbox(params)
    entries = _hf_entries(params, dtype)
    save_np = entries[0][1]
    hf_cfg = {**config_to_hf(cfg), "torch_dtype": _torch_dtype_name(save_np)}

    shards, current, size = [], [], 0
    for e in entries:
        nbytes = int(np.prod(e[2])) * e[1].itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    shards.append(current)

    with atomic_directory(out, overwrite=overwrite) as tmp:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            total += write_file(tmp / fname, [(n, d, s) for n, d, s, *_ in shard], _stream(shard))
            weight_map.update({e[0]: fname for e in shard})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        if copy_side_files_from is not None:
            for f in Path(copy_side_files_from).iterdir():
                if f.is_file() and SIDE_FILES.match(f.name):
                    shutil.copy2(f, tmp / f.name)
    return out


def _torch_dtype_name(dtype: np.dtype) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(NAMES[np.dtype(dtype)], "float32")
