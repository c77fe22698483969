"""LoRA adapters: spec from config, HF PEFT export/import, merge into the base weights.

The adapters themselves live inside the model (models/llamalike.py `Linear._lora`) in the `lora`
variable collection, shaped like their kernel: A [in..., r], B [r, out...]. PEFT stores
`...q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (torch Linear layout) under
`base_model.model.` + the HF module name, which is what HF PEFT and vLLM load. MoE experts' adapters are stacked
[L, E, in, r] / [L, E, r, out] (models/llamalike.py `_Experts`) and exported one pair per expert, under the expert's
HF module name (`...mlp.experts.5.gate_proj.lora_A.weight`).
"""

from __future__ import annotations

import json
import math
import os
import re
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
from .names import PROJECTIONS, layer_stack_start
from .safetensors_io import CheckpointReader, write_file

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
PEFT_PREFIX = "base_model.model."
# The MoE router (train_router): each stack's kernel [L, D, E] leaves the frozen params for the trainable tree, and
# the PEFT adapter carries it whole, as PEFT saves a `modules_to_save` module (`...layers.L.mlp.gate.weight` [E, D]).
ROUTER = ("mlp", "gate", "kernel")
ROUTER_MODULES = ["gate"]


def _get(tree, path):
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _with(tree: dict, path, value) -> dict:
    """A copy of the nested dict `tree` with `path` set to value (None: removed)."""
    head, *rest = path
    out = dict(tree)
    if rest:
        out[head] = _with(tree.get(head, {}), rest, value)
    elif value is None:
        out.pop(head, None)
    else:
        out[head] = value
    return out


def router_paths(tree: dict) -> list[tuple[str, ...]]:
    """The router kernels' paths in `tree` (params or trainable): one per stack of MoE layers."""
    return [p for k in tree if layer_stack_start(k) is not None and _get(tree, p := (k, *ROUTER)) is not None]


def take_router(params: dict, trainable: dict, dtype) -> tuple[dict, dict]:
    """train_router: the routers move from the frozen params into the trainable tree, as `dtype` masters."""
    for path in router_paths(params):
        trainable = _with(trainable, path, _get(params, path).astype(dtype))
        params = _with(params, path, None)
    return params, trainable


def put_router(params: dict, lora: dict) -> dict:
    """params with the trained routers (when `lora` holds them) back in place, in the params' dtype."""
    for path in router_paths(lora):
        base = _get(params, path)
        dtype = params["embedding"].dtype if base is None else base.dtype  # taken out: the base's unquantized dtype
        params = _with(params, path, _get(lora, path).astype(dtype))
    return params


def lora_spec(cfg: LoraConfig, lora_dtype: str = "fp32") -> LoraSpec | None:
    if not cfg.lora:
        return None
    return LoraSpec(rank=cfg.lora_rank, alpha=float(cfg.lora_alpha), targets=cfg.targets,
                    dropout=float(cfg.lora_dropout), dtype=DTYPES[lora_dtype], train_router=cfg.train_router)


def init_adapters(model: Decoder, rng: jax.Array, example_ids) -> Any:
    """Fresh adapters (A random, B zero) for `model` (whose config carries a LoraSpec)."""
    def init(rng):
        v = model.init({"params": jax.random.key(0), "lora": rng}, example_ids)
        return nn.meta.unbox(v["lora"])

    # Only the lora collection is kept; params are traced abstractly and dropped.
    return jax.jit(init)(rng)


def _entries(lora: Any):
    """(HF module name, A [in..., r], B [r, out...]) per adapted matrix: one per layer, and per expert for MoE."""
    for kp, a in jax.tree_util.tree_flatten_with_path(lora)[0]:
        path = tuple(k.key for k in kp)
        if path[-1] != "lora_a":
            continue
        mod = path[:-1]
        node = lora
        for k in mod:
            node = node[k]
        b = node["lora_b"]
        for idx, module in _slots(mod, a.shape):
            yield module, a[idx], b[idx]


def _slots(mod: tuple[str, ...], a_shape: tuple[int, ...]):
    """(index into the stacked A / B, HF module name) for every matrix an adapter leaf of shape a_shape holds."""
    if names.is_experts(mod):
        return [((i, e), names.hf_name(mod, i, e)[: -len(".weight")])
                for i in range(a_shape[0]) for e in range(a_shape[1])]
    return [((i,), names.hf_name((*mod, "kernel"), i)[: -len(".weight")]) for i in range(a_shape[0])]


