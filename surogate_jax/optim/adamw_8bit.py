"""8-bit AdamW: bitsandbytes-compatible blockwise dynamic quantization of both Adam moments.

Algorithm (Dettmers et al. 2021, arXiv 2110.02861; bitsandbytes `AdamW8bit`, blockwise kernels;
see ../shared/reference/peers_and_algorithms.md 4a). Per parameter tensor with n >= min_8bit_size
elements, flattened row-major into blocks of `block_size` (256) elements:

  state   m codes uint8 [param shape] over the SIGNED dynamic map, m absmax f32 [n_blocks];
          v codes uint8 [param shape] over the UNSIGNED dynamic map, v absmax f32 [n_blocks].
  step t (t = count + 1), lr = schedule(count), all math in float32:
    g  = grad * gscale                              (gscale: folded global-norm clip, else 1)
    m0 = code_s[qm] * absmax_m,  v0 = code_u[qv] * absmax_v           (dequantize)
    m  = b1 * m0 + (1 - b1) * g,  v = b2 * v0 + ((1 - b2) * g) * g    (moments)
    absmax_m' = max |m| over the block, absmax_v' = max v over the block
    p' = (p - step * (m / (sqrt(v) + eps_hat))) * decay
         step = lr * sqrt(1 - b2^t) / (1 - b1^t), eps_hat = eps * sqrt(1 - b2^t)  (bias correction
         folded into the step), decay = 1 - lr * weight_decay (1 where the mask says no decay)
    qm' = nearest code to m * (1 / absmax_m'), qv' likewise (0 where the block's absmax is 0)
  Elements whose scaled gradient is NaN/Inf are skipped: their parameter, m and v keep their
  values (m and v are re-quantized against the block's new absmax). bitsandbytes zeroes such
  elements' moments instead; keeping them means one bad step does not wipe the optimizer.
Tensors with fewer than `min_8bit_size` (4096) elements, and leaves selected by `fp32_mask`, keep
fp32 m and v and run the same update without quantization.

Dynamic maps (bitsandbytes `create_dynamic_map`): 256 sorted codes in [-1, 1] from 7 decimal
"exponent" levels; level i contributes the midpoints of equal steps on [0.1, 1], scaled by
10^(i-6): 2^i of them (and their negatives) for the signed map, 2^(i+1) for the unsigned one,
plus 0 and 1.0. Computed here in float64 and rounded once to float32 (bitsandbytes computes in
float32; values agree to ~1 ulp, code indices are interchangeable).

"Nearest code" is defined exactly as q = searchsorted(mid, x, side="left") over the 255 float32
midpoints between consecutive codes (ties go to the lower code), followed by the sign guard of the
reference: a negative m whose nearest code is >= 0 (that is the code 0.0) moves one code down, to
the smallest negative code, so the sign of m survives (a tiny positive m may still round to 0.0).
`quantize` finds it with a bucket lookup on the float bits plus at most SEARCH_STEPS comparisons;
the kernel with one probe of finer buckets (`lookup_np` is its numpy twin); both are exactly
searchsorted (tests/optim checks every midpoint, its neighbours and every bucket edge).

Bit-exactness: the CUDA kernel (kernels/adamw_8bit.cu) and this reference do the same float32
operations in the same order with IEEE rounding (the kernel uses __fmul_rn/__fadd_rn/__fdiv_rn/
__fsqrt_rn). XLA, on CPU and GPU, contracts a product feeding an add into one FMA, which changes
the rounding; `_pin` stops that by passing each such product through an integer OR with a runtime
zero (derived from the step counter), which no compiler can see through. The per-step scalars are
computed once in JAX and handed to the kernel, so they match too. Remaining differences: XLA's
CPU runtime flushes float32 denormals to zero, the kernel keeps them (only gradients below ~1e-19
or moments below ~1e-38 ever see one).

State layout: the absmax of a tensor of shape S is stored as S[:j] + (prod(S[j:]) / 256,), j the
largest index with prod(S[j:]) a multiple of 256 (e.g. [L, D, F] -> [L, D, F/256]): the same flat
blocks in the same order (a reshape of bitsandbytes' [n_blocks]), but blocks never cross the
leading dims, so the absmax can be split along those dims like the codes (ZeRO, below). A tensor
whose size is not a multiple of 256 keeps a flat [n_blocks] absmax (its last block is padded).

ZeRO (parallel.py shards optimizer state along the largest dim divisible by the "data" axis): given
the `mesh` the state is sharded over, with n > 1 devices on its "data" axis, each 8-bit leaf is
updated inside `jax.shard_map` on its own shard: g, p and the codes split along that dim
(parallel.zero_spec's rule, the same for params, grads and state), the absmax along the matching
dim of its layout. No optimizer state is gathered. A leaf whose blocks would straddle shards (the
sharded dim lies inside a block, e.g. [L, 16, 128, 1024] split 8 ways along 1024: 128 elements per
row per shard) is updated unsharded, with one logged line (XLA then gathers its state).
`mesh=None` (one device, or DDP, where the state is replicated and sharding the update would
all-gather it afterwards) updates whole leaves.

Public API:
  adamw_8bit(learning_rate, b1, b2, eps, weight_decay, block_size, *, mask, min_8bit_size,
             fp32_mask, impl, mesh) -> FusedGradientTransformation
  (apply_fused / chain_clip, the protocol the train step calls, live in optim/fused.py.)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ..ops._loader import resolve_impl
from ..zero import DATA, zero_spec
from .fused import FusedGradientTransformation

_log = logging.getLogger("surogate_jax")

TARGET = "surogate_adamw_8bit_update"
BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096
KERNEL_BLOCK_SIZE = 256  # the CUDA kernel handles this block size; others run the reference
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Layout of the per-tensor float32 scalars handed to the update (reference and kernel alike).
B1, OMB1, B2, OMB2, STEP, EPS_HAT, DECAY, GSCALE, T = range(9)
N_SCALARS = 9


# ---------------------------------------------------------------------------------------------
# Dynamic quantization maps


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 codes of bitsandbytes' dynamic map (7 exponent levels)."""
    vals = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        bounds = np.linspace(0.1, 1.0, n + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0 * 10.0 ** (i - 6)
        vals.extend(means)
        if signed:
            vals.extend(-means)
    code = np.sort(np.asarray(vals, np.float64)).astype(np.float32)
    assert code.shape == (256,) and np.unique(code).size == 256
    return code


def midpoints(code: np.ndarray) -> np.ndarray:
    """The 255 float32 midpoints between consecutive codes (the nearest-code boundaries)."""
    c = code.astype(np.float64)
    return ((c[:-1] + c[1:]) / 2.0).astype(np.float32)


CODE_S = dynamic_map(True)
CODE_U = dynamic_map(False)
MID_S = midpoints(CODE_S)
MID_U = midpoints(CODE_U)
ZERO_S = int(np.flatnonzero(CODE_S == 0.0)[0])  # 127: the signed map's 0.0
ZERO_U = 0
# quantize's midpoints with an inf sentinel (its forward steps never run past the end)
MID_S_INF = np.append(MID_S, np.inf).astype(np.float32)
MID_U_INF = np.append(MID_U, np.inf).astype(np.float32)
# The negative half of the signed map mirrors the positive half (the search below relies on it).
assert ZERO_S == 127 and np.array_equal(CODE_S[:127], -CODE_S[254:127:-1])

# The reference's nearest-code search without a binary search: the float bits of t = |x| (exponent
# and top BUCKET_BITS mantissa bits, from 2^-25 up to [1, 2)) pick a bucket; GUESS_*[b] = number of
# midpoints below the bucket's lower edge, a lower bound of the answer; a few steps forward over
# the midpoints finish it. SEARCH_STEPS is the most midpoints any bucket holds, so the result is
# exactly searchsorted (checked in the tests too).
BUCKET_BITS = 6
BUCKET_E0 = 102  # biased exponent of 2^-25, below every nonzero midpoint
N_BUCKETS = (127 - BUCKET_E0 + 1) << BUCKET_BITS  # 1664


def _guess_table(mid: np.ndarray) -> tuple[np.ndarray, int]:
    b = np.arange(N_BUCKETS, dtype=np.uint32)
    edges = ((b + (BUCKET_E0 << BUCKET_BITS)) << (23 - BUCKET_BITS)).view(np.float32).copy()
    edges[0] = 0.0  # bucket 0 also takes every t below 2^-25
    guess = np.searchsorted(mid, edges, side="left")
    upper = np.append(edges[1:], np.float32(2.0))
    steps = int((np.searchsorted(mid, upper, side="right") - guess).max())
    return guess.astype(np.uint8), steps


GUESS_S, _STEPS_S = _guess_table(MID_S)
GUESS_U, _STEPS_U = _guess_table(MID_U)
SEARCH_STEPS = max(_STEPS_S, _STEPS_U)  # 2 with 6 bucket bits
assert np.all(MID_S[:127] < 0) and MID_S[127] > 0 and MID_U[0] > 2.0**-25

# The kernel's one-probe lookup: with LOOKUP_BITS_S / _U mantissa bits per bucket
# every bucket holds at most one midpoint, so searchsorted(mid, t) = (midpoints below the bucket)
# + (the bucket's midpoint < t); inside a bucket float order is the integer order of the low
# 23 - bits mantissa bits. Entry: below << (low + 1) | low bits of the midpoint (1 << low when the
# bucket holds none, larger than any t's low bits). `lookup_np` below is the kernel's arithmetic.
LOOKUP_BITS_S, LOOKUP_BITS_U = 6, 7


def _lookup_table(mid: np.ndarray, bits: int) -> np.ndarray:
    low = 23 - bits
    n = (127 - BUCKET_E0 + 1) << bits
    b = np.arange(n, dtype=np.uint32)
    edges = ((b + (BUCKET_E0 << bits)) << low).view(np.float32).copy()
    edges[0] = 0.0
    below = np.searchsorted(mid, edges, side="left").astype(np.uint32)
    pos = mid[mid > 0]
    mb = (pos.view(np.uint32) >> low).astype(np.int64) - (BUCKET_E0 << bits)
    assert mb.min() > 0 and mb.max() < n - 1 and np.bincount(mb, minlength=n).max() == 1, "one midpoint per bucket"
    thr = np.full(n, 1 << low, np.uint32)
    thr[mb] = pos.view(np.uint32) & np.uint32((1 << low) - 1)
    return (below << np.uint32(low + 1)) | thr


LOOKUP_S = _lookup_table(MID_S, LOOKUP_BITS_S)  # uint32 [1664]
LOOKUP_U = _lookup_table(MID_U, LOOKUP_BITS_U)  # uint32 [3328]


def lookup_np(x: np.ndarray, signed: bool) -> np.ndarray:
    """The kernel's nearest-code lookup (quantize_signed / quantize_unsigned in the .cu) in numpy."""
    x = np.asarray(x, np.float32)
    bits = LOOKUP_BITS_S if signed else LOOKUP_BITS_U
    table = LOOKUP_S if signed else LOOKUP_U
    low = 23 - bits
    tb = np.abs(x).view(np.uint32).astype(np.int64)
    b = np.clip((tb >> low) - (BUCKET_E0 << bits), 0, table.size - 1)
    e = table[b].astype(np.int64)
    neg = (x < 0).astype(np.int64) if signed else 0
    q = (e >> (low + 1)) + ((e & ((2 << low) - 1)) < (tb & ((1 << low) - 1)) + neg)
    if signed:
        q = np.where(x < 0, np.clip(254 - q, 0, ZERO_S - 1), q)
    return q.astype(np.uint8)


def _kernel_aux() -> np.ndarray:
    """uint32 [5504]: the kernel's tables, codes then lookups (layout in kernels/adamw_8bit.h)."""
    codes = np.concatenate([CODE_S, CODE_U]).astype(np.float32).view(np.uint32)
    aux = np.concatenate([codes, LOOKUP_S, LOOKUP_U]).astype(np.uint32)
    assert aux.size == 5504
    return aux


KERNEL_AUX = _kernel_aux()


def quantize(x: jax.Array, signed: bool) -> jax.Array:
    """Index (uint8) of the nearest code to x in [-1, 1]: exactly searchsorted(mid, x, "left")
    (ties to the lower code), then the signed map's sign guard (a negative x never maps to 0.0)."""
    mid = jnp.asarray(MID_S_INF if signed else MID_U_INF)
    guess = jnp.asarray(GUESS_S if signed else GUESS_U)
    t = jnp.abs(x)
    bits = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(t, jnp.uint32), jnp.uint32(23 - BUCKET_BITS))
    b = jnp.clip(bits.astype(jnp.int32) - (BUCKET_E0 << BUCKET_BITS), 0, N_BUCKETS - 1)
    q = guess[b].astype(jnp.int32)
    neg = (x < 0) if signed else jnp.zeros(x.shape, bool)
    for _ in range(SEARCH_STEPS):
        m = mid[q]
        q = q + ((m < t) | (neg & (m == t))).astype(jnp.int32)
    if signed:
        # x < 0: searchsorted(mid, x) = 254 - searchsorted(mid, |x|, "right") by the mirror symmetry
        q = jnp.where(neg, jnp.maximum(254 - q, 0), q)
        q = jnp.where(neg & (q >= ZERO_S), q - 1, q)  # the sign guard
    return q.astype(jnp.uint8)


