"""Argument checks every QLoRA format shares (ValueError naming the format and the argument)."""

from __future__ import annotations

import numpy as np


def weight_shape(shape, where: str) -> tuple[int, int]:
    """`shape` as a 2-D [out, in] tuple of positive ints."""
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{where}: a weight shape must be 2-D [out, in] with positive dims, got {shape}")
    return shape


def block_size(size, sizes: tuple[int, ...], where: str) -> int:
    """`size` as an int, one of `sizes` (a bool is not a block size)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size not in sizes:
        raise ValueError(f"{where}: block_size must be one of {sizes}, got {size!r}")
    return int(size)
