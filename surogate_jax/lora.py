"""LoRA adapters: spec from config, HF PEFT export/import, merge into the base weights.

The adapters themselves live inside the model (models/llamalike.py `Linear._lora`) in the `lora`
variable collection, shaped like their kernel: A [in..., r], B [r, out...]. PEFT stores
`...q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (torch Linear layout) under
`base_model.model.` + the HF module name, which is what HF PEFT and vLLM load.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .atomic import atomic_directory
from .config import LoraConfig
from .errors import ModelLoadError
from .models import Decoder, LoraSpec
from .models import hf_names as names
from .safetensors_io import CheckpointReader, write_file

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
PEFT_PREFIX = "base_model.model."


def lora_spec(cfg: LoraConfig, lora_dtype: str = "fp32") -> LoraSpec | None:
    if not cfg.lora:
        return None
    return LoraSpec(rank=cfg.lora_rank, alpha=float(cfg.lora_alpha), targets=cfg.targets,
                    dropout=float(cfg.lora_dropout), dtype=DTYPES[lora_dtype])


def init_adapters(model: Decoder, rng: jax.Array, example_ids) -> Any:
    """Fresh adapters (A random, B zero) for `model` (whose config carries a LoraSpec)."""
    def init(rng):
        v = model.init({"params": jax.random.key(0), "lora": rng}, example_ids)
        return nn.meta.unbox(v["lora"])

    # Only the lora collection is kept; params are traced abstractly and dropped.
    return jax.jit(init)(rng)


def _entries(lora: Any):
    """(path to the projection, layer index, A [in..., r], B [r, out...]) per adapted matrix."""
    for kp, a in jax.tree_util.tree_flatten_with_path(lora)[0]:
        path = tuple(k.key for k in kp)
        if path[-1] != "lora_a":
            continue
        mod = path[:-1]
        node = lora
        for k in mod:
            node = node[k]
        b = node["lora_b"]
        for i in range(a.shape[0]):  # stacked over layers
            yield mod, i, a[i], b[i]


def _hf_module(mod: tuple[str, ...], layer: int) -> str:
    return names.hf_name((*mod, "kernel"), layer)[: -len(".weight")]


def save_peft(out_dir: str | os.PathLike, model: Decoder, lora: Any, *, base_model: str,
              overwrite: bool = False) -> Path:
    """Writes adapter_model.safetensors + adapter_config.json (PEFT LoRA format)."""
    spec = model.config.lora
    out = Path(out_dir)
    host = jax.device_get(lora)
    entries, arrays = [], []
    for mod, i, a, b in _entries(host):
        stem = PEFT_PREFIX + _hf_module(mod, i)
        a_hf = np.asarray(a, np.float32).reshape(-1, spec.rank).T  # [r, in]
        b_hf = np.asarray(b, np.float32).reshape(spec.rank, -1).T  # [out, r]
        for name, arr in ((f"{stem}.lora_A.weight", a_hf), (f"{stem}.lora_B.weight", b_hf)):
            entries.append((name, np.dtype(np.float32), arr.shape))
            arrays.append(arr)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "base_model_name_or_path": base_model, "revision": None, "layers_to_transform": None,
    }
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_file(tmp / "adapter_model.safetensors", entries, arrays)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def load_peft(adapter_dir: str | os.PathLike, model: Decoder) -> Any:
    """Reads a PEFT LoRA adapter into our `lora` tree for `model` (whose LoraSpec must match)."""
    d = Path(adapter_dir)
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: not a PEFT adapter directory (no adapter_config.json)")
    cfg = json.loads(cfg_path.read_text())
    spec = model.config.lora
    if cfg.get("r") != spec.rank:
        raise ModelLoadError(f"{cfg_path}: r={cfg.get('r')} but the model expects rank {spec.rank}")
    reader = CheckpointReader(d)
    abstract = jax.eval_shape(lambda: init_adapters(model, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    def fill(kp, sds):
        path = tuple(k.key for k in kp)
        mod, leaf = path[:-1], path[-1]
        out = np.empty(sds.shape, sds.dtype)
        for i in range(sds.shape[0]):
            stem = PEFT_PREFIX + _hf_module(mod, i)
            if leaf == "lora_a":
                out[i] = reader.get(f"{stem}.lora_A.weight").T.reshape(sds.shape[1:])
            else:
                out[i] = reader.get(f"{stem}.lora_B.weight").T.reshape(sds.shape[1:])
        return jnp.asarray(out)
    return jax.tree_util.tree_map_with_path(fill, abstract)


def merge(params: Any, lora: Any, spec: LoraSpec) -> Any:
    """Base params with W += (alpha / r) A B folded in (fp32 math, base dtype out)."""
    def merge_one(path, w):
        keys = tuple(k.key for k in path)
        if keys[-1] != "kernel":
            return w
        node = lora
        for k in keys[:-1]:
            if not isinstance(node, dict) or k not in node:
                return w
            node = node[k]
        a, b = node["lora_a"], node["lora_b"]
        L, r = a.shape[0], a.shape[-1]
        delta = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32),
                           b.reshape(L, r, -1).astype(jnp.float32)) * spec.scale
        return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return jax.tree_util.tree_map_with_path(merge_one, params)


def count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