def dequantize(q: jax.Array, signed: bool) -> jax.Array:
    return jnp.asarray(CODE_S if signed else CODE_U)[q.astype(jnp.int32)]


# ---------------------------------------------------------------------------------------------
# State


class QuantizedMoment(NamedTuple):
    """One 8-bit moment of one tensor: codes shaped like the parameter, one absmax per block."""

    codes: jax.Array  # uint8 [param shape]
    absmax: jax.Array  # float32 [ceil(n / block_size)]

    def zero_specs(self, path, n: int):
        """(codes spec, absmax spec) when ZeRO over n devices splits this moment with whole blocks
        on each shard, else None (parallel.Layout then applies its rule to each part)."""
        specs = shard_specs(path, tuple(self.codes.shape), n)
        return specs if isinstance(specs, tuple) else None


class Adam8bitState(NamedTuple):
    """count: int32 []; mu / nu: trees shaped like the params whose leaves are either a float32
    array (fp32 path) or a QuantizedMoment (8-bit path)."""

    count: jax.Array
    mu: Any
    nu: Any


def n_blocks(size: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-size // block_size)


def absmax_split(shape: tuple[int, ...], block_size: int = BLOCK_SIZE) -> int | None:
    """j: the largest index with prod(shape[j:]) a multiple of block_size (blocks never cross the
    dims before j); None when the size is not a multiple (flat absmax, padded last block)."""
    for j in range(len(shape) - 1, -1, -1):
        if int(np.prod(shape[j:])) % block_size == 0:
            return j
    return None


def absmax_shape(shape: tuple[int, ...], block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    """Shape of a tensor's absmax: shape[:j] + (prod(shape[j:]) / block_size,) (see the docstring)."""
    shape = tuple(int(d) for d in shape)
    j = absmax_split(shape, block_size)
    if j is None:
        return (n_blocks(int(np.prod(shape)), block_size),)
    return shape[:j] + (int(np.prod(shape[j:])) // block_size,)


def state_bytes(state: Adam8bitState) -> int:
    """Bytes held by the optimizer state (count excluded)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.mu, state.nu)))


# ---------------------------------------------------------------------------------------------
# The update math, shared by the fp32 path and the 8-bit reference


def _salt(scalars: jax.Array) -> jax.Array:
    """A uint32 zero that only exists at run time: the sign bit of t = float(count + 1) >= 1."""
    return jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(scalars[T], jnp.uint32), jnp.uint32(31))


def _pin(x: jax.Array, salt: jax.Array) -> jax.Array:
    """x, rounded to float32 here: an integer OR with a run-time zero hides the product from the
    compiler, so XLA cannot contract it into an FMA with the add that consumes it."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) | salt, jnp.float32)


def _moments(gs, m0, v0, s, salt):
    m = _pin(s[B1] * m0, salt) + _pin(s[OMB1] * gs, salt)
    v = _pin(s[B2] * v0, salt) + _pin((s[OMB2] * gs) * gs, salt)
    return m, v


def _param(pf, m, v, s, salt):
    return (pf - _pin(s[STEP] * (m / (jnp.sqrt(v) + s[EPS_HAT])), salt)) * s[DECAY]


def update_fp32_ref(g, p, m, v, scalars):
    """fp32-state update of one tensor -> (p', m', v'). g, p any float dtype; m, v float32."""
    salt = _salt(scalars)
    gs = g.astype(jnp.float32) * scalars[GSCALE]
    ok = jnp.isfinite(gs)
    pf = p.astype(jnp.float32)
    m1, v1 = _moments(gs, m, v, scalars, salt)
    m1 = jnp.where(ok, m1, m)
    v1 = jnp.where(ok, v1, v)
    p1 = jnp.where(ok, _param(pf, m1, v1, scalars, salt), pf)
    return p1.astype(p.dtype), m1, v1


def update_8bit_ref(g, p, qm, qv, am, av, scalars, block_size: int = BLOCK_SIZE):
    """8-bit update of one tensor -> (p', qm', qv', am', av'); the kernel's exact twin.

    g, p: [shape] float; qm, qv: uint8 [shape]; am, av: float32 with n_blocks elements (any shape,
    flat blocks in row-major order, see absmax_shape); scalars: f32 [9]."""
    shape, n, nb = p.shape, p.size, am.size
    am_shape = am.shape
    am, av = am.reshape(-1), av.reshape(-1)
    pad = nb * block_size - n

    def blocks(x, fill):
        x = x.reshape(-1)
        if pad:
            x = jnp.concatenate([x, jnp.full((pad,), fill, x.dtype)])
        return x.reshape(nb, block_size)

    def unblock(x):
        return x.reshape(-1)[:n].reshape(shape)

    salt = _salt(scalars)
    gs = blocks(g, 0).astype(jnp.float32) * scalars[GSCALE]
    ok = jnp.isfinite(gs)
    pf = blocks(p, 0).astype(jnp.float32)
    m0 = dequantize(blocks(qm, ZERO_S), True) * am[:, None]
    v0 = dequantize(blocks(qv, ZERO_U), False) * av[:, None]
    m, v = _moments(gs, m0, v0, scalars, salt)
    m = jnp.where(ok, m, m0)
    v = jnp.where(ok, v, v0)
    am1 = jnp.max(jnp.abs(m), axis=1)
    av1 = jnp.max(v, axis=1)
    p1 = jnp.where(ok, _param(pf, m, v, scalars, salt), pf).astype(p.dtype)
    inv_m = jnp.where(am1 > 0, 1.0 / am1, 0.0)
    inv_v = jnp.where(av1 > 0, 1.0 / av1, 0.0)
    qm1 = quantize(m * inv_m[:, None], True)
    qv1 = quantize(v * inv_v[:, None], False)
    return unblock(p1), unblock(qm1), unblock(qv1), am1.reshape(am_shape), av1.reshape(am_shape)


def _update_8bit_ffi(g, p, qm, qv, am, av, scalars):
    """The CUDA kernel (block_size KERNEL_BLOCK_SIZE only, checked by the caller)."""
    out = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (p, qm, qv, am, av))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential",
                            input_output_aliases={1: 0, 2: 1, 3: 2, 4: 3, 5: 4})
    return call(g, p, qm, qv, am, av, scalars, jnp.asarray(KERNEL_AUX))


def update_8bit(g, p, qm, qv, am, av, scalars, block_size: int = BLOCK_SIZE, *, impl: str | None = None):
    """8-bit update of one tensor: the CUDA kernel on GPU (in place when the buffers are donated),
    `update_8bit_ref` elsewhere (impl: None/"auto", "ffi" or "ref"; see ops/_loader.py)."""
    impl = resolve_impl(impl)
    kernel_ok = block_size == KERNEL_BLOCK_SIZE and p.dtype in KERNEL_DTYPES and g.dtype in KERNEL_DTYPES
    if impl != "ref" and not kernel_ok:
        if impl == "ffi":
            raise ValueError(f"adamw_8bit: impl='ffi' needs block_size={KERNEL_BLOCK_SIZE} and float32/"
                             f"bfloat16/float16 params and grads, got {block_size}, {p.dtype}, {g.dtype}")
        impl = "ref"
    ref = functools.partial(update_8bit_ref, block_size=block_size)
    if impl == "ref":
        return ref(g, p, qm, qv, am, av, scalars)
    if impl == "ffi":
        return _update_8bit_ffi(g, p, qm, qv, am, av, scalars)
    return jax.lax.platform_dependent(g, p, qm, qv, am, av, scalars, cuda=_update_8bit_ffi, default=ref)


# ---------------------------------------------------------------------------------------------
# The optax transform


def _distinct_buffers(tree):
    """Outside jit: make sure no two leaves share a device buffer (an eagerly built state may hold
    the same zeros array twice, e.g. through a cached constant, and donating it then fails)."""
    seen = set()

    def one(x):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        try:
            key = tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
        except Exception:  # noqa: BLE001 (no pointer for this array kind: fall back to identity)
            key = (id(x),)
        if key in seen or id(x) in seen:
            x = jnp.array(x, copy=True)
        seen.add(key)
        seen.add(id(x))
        return x

    return jax.tree.map(one, tree)


_LOGGED: set[str] = set()


def _log_once(msg: str, level: int = logging.INFO) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        _log.log(level, msg)


def shard_specs(path, shape: tuple[int, ...], n: int, block_size: int = BLOCK_SIZE):
    """How a ZeRO-sharded 8-bit leaf is updated per shard: (codes spec, absmax spec), None when the
    leaf is replicated (nothing to split), or "straddle" when its blocks would cross shards.

    The codes (and g, p) follow parallel.zero_spec: the largest dim d divisible by n. The absmax,
    shaped S[:j] + (R,), splits along d when d < j, along its last dim when d == j and n divides R
    (each shard then holds whole blocks); otherwise blocks straddle shards."""
    spec = zero_spec(path, tuple(shape), n)
    if spec == P():
        return None
    d = len(spec) - 1
    j = absmax_split(tuple(shape), block_size)
    if j is None or d > j or (d == j and absmax_shape(tuple(shape), block_size)[j] % n):
        return "straddle"
    return spec, P(*([None] * d), DATA)


def _increment(count):
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


def _broadcast_mask(mask, params, default: bool):
    """A bool per param leaf from None, a bool, a tree (or prefix) of bools, or a callable."""
    if mask is None:
        return jax.tree.map(lambda _: default, params)
    if callable(mask):
        mask = mask(params)
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, params)


