"""16-point random Hadamard transform (RHT) for the NVFP4 weight-gradient GEMM.

Convention (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, sec. RHT):
  H = (1/4) * H16 * diag(s)
with H16 the 16x16 Sylvester Hadamard matrix (H16[i, j] = (-1)^popcount(i & j), symmetric,
H16 @ H16 = 16 I) and s a fixed vector of +-1 signs. H is orthogonal (H @ H.T = I). The transform
acts on consecutive blocks of 16 elements along one axis (the GEMM's reduction axis): every block
b (a column vector) becomes H @ b. For dW = X^T dY (reduction over tokens) both X^T and dY^T get
the same H along the token axis, and since H^T H = I the product is unchanged in exact
arithmetic: sum_t (H x)_t (H y)_t = sum_t x_t y_t.

Signs: bit j of the 16-bit `sign_mask` set means s_j = -1. `signs_from_seed(seed)` derives a mask
from an integer seed (numpy PCG64); `DEFAULT_SIGN_MASK` is seed 0's mask. The CUDA quantizer
(kernels/nvfp4_quantize.cu) takes the same mask and computes the same floats.

Floating-point order (fixed, so the fused CUDA kernel reproduces it bit for bit): inputs go to
float32, z = s * x (exact), then four butterfly stages h = 1, 2, 4, 8, each mapping the pair
(z[i], z[i + h]) with i & h == 0 to (z[i] + z[i + h], z[i] - z[i + h]), then a final * 0.25
(exact unless it underflows). The inverse runs the same butterflies on y, multiplies by 0.25 and
then by s. Outputs are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16


def signs_from_seed(seed: int) -> int:
    """A 16-bit sign mask (bit j set: s_j = -1) drawn from numpy's PCG64 with `seed`."""
    bits = np.random.default_rng(np.random.PCG64(int(seed))).integers(0, 2, size=BLOCK)
    return int(sum(int(b) << j for j, b in enumerate(bits)))


DEFAULT_SIGN_MASK = signs_from_seed(0)


def sign_vector(sign_mask: int = DEFAULT_SIGN_MASK) -> np.ndarray:
    """The +-1 diagonal s (float32 [16]) of a sign mask."""
    _check_mask(sign_mask)
    return np.array([-1.0 if (sign_mask >> j) & 1 else 1.0 for j in range(BLOCK)], np.float32)


def hadamard16() -> np.ndarray:
    """The unnormalized 16x16 Sylvester Hadamard matrix H16 (float32, entries +-1)."""
    i = np.arange(BLOCK)
    pop = np.array([int(v).bit_count() for v in (i[:, None] & i[None, :]).ravel()]).reshape(BLOCK, BLOCK)
    return np.where(pop % 2 == 0, 1.0, -1.0).astype(np.float32)


def rht_matrix(sign_mask: int = DEFAULT_SIGN_MASK) -> np.ndarray:
    """H = (1/4) H16 diag(s) as float32 [16, 16] (H @ H.T = I); block b maps to H @ b."""
    return (0.25 * hadamard16() * sign_vector(sign_mask)[None, :]).astype(np.float32)


def _check_mask(sign_mask: int) -> None:
    if not isinstance(sign_mask, (int, np.integer)) or not 0 <= int(sign_mask) < (1 << BLOCK):
        raise ValueError(f"sign_mask must be an int in [0, 2^16), got {sign_mask!r}")


def _butterflies(z: jax.Array) -> jax.Array:
    """H16 @ z for every block on the last axis of z [..., 16] (stages h = 1, 2, 4, 8)."""
    lead = z.shape[:-1]
    for h in (1, 2, 4, 8):
        # index i = (hi, bit, lo) with bit the h-bit: pairs (bit=0, bit=1)
        zz = z.reshape(lead + (BLOCK // (2 * h), 2, h))
        a, b = zz[..., 0, :], zz[..., 1, :]
        z = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (BLOCK,))
    return z


def _blocks(x: jax.Array, axis: int) -> tuple[jax.Array, int]:
    if x.ndim == 0:
        raise ValueError("rht: x must have rank >= 1")
    axis = axis % x.ndim
    if x.shape[axis] % BLOCK:
        raise ValueError(
            f"rht: axis {axis} of x (shape {x.shape}) has length {x.shape[axis]}, "
            f"which is not a multiple of {BLOCK}"
        )
    xf = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    return xf.reshape(xf.shape[:-1] + (xf.shape[-1] // BLOCK, BLOCK)), axis


def rht(x: jax.Array, axis: int = -1, sign_mask: int = DEFAULT_SIGN_MASK) -> jax.Array:
    """Applies H to consecutive blocks of 16 along `axis`; float32 out, same shape as x."""
    _check_mask(sign_mask)
    xb, axis = _blocks(x, axis)
    y = _butterflies(xb * jnp.asarray(sign_vector(sign_mask))) * jnp.float32(0.25)
    return jnp.moveaxis(y.reshape(y.shape[:-2] + (-1,)), -1, axis)


def rht_inverse(y: jax.Array, axis: int = -1, sign_mask: int = DEFAULT_SIGN_MASK) -> jax.Array:
    """Applies H^T = diag(s) H16 / 4 to blocks of 16 along `axis` (undoes `rht`); float32 out."""
    _check_mask(sign_mask)
    yb, axis = _blocks(y, axis)
    x = (_butterflies(yb) * jnp.float32(0.25)) * jnp.asarray(sign_vector(sign_mask))
    return jnp.moveaxis(x.reshape(x.shape[:-2] + (-1,)), -1, axis)
