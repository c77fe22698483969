"""Pre-quantized HF checkpoints for tests: a model directory rewritten with its seven projections quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from surogate_jax.names import PROJECTIONS
from surogate_jax.qlora import fp8_block
from surogate_jax.safetensors_io import CheckpointReader, write_file

FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def fp8_parts(w: np.ndarray, block: int = 128) -> dict[str, np.ndarray]:
    """A weight [out, in] as the fine-grained FP8 parts HF stores ({'weight', 'weight_scale_inv'})."""
    q = fp8_block.quantize(jnp.asarray(w), block_size=block)
    return fp8_block.to_hf({k: np.asarray(v) for k, v in q.items()}, w.shape, block_size=block)


def write_prequantized(src: Path, dst: Path, parts_of, quantization_config: dict) -> Path:
    """dst: src with each projection weight stored as `parts_of(w)` ({suffix: array}), config.json's
    quantization_config set, and src's other files (tokenizer, ...) copied."""
    reader = CheckpointReader(src)
    entries, arrays = [], []
    for name in reader.names():
        w = reader.get(name)
        if any(f".{p}.weight" in name for p in PROJECTIONS):
            named = {f"{name.removesuffix('.weight')}.{k}": a for k, a in parts_of(w.astype(np.float32)).items()}
        else:
            named = {name: w}
        for n, a in named.items():
            entries.append((n, a.dtype, a.shape))
            arrays.append(a)
    dst.mkdir(parents=True)
    write_file(dst / "model.safetensors", entries, iter(arrays))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    return dst