def adamw_8bit(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    block_size: int = BLOCK_SIZE,
    *,
    mask: Any = None,
    min_8bit_size: int = MIN_8BIT_SIZE,
    fp32_mask: Any = None,
    impl: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> FusedGradientTransformation:
    """8-bit AdamW (see the module docstring) as an optax GradientTransformation.

    learning_rate: a float or a schedule count -> lr (called with the step count before the
      increment, as optax does).
    mask: where decoupled weight decay applies, like optax.adamw's `mask` (a tree or prefix of
      bools, or a callable params -> such a tree); None = everywhere.
    min_8bit_size: tensors with fewer elements keep fp32 moments (bitsandbytes: 4096).
    fp32_mask: True for leaves that keep fp32 moments whatever their size (e.g. norms, biases,
      or embeddings as HF Trainer does for bitsandbytes); None = none.
    impl: the 8-bit update's implementation (None/"auto": CUDA kernel on GPU, reference elsewhere).
    mesh: the mesh whose "data" axis the optimizer state is ZeRO-sharded over: with > 1 devices
      there, each 8-bit leaf is updated per shard (see the module docstring). None: whole leaves,
      for one device or replicated state as in DDP (a sharded update would all-gather its outputs).

    `update` returns updates (new_param - param in the param dtype; adding them back gives
    new_param exactly when it is within a factor 2 of param, else up to one rounding) so the
    transform chains like any optax one; `fused_update` / `apply_fused` write the parameters
    directly, which is what the train step uses. Needs `params` in both.
    """
    if block_size <= 0:
        raise ValueError(f"adamw_8bit: block_size must be > 0, got {block_size}")
    if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
        raise ValueError(f"adamw_8bit: b1 and b2 must be in [0, 1), got {b1}, {b2}")
    f32 = np.float32
    consts = (f32(b1), f32(1.0) - f32(b1), f32(b2), f32(1.0) - f32(b2))
    n_data = 1 if mesh is None else dict(mesh.shape).get(DATA, 1)
    if n_data <= 1:
        mesh = None

    def is_8bit(p, keep_fp32: bool) -> bool:
        return (not keep_fp32) and p.size >= min_8bit_size and p.size > 0

    def init(params):
        keep = _broadcast_mask(fp32_mask, params, False)

        def moments(p, k):
            if not is_8bit(p, k):  # two distinct buffers: the state may be donated
                return jnp.zeros(p.shape, jnp.float32), jnp.zeros(p.shape, jnp.float32)
            ams = absmax_shape(p.shape, block_size)
            return (QuantizedMoment(jnp.full(p.shape, ZERO_S, jnp.uint8), jnp.zeros(ams, jnp.float32)),
                    QuantizedMoment(jnp.full(p.shape, ZERO_U, jnp.uint8), jnp.zeros(ams, jnp.float32)))

        outer = jax.tree.structure(params)
        both = [moments(p, k) for p, k in zip(outer.flatten_up_to(params), outer.flatten_up_to(keep), strict=True)]
        return _distinct_buffers(Adam8bitState(count=jnp.zeros([], jnp.int32), mu=outer.unflatten([b[0] for b in both]),
                                               nu=outer.unflatten([b[1] for b in both])))

    def scalars_fn(count_inc, lr, decays: bool, grad_scale):
        t = count_inc.astype(jnp.float32)
        bc1 = 1.0 - jnp.power(consts[0], t)
        sq = jnp.sqrt(1.0 - jnp.power(consts[2], t))
        step = lr * sq / bc1
        decay = 1.0 - lr * f32(weight_decay) if decays and weight_decay != 0.0 else jnp.float32(1.0)
        gs = jnp.float32(1.0) if grad_scale is None else grad_scale
        parts = [*consts, step, f32(eps) * sq, decay, gs, t]
        return jnp.stack([jnp.asarray(x, jnp.float32) for x in parts])

    def fused_update(grads, state, params, grad_scale=None):
        if params is None:
            raise ValueError(optax.NO_PARAMS_MSG if hasattr(optax, "NO_PARAMS_MSG")
                             else "adamw_8bit needs the current params in update()")
        count_inc = _increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, jnp.float32)
        if grad_scale is not None:
            grad_scale = jnp.asarray(grad_scale, jnp.float32)
        decays = _broadcast_mask(mask, params, True)
        scalars = {d: scalars_fn(count_inc, lr, d, grad_scale) for d in (False, True)}

        one_leaf = functools.partial(update_8bit, block_size=block_size, impl=impl)

        def leaf(path, g, p, mu, nu, d):
            s = scalars[bool(d)]
            if isinstance(mu, QuantizedMoment):
                args = (g, p, mu.codes, nu.codes, mu.absmax, nu.absmax, s)
                plan = shard_specs(path, p.shape, n_data, block_size) if mesh is not None else None
                if plan == "straddle":
                    _log_once(f"adamw_8bit: {jax.tree_util.keystr(path)} {tuple(p.shape)}: its 256-blocks would "
                              f"straddle the {n_data} ZeRO shards; updated unsharded (its state is gathered)",
                              logging.WARNING)
                    plan = None
                if plan is None:
                    p1, qm, qv, am, av = one_leaf(*args)
                else:
                    spec, am_spec = plan
                    p1, qm, qv, am, av = jax.shard_map(
                        lambda *a: tuple(one_leaf(*a)), mesh=mesh,
                        in_specs=(spec, spec, spec, spec, am_spec, am_spec, P()),
                        out_specs=(spec, spec, spec, am_spec, am_spec), check_vma=False)(*args)
                return p1, QuantizedMoment(qm, am), QuantizedMoment(qv, av)
            return update_fp32_ref(g, p, mu, nu, s)

        outer = jax.tree.structure(params)
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        flat = [leaf(*args) for args in zip(
            paths, outer.flatten_up_to(grads), outer.flatten_up_to(params),
            outer.flatten_up_to(state.mu), outer.flatten_up_to(state.nu),
            outer.flatten_up_to(decays), strict=True)]
        new_params = outer.unflatten([f[0] for f in flat])
        mu = outer.unflatten([f[1] for f in flat])
        nu = outer.unflatten([f[2] for f in flat])
        return new_params, Adam8bitState(count=count_inc, mu=mu, nu=nu)

    def update(grads, state, params=None):
        new_params, new_state = fused_update(grads, state, params)
        updates = jax.tree.map(lambda n, p: n - p, new_params, params)
        return updates, new_state

    return FusedGradientTransformation(init, update, fused_update)


__all__ = [
    "CODE_S",
    "CODE_U",
    "KERNEL_AUX",
    "Adam8bitState",
    "QuantizedMoment",
    "absmax_shape",
    "adamw_8bit",
    "dequantize",
    "dynamic_map",
    "lookup_np",
    "midpoints",
    "quantize",
    "shard_specs",
    "state_bytes",
    "update_8bit",
    "update_8bit_ref",
    "update_fp32_ref",
]
