"""HF model directories <-> (Decoder, params): `load_pretrained` and `save_pretrained`.

Loading streams: each parameter (for the stacked layer leaves, one [L, ...] group) is filled from
memory-mapped safetensors views into one host buffer of the target dtype, moved to its device or
sharding, and freed before the next, so host memory peaks near one parameter group, never two
copies of the model. Saving streams the other way, one leaf at a time. Everything a user can get
wrong (path, config, truncated or missing files, shapes) raises `ModelLoadError` with the place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .atomic import atomic_directory
from .errors import ModelLoadError
from .models import Decoder, check_hf_config, config_from_hf, config_to_hf
from .models import hf_names as names
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
    slots = range(sds.shape[0]) if names.is_stacked(path) else [None]
    for i in slots:
        name = names.hf_name(path, i)
        shape = sds.shape[1:] if i is not None else sds.shape
        w = reader.get(name)
        want = names.hf_shape(path, shape)
        if w.shape != want:
            raise ModelLoadError(f"{reader.dir}: tensor {name!r} has shape {list(w.shape)}, "
                                 f"config implies {list(want)}")
        if i is None:
            host[...] = names.from_hf(path, w, shape)
        else:
            host[i] = names.from_hf(path, w, shape)
    out = jax.device_put(host, sharding) if sharding is not None else jnp.asarray(host)
    del host
    return out


def load_pretrained(
    path_or_id: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    compute_dtype: Any = None,
    attention_impl: str = "auto",
    remat_policy: str = "none",
    shardings: Any = None,
) -> tuple[Decoder, Any]:
    """Loads an HF Llama 3 / Qwen2.5 / Qwen3 causal LM directory or hub id.

    Args:
      dtype: parameter dtype (weights are converted while streaming).
      compute_dtype: activation / matmul dtype; defaults to `dtype`.
      shardings: optional pytree (like the params) of `jax.sharding.Sharding`s to place each leaf.
    Returns:
      (model, params): `model.apply({"params": params}, input_ids_BT)` gives logits [B, T, vocab].
    """
    model_dir = resolve_model_dir(path_or_id)
    hf_cfg = read_hf_config(model_dir)
    cfg = config_from_hf(
        hf_cfg,
        dtype=jnp.dtype(compute_dtype or dtype),
        param_dtype=jnp.dtype(dtype),
        attention_impl=attention_impl,
        remat_policy=remat_policy,
    )
    model = Decoder(cfg)
    abstract = abstract_params(model)
    reader = CheckpointReader(model_dir)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shard_leaves = treedef.flatten_up_to(shardings) if shardings is not None else [None] * len(leaves)
    loaded = [
        _load_leaf(reader, _leaf_path(kp), sds, sh) for (kp, sds), sh in zip(leaves, shard_leaves, strict=True)
    ]
    used = {names.hf_name(_leaf_path(kp), i) for kp, sds in leaves for i in (
        range(sds.shape[0]) if names.is_stacked(_leaf_path(kp)) else [None])}
    unused = sorted(set(reader.names()) - used)
    if unused:
        log.info("%s: %d checkpoint tensors not used (e.g. %s)", model_dir, len(unused), unused[:3])
    return model, jax.tree_util.tree_unflatten(treedef, loaded)


def _hf_entries(params, save_dtype):
    """(name, dtype, shape, producer) per HF tensor, grouped by our leaf so one leaf is on host at a time."""
    out = []
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = _leaf_path(kp)
        dtype = np.dtype(save_dtype or leaf.dtype)
        stacked = names.is_stacked(path)
        per_layer = leaf.shape[1:] if stacked else leaf.shape
        shape = names.hf_shape(path, per_layer)
        for i in range(leaf.shape[0]) if stacked else [None]:
            out.append((names.hf_name(path, i), dtype, shape, path, leaf, i))
    return out


def _stream(entries):
    host_of, host = None, None
    for _, dtype, _, path, leaf, i in entries:
        if leaf is not host_of:
            host_of, host = leaf, np.asarray(jax.device_get(leaf))
        yield names.to_hf(path, host if i is None else host[i]).astype(dtype, copy=False)


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
