"""Our parameter paths <-> HF safetensors tensor names and layouts (shared by every family).

Our modules are named like HF's (`self_attn.q_proj`, `mlp.down_proj`, `input_layernorm`, ...), so the
map is mechanical: stacked `layers/...` leaves (`layers_N/...`: a stack from layer N) hold one HF tensor per
layer (MoE experts: one per layer and expert, stacked [L, E, ...] here as transformers 5 stacks them); kernels
are stored [in..., out...] (JAX's x @ W) where HF stores Linear weights [out, in]; q/k/v kernels split the
output into (heads, head_dim) and o_proj splits its input the same way.
"""

from __future__ import annotations

import math

import numpy as np

from surogate_jax.names import layer_stack_start

Path = tuple[str, ...]


def is_stacked(path: Path) -> bool:
    return layer_stack_start(path[0]) is not None


def is_experts(path: Path) -> bool:
    """A stacked MoE expert weight [L, E, ...] ('layers', 'mlp', 'experts', 'gate_proj'): one HF tensor per layer
    and expert."""
    return len(path) == 4 and is_stacked(path) and path[1:3] == ("mlp", "experts")


def hf_name(path: Path, layer: int | None = None, expert: int | None = None) -> str:
    """('layers', 'self_attn', 'q_proj', 'kernel'), 3 -> 'model.layers.3.self_attn.q_proj.weight';
    ('layers', 'mlp', 'experts', 'up_proj'), 3, 5 -> 'model.layers.3.mlp.experts.5.up_proj.weight'; `layer` counts
    from the stack's first layer (('layers_4', ...), 1 is HF's layer 5)."""
    if is_stacked(path):
        layer += layer_stack_start(path[0])
    if is_experts(path):
        return f"model.layers.{layer}.mlp.experts.{expert}.{path[3]}.weight"
    if path == ("embedding",):
        return "model.embed_tokens.weight"
    if path == ("lm_head",):
        return "lm_head.weight"
    *modules, leaf = path
    suffix = "bias" if leaf == "bias" else "weight"
    if is_stacked(path):
        return ".".join(["model.layers", str(layer), *modules[1:], suffix])
    return ".".join(["model", *modules, suffix])


def hf_slots(path: Path, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
    """(index into our array of `shape`, HF tensor name) for every HF tensor the leaf holds."""
    if is_experts(path):
        return [((i, e), hf_name(path, i, e)) for i in range(shape[0]) for e in range(shape[1])]
    if is_stacked(path):
        return [((i,), hf_name(path, i)) for i in range(shape[0])]
    return [((), hf_name(path))]


def _kernel_in_dims(path: Path) -> int:
    return 2 if path[-2] == "o_proj" else 1


def from_hf(path: Path, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> our layout with `shape` (the per-layer shape for stacked leaves, per expert for experts')."""
    if path[-1] == "kernel" or path == ("lm_head",) or is_experts(path):
        return w.T.reshape(shape)
    return w.reshape(shape)


def to_hf(path: Path, x: np.ndarray) -> np.ndarray:
    """Our (per-layer) array -> HF tensor layout."""
    if path == ("lm_head",) or is_experts(path):
        return x.T
    if path[-1] == "kernel":
        n_in = _kernel_in_dims(path)
        rows = math.prod(x.shape[:n_in])
        return x.reshape(rows, -1).T
    if path[-1] == "bias":
        return x.reshape(-1)
    return x


def hf_shape(path: Path, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for one of our (per-layer) shapes."""
    return to_hf(path, np.empty(shape, np.uint8)).shape