def save_peft(out_dir: str | os.PathLike, model: Decoder, lora: Any, *, base_model: str,
              overwrite: bool = False) -> Path:
    """Writes adapter_model.safetensors + adapter_config.json (PEFT LoRA format)."""
    spec = model.config.lora
    out = Path(out_dir)
    host = jax.device_get(lora)
    entries, arrays = [], []
    for path in router_paths(host):
        router = _get(host, path)
        for i in range(router.shape[0]):
            entries.append((PEFT_PREFIX + names.hf_name(path, i), np.dtype(np.float32), router.shape[:0:-1]))
            arrays.append(np.asarray(router[i], np.float32).T)  # [E, D], HF's Linear layout
    for module, a, b in _entries(host):
        stem = PEFT_PREFIX + module
        a_hf = np.asarray(a, np.float32).reshape(-1, spec.rank).T  # [r, in]
        b_hf = np.asarray(b, np.float32).reshape(spec.rank, -1).T  # [out, r]
        for name, arr in ((f"{stem}.lora_A.weight", a_hf), (f"{stem}.lora_B.weight", b_hf)):
            entries.append((name, np.dtype(np.float32), arr.shape))
            arrays.append(arr)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": ROUTER_MODULES if spec.train_router else None,
        "base_model_name_or_path": base_model, "revision": None, "layers_to_transform": None,
    }
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_file(tmp / "adapter_model.safetensors", entries, arrays)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict:
    """adapter_config.json of a PEFT adapter directory, checked to be a plain LoRA we can load: integer
    r > 0, numeric lora_alpha, a list of target modules we adapt, no per-module ranks, layer subsets,
    biases or DoRA/rsLoRA. Anything else raises ModelLoadError naming the file and the field."""
    d = Path(adapter_dir)
    cfg_path = d / "adapter_config.json"
    if not d.is_dir():
        raise ModelLoadError(f"{d}: no such adapter directory")
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e}); re-export the adapter") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ModelLoadError(f"{cfg_path}: only plain LoRA adapters are supported (peft_type LORA, no DoRA/rsLoRA)")
    for field in ("r", "lora_alpha"):
        if field not in cfg:
            raise ModelLoadError(f"{cfg_path}: the required field {field!r} is missing")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ModelLoadError(f"{cfg_path}: r={r!r} must be a positive integer (the LoRA rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ModelLoadError(f"{cfg_path}: lora_alpha={alpha!r} must be a number")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ModelLoadError(f"{cfg_path}: target_modules must be a list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise ModelLoadError(f"{cfg_path}: target_modules {unknown} cannot be adapted; supported: {list(PROJECTIONS)}")
    # Each of these changes which tensors exist or how they combine; merging without them would be wrong.
    for field, plain in (("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
                         ("bias", "none"), ("fan_in_fan_out", False)):
        value = cfg.get(field)
        if value not in (None, plain):
            raise ModelLoadError(f"{cfg_path}: {field}={value!r} is not supported (only {plain!r})")
    if cfg.get("modules_to_save") not in (None, ROUTER_MODULES):
        raise ModelLoadError(f"{cfg_path}: modules_to_save={cfg['modules_to_save']!r} is not supported (only None, or "
                             f"{ROUTER_MODULES!r}: an MoE router trained with train_router)")
    return cfg


def peft_spec(cfg: dict) -> LoraSpec:
    """The LoraSpec of a checked adapter_config.json dict (`read_adapter_config`)."""
    return LoraSpec(rank=cfg["r"], alpha=float(cfg["lora_alpha"]), targets=tuple(sorted(set(cfg["target_modules"]))),
                    train_router=cfg.get("modules_to_save") == ROUTER_MODULES)


def load_peft(adapter_dir: str | os.PathLike, model: Decoder) -> Any:
    """Reads a PEFT LoRA adapter into our `lora` tree for `model` (whose LoraSpec must match).

    Every tensor is checked against the model before anything is copied: a missing or extra tensor,
    another number of layers or another shape (an adapter of another base, or of another rank than
    its adapter_config.json says) raises ModelLoadError naming the tensor and both shapes."""
    d = Path(adapter_dir)
    cfg = read_adapter_config(d)
    cfg_path = d / "adapter_config.json"
    spec = model.config.lora
    if (cfg.get("modules_to_save") == ROUTER_MODULES) != spec.train_router:
        raise ModelLoadError(f"{cfg_path}: modules_to_save={cfg.get('modules_to_save')!r} but the model "
                             f"{'trains' if spec.train_router else 'does not train'} the MoE router (train_router)")
    if cfg["r"] != spec.rank:
        raise ModelLoadError(f"{cfg_path}: r={cfg['r']} but the model expects rank {spec.rank}")
    if set(cfg["target_modules"]) != set(spec.targets):
        raise ModelLoadError(f"{cfg_path}: target_modules={sorted(set(cfg['target_modules']))} but the model "
                             f"expects {sorted(spec.targets)}")
    reader = CheckpointReader(d)
    abstract = jax.eval_shape(lambda: init_adapters(model, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    # name -> (HF shape, leaf index, index into the leaf): lora_A [r, in], lora_B [out, r] per layer (and expert).
    expected: dict[str, tuple[tuple[int, ...], int, tuple[int, ...]]] = {}
    for k, (kp, sds) in enumerate(leaves):
        path = tuple(p.key for p in kp)
        if path[1:] == ROUTER:  # [L, D, E]: HF's [E, D] per layer
            for i in range(sds.shape[0]):
                expected[PEFT_PREFIX + names.hf_name(path, i)] = (sds.shape[:0:-1], k, (i,))
            continue
        for idx, module in _slots(path[:-1], sds.shape):
            one = sds.shape[len(idx):]
            stem = PEFT_PREFIX + module
            if path[-1] == "lora_a":
                expected[f"{stem}.lora_A.weight"] = ((spec.rank, math.prod(one[:-1])), k, idx)
            else:
                expected[f"{stem}.lora_B.weight"] = ((math.prod(one[1:]), spec.rank), k, idx)
    hint = "the adapter was probably trained on another base model; pass the base it was trained on"
    num_layers = model.config.num_layers
    layers = {int(m.group(1)) for n in reader.names() if (m := re.search(r"\.layers\.(\d+)\.", n))}
    if layers and max(layers) + 1 != num_layers:
        raise ModelLoadError(f"{d}: the adapter has tensors for {max(layers) + 1} layers but the base model has "
                             f"{num_layers}; {hint}")
    extra = sorted(set(reader.names()) - set(expected))
    if extra:
        raise ModelLoadError(f"{d}: the adapter holds {len(extra)} tensor(s) the model has no place for "
                             f"(e.g. {extra[0]!r}); {hint}, or with the target_modules its config lists")
    for name, (want, _, _) in expected.items():
        if name not in reader:
            raise ModelLoadError(f"{d}: tensor {name!r} is missing from the adapter (adapter_config.json targets "
                                 f"{sorted(spec.targets)})")
        got = tuple(reader.get(name).shape)
        if got != want:
            rank_dim = 0 if name.endswith("lora_A.weight") else 1
            if len(got) == 2 and got[rank_dim] != spec.rank and got[1 - rank_dim] == want[1 - rank_dim]:
                why = f"its rank is {got[rank_dim]}, not r={spec.rank} as {cfg_path.name} says; fix r there"
            else:
                why = hint
            raise ModelLoadError(f"{d}: tensor {name!r} has shape {list(got)}, the model expects {list(want)}; {why}")
    hosts = [np.empty(sds.shape, sds.dtype) for _, sds in leaves]
    for name, (_, k, idx) in expected.items():
        hosts[k][idx] = reader.get(name).T.reshape(hosts[k].shape[len(idx):])
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(h) for h in hosts])


def merge(params: Any, lora: Any, spec: LoraSpec) -> Any:
    """Base params with W += (alpha / r) A B folded in (fp32 math, base dtype out); stacked MoE experts per expert;
    a router trained under train_router replaces the base's."""
    def merge_one(path, w):
        keys = tuple(k.key for k in path)
        experts = names.is_experts(keys)
        if keys[-1] != "kernel" and not experts:
            return w
        node = lora
        for k in keys if experts else keys[:-1]:
            if not isinstance(node, dict) or k not in node:
                return w
            node = node[k]
        if "lora_a" not in node:  # the trained router (put_router below)
            return w
        a, b = node["lora_a"], node["lora_b"]
        lead, r = a.shape[: 2 if experts else 1], a.shape[-1]
        delta = jnp.einsum("nir,nro->nio", a.reshape(-1, math.prod(a.shape[len(lead):-1]), r).astype(jnp.float32),
                           b.reshape(-1, r, math.prod(b.shape[len(lead) + 1:])).astype(jnp.float32)) * spec.scale
        return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return put_router(jax.tree_util.tree_map_with_path(merge_one, params), lora)


def count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
