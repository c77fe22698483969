"""NVFP4 quantization: E2M1 elements, E4M3 block scales, an FP32 per-tensor scale.

Format (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149; Four Over Six:
Cook et al., arXiv 2512.02010; summarized in shared/reference/peers_and_algorithms.md 4c):
  * elements: FP4 E2M1, values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (codes 0..7, bit 3 = sign);
  * blocks: 16 consecutive elements along the LAST axis (the GEMM reduction axis) share one scale
    (activations, gradients); with `tile_2d=True`, 16x16 tiles over the last two axes share one
    scale (weights: the same quantized W serves Y = X W and dX = dY W^T);
  * block scales: FP8 E4M3 (max 448, subnormals down to 2^-9), stored as float8_e4m3fn;
  * global scale: FP32, from the amax of the whole tensor (current scaling).

Formulas, in the float32 operation order that the CUDA kernels (kernels/nvfp4_quantize.cu)
reproduce bit for bit (every step is one correctly rounded float32 operation):
  M       = 256 with Four Over Six (default), else 448
  amax    = max |x| over the tensor (after the RHT when one is applied)
  s_enc   = (6 * M) / amax;  inf -> FLT_MAX;  amax == 0 -> 1;  amax NaN/inf -> NaN
  s_dec   = 1 / s_enc                                   (the stored global decode scale)
  per block b and candidate D (D = 6; with Four Over Six also D = 4):
    amax_b  = max |x| over the block's 16 (1x16) or 256 (16x16) elements
    t       = (amax_b / D) * s_enc;   t > 448 -> 448 (saturate; NaN stays NaN)
    S       = e4m3_rne(t)                               (0 when t < 2^-10: a zero block)
    r       = s_enc / float(S), or 0 when S == 0        (the block's encode factor)
    v       = x * r
    q       = e2m1(v): round |v| to the nearest E2M1 value, ties to the even code, |v| > 6 -> 6;
              sign bit = signbit(v) (so -0.0 and negatives that round to 0 keep the sign: code 8)
  dequantized: x_hat = (e2m1_value(q) * float(S)) * s_dec   (the first product is exact)
  Four Over Six: err_D = sum over the block of (x - x_hat_D)^2 (float32; squares summed by a
    halving tree: over the 16 columns [0:8]+[8:16], [0:4]+[4:8], [0:2]+[2:4], [0]+[1], then for
    16x16 tiles the same tree over the 16 row sums). Keep D = 4 only if err_4 < err_6 (ties -> 6).
  Stochastic rounding (gradients): the scale is chosen as above (from the round-to-nearest errors,
    so the choice is deterministic), then |v| rounds up to the next E2M1 value with probability
    (|v| - lo) / (hi - lo) (lo <= |v| < hi the neighbouring E2M1 values; |v| >= 6 -> 6): unbiased,
    and only ever one of the two neighbours. Uniforms: jax.random.uniform(key, x.shape) in the
    reference; the CUDA kernel draws its own bits (Philox4x32-10 keyed by two uint32 words taken
    from `key`), so GPU and reference stochastic results agree only in distribution.

Representation (`NVFP4Tensor`): codes uint8 [..., K/2] with element 2j in the LOW nibble and 2j+1
in the high nibble (fouroversix / CUTLASS order); scales float8_e4m3fn [..., K/16] (1x16) or
[..., ceil(M/16), K/16] (tile_2d); global_scale float32 [] = s_dec.

Shapes: the last axis must be a multiple of 16 (ValueError otherwise; we do not pad silently: pad
the reduction axis with zeros yourself if needed, which leaves a GEMM unchanged). With tile_2d the
second-to-last axis may be any length: a partial last tile behaves as if padded with zero rows.

Non-finite inputs: a tensor containing NaN or +-inf has amax NaN/inf, so s_enc = s_dec = NaN and
the dequantized tensor is all NaN (codes and block scales are then unspecified). XLA:CPU flushes
float32 subnormals to zero and the CUDA kernels do not, so the reference and the kernels agree bit
for bit whenever no float32 intermediate is subnormal (always the case for tensors with
amax >= 2^-32 whose non-zero elements are normal floats).

XLA rewrites a division by a constant into a multiplication by its reciprocal and contracts a
multiply feeding an add into an FMA; both would change bits, so the reference divides by an
opaque array (`_exact_div`) and materializes products before they feed a subtraction or a sum
(`_round`, an optimization barrier).

Entry points: `quantize` / `dequantize` / `fake_quantize` (impl=None/"auto": CUDA kernels on GPU
when the extension is built, the pure-JAX reference elsewhere; SUROGATE_JAX_OPS=ref or ref:nvfp4_quantize
forces the reference), `quantize_ref` / `fake_quantize_ref` (always the reference), `global_amax`.
The GEMMs built on them live in ops/nvfp4_matmul.py: `nvfp4_matmul_emulated` (quantize both GEMM
operands, dequantize to bf16, bf16 GEMM; forward only) and `nvfp4_linear_emulated` (the same with the
recipe's custom backward: stochastically rounded dY for dgrad, RHT + NVFP4 operands along tokens for
wgrad). Despite its name, `nvfp4_linear_emulated` (and `nvfp4_linear_frozen`) run their three GEMMs
natively on SM100+ GPUs (cuBLASLt block-scaled FP4; not yet run on hardware in this project) and
emulated everywhere else; the emulated path's numbers are unchanged by that option.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from . import hadamard
from ._loader import resolve_impl
from ._sharding import data_axes, on_shards

_log = logging.getLogger("surogate_jax")

BLOCK = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MAX_FOUR_OVER_SIX = 256.0
FLT_MAX = float(np.finfo(np.float32).max)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Gap to the next E2M1 value above code c (0 for the top code 7).
_E2M1_STEP = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 0.0], np.float32)

AMAX_TARGET = "surogate_nvfp4_amax"
QUANTIZE_TARGET = "surogate_nvfp4_quantize"
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "global_scale"],
    meta_fields=["shape", "tile_2d", "rht_sign_mask"],
)
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor of logical shape `shape` (see the module docstring for the layout).

    rht_sign_mask: None, or the sign mask of the random Hadamard transform applied along the last
    axis before quantizing (dequantize returns the transformed values; undo with
    hadamard.rht_inverse).
    """

    codes: jax.Array  # uint8 [..., K/2]
    scales: jax.Array  # float8_e4m3fn [..., K/16] or [..., ceil(M/16), K/16]
    global_scale: jax.Array  # float32 [] decode scale s_dec
    shape: tuple[int, ...]
    tile_2d: bool
    rht_sign_mask: int | None = None


# --------------------------------------------------------------------------------------------
# Scalar pieces of the formulas


def global_encode_scale(amax: jax.Array, four_over_six: bool = True) -> jax.Array:
    """s_enc = (6 * M) / amax with the guards of the module docstring (float32 [])."""
    amax = jnp.asarray(amax, jnp.float32)
    num = jnp.float32(FP4_MAX * (E4M3_MAX_FOUR_OVER_SIX if four_over_six else E4M3_MAX))
    s = num / amax
    s = jnp.where(s > FLT_MAX, jnp.float32(FLT_MAX), s)
    s = jnp.where(amax == 0, jnp.float32(1.0), s)
    return jnp.where(jnp.isfinite(amax), s, jnp.float32(jnp.nan))


def _round(v: jax.Array) -> jax.Array:
    """Materializes v as float32 so XLA cannot fuse its producer into an FMA with a consumer."""
    return jax.lax.optimization_barrier(v)


def _exact_div(a: jax.Array, d: float) -> jax.Array:
    """a / d correctly rounded (XLA would turn a division by a constant into a multiplication)."""
    a, den = jax.lax.optimization_barrier((a, jnp.full(a.shape, d, jnp.float32)))
    return a / den


def e2m1_code_rne(a: jax.Array) -> jax.Array:
    """E2M1 magnitude code (uint8 0..7) of |v| = a >= 0: nearest value, ties to even code, > 6 -> 7.

    The midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go down when the lower code is even
    (0, 2, 4, 6) and up when it is odd, hence the alternating > / >=. NaN -> 0.
    """
    c = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return c.astype(jnp.uint8)


def e2m1_code_stochastic(a: jax.Array, u: jax.Array) -> jax.Array:
    """E2M1 magnitude code of a >= 0 rounded up with probability (a - lo) / (hi - lo); u ~ U[0, 1)."""
    lo_code = (
        (a >= 0.5).astype(jnp.uint8)
        + (a >= 1.0)
        + (a >= 1.5)
        + (a >= 2.0)
        + (a >= 3.0)
        + (a >= 4.0)
        + (a >= 6.0)
    ).astype(jnp.uint8)
    lo = jnp.asarray(E2M1_VALUES)[lo_code]
    step = jnp.asarray(_E2M1_STEP)[lo_code]
    up = (lo_code < 7) & (u * step < a - lo)  # u * step and a - lo are exact
    return lo_code + up.astype(jnp.uint8)


def _tree_sum_last(e: jax.Array) -> jax.Array:
    """Sum over a last axis of 16 as [0:8]+[8:16], [0:4]+[4:8], [0:2]+[2:4], [0]+[1]."""
    n = e.shape[-1]
    while n > 1:
        n //= 2
        e = e[..., :n] + e[..., n:]
    return e[..., 0]


# --------------------------------------------------------------------------------------------
# Blocking


def _check_input(x, tile_2d: bool, fn: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating point, got {x.dtype}")
    need = 2 if tile_2d else 1
    if x.ndim < need:
        raise ValueError(f"{fn}: x must have rank >= {need}{' for tile_2d' if tile_2d else ''}, got shape {x.shape}")
    if x.shape[-1] == 0 or x.shape[-1] % BLOCK:
        raise ValueError(
            f"{fn}: the last (block) axis of x must be a positive multiple of {BLOCK}, got shape "
            f"{x.shape}; pad it with zeros (a GEMM's reduction axis may be zero-padded freely)"
        )


def _to_blocks(xf: jax.Array, tile_2d: bool) -> jax.Array:
    """[..., K] -> [..., K/16, 16]; tile_2d: [..., M, K] -> [..., ceil(M/16), K/16, 16, 16]."""
    if not tile_2d:
        return xf.reshape(xf.shape[:-1] + (xf.shape[-1] // BLOCK, BLOCK))
    *lead, m, k = xf.shape
    mp = -(-m // BLOCK) * BLOCK
    if mp != m:
        xf = jnp.pad(xf, [(0, 0)] * len(lead) + [(0, mp - m), (0, 0)])
    nl = len(lead)
    xb = xf.reshape(tuple(lead) + (mp // BLOCK, BLOCK, k // BLOCK, BLOCK))
    return jnp.transpose(xb, tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3))


def _from_blocks(xb: jax.Array, shape: tuple[int, ...], tile_2d: bool) -> jax.Array:
    if not tile_2d:
        return xb.reshape(shape)
    *lead, m, k = shape
    nl = len(lead)
    mt = xb.shape[nl]
    xf = jnp.transpose(xb, tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3))
    return xf.reshape(tuple(lead) + (mt * BLOCK, k))[..., :m, :]


def _block_axes(tile_2d: bool) -> tuple[int, ...]:
    return (-2, -1) if tile_2d else (-1,)


def _expand(s: jax.Array, tile_2d: bool) -> jax.Array:
    """A per-block array [...] broadcastable against the blocked elements."""
    return s[..., None, None] if tile_2d else s[..., None]


# --------------------------------------------------------------------------------------------
# The reference quantizer


def _prepare(x: jax.Array, rht_sign_mask: int | None) -> jax.Array:
    xf = x.astype(jnp.float32)
    if rht_sign_mask is not None:
        xf = hadamard.rht(xf, axis=-1, sign_mask=rht_sign_mask)
    return xf


def _amax_ref(xf: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(xf), initial=jnp.float32(0.0))


def _candidate(xb, amax_b, s_enc, s_dec, d: float, tile_2d: bool, want_err: bool):
    """Quantizes the blocks with candidate scale amax_b / d: (code, neg, S, r, err or None)."""
    t = _exact_div(amax_b, d) * s_enc
    t = jnp.where(t > E4M3_MAX, jnp.float32(E4M3_MAX), t)
    s8 = t.astype(jnp.float8_e4m3fn)
    sf = s8.astype(jnp.float32)
    r = jnp.where(sf == 0, jnp.float32(0.0), s_enc / jnp.where(sf == 0, jnp.float32(1.0), sf))
    v = xb * _expand(r, tile_2d)
    code = e2m1_code_rne(jnp.abs(v))
    neg = jnp.signbit(v)
    err = None
    if want_err:
        mag = jnp.asarray(E2M1_VALUES)[code]
        deq = _round((jnp.where(neg, -mag, mag) * _expand(sf, tile_2d)) * s_dec)
        e = xb - deq
        sq = _round(e * e)
        err = _tree_sum_last(sq)
        if tile_2d:
            err = _tree_sum_last(err)
    return code, neg, s8, r, err


def _quantize_blocks(xb, amax, tile_2d, four_over_six, u_b):
    """Core on blocked float32 data: (code uint8 0..7, neg bool, scales e4m3 [...], s_dec)."""
    s_enc = global_encode_scale(amax, four_over_six)
    s_dec = jnp.float32(1.0) / s_enc
    amax_b = jnp.max(jnp.abs(xb), axis=_block_axes(tile_2d))
    code, neg, s8, r, err6 = _candidate(xb, amax_b, s_enc, s_dec, 6.0, tile_2d, four_over_six)
    if four_over_six:
        code4, neg4, s84, r4, err4 = _candidate(xb, amax_b, s_enc, s_dec, 4.0, tile_2d, True)
        use4 = err4 < err6  # ties keep 6
        e = _expand(use4, tile_2d)
        code, neg = jnp.where(e, code4, code), jnp.where(e, neg4, neg)
        s8, r = jnp.where(use4, s84, s8), jnp.where(use4, r4, r)
    if u_b is not None:
        v = xb * _expand(r, tile_2d)
        code, neg = e2m1_code_stochastic(jnp.abs(v), u_b), jnp.signbit(v)
    return code, neg, s8, s_dec


def _dequant_blocks(code, neg, s8, s_dec, tile_2d):
    mag = jnp.asarray(E2M1_VALUES)[code]
    return (jnp.where(neg, -mag, mag) * _expand(s8.astype(jnp.float32), tile_2d)) * s_dec


def _ref_blocks(x, amax, u, tile_2d, four_over_six, rht_sign_mask):
    xf = _prepare(x, rht_sign_mask)
    if amax is None:
        amax = _amax_ref(xf)
    xb = _to_blocks(xf, tile_2d)
    u_b = None if u is None else _to_blocks(u.astype(jnp.float32), tile_2d)
    return _quantize_blocks(xb, jnp.asarray(amax, jnp.float32).reshape(()), tile_2d, four_over_six, u_b)


def _pack(code, neg, shape, tile_2d):
    nib = code | (neg.astype(jnp.uint8) << 3)
    nib = _from_blocks(nib, shape, tile_2d)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def _quantize_ref_arrays(x, amax, u, tile_2d, four_over_six, rht_sign_mask):
    code, neg, s8, s_dec = _ref_blocks(x, amax, u, tile_2d, four_over_six, rht_sign_mask)
    return _pack(code, neg, x.shape, tile_2d), s8, s_dec


_STATIC = ("tile_2d", "four_over_six", "rht_sign_mask")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _quantize_ref_jit(x, amax, u, tile_2d, four_over_six, rht_sign_mask):
    return _quantize_ref_arrays(x, amax, u, tile_2d, four_over_six, rht_sign_mask)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _fake_quantize_ref_jit(x, amax, u, tile_2d, four_over_six, rht_sign_mask):
    code, neg, s8, s_dec = _ref_blocks(x, amax, u, tile_2d, four_over_six, rht_sign_mask)
    return _from_blocks(_dequant_blocks(code, neg, s8, s_dec, tile_2d), tuple(x.shape), tile_2d)


def _uniforms(key, shape):
    if key is None:
        raise ValueError("nvfp4: stochastic=True needs a PRNG key (key=jax.random.key(...))")
    return jax.random.uniform(key, shape, jnp.float32)


def check_flags(stochastic, key, rht_sign_mask):
    if stochastic and key is None:
        raise ValueError("nvfp4: stochastic=True needs a PRNG key (key=jax.random.key(...))")
    if not stochastic and key is not None:
        raise ValueError("nvfp4: key is only used with stochastic=True")
    if rht_sign_mask is not None and not (
        isinstance(rht_sign_mask, (int, np.integer)) and 0 <= int(rht_sign_mask) < (1 << 16)
    ):
        raise ValueError(f"nvfp4: rht_sign_mask must be None or an int in [0, 2^16), got {rht_sign_mask!r}")


def quantize_ref(x, *, tile_2d=False, four_over_six=True, stochastic=False, key=None,
                 rht_sign_mask=None, amax=None) -> NVFP4Tensor:
    """Pure-JAX reference quantizer (see the module docstring). amax: optional float32 scalar."""
    _check_input(x, tile_2d, "quantize_ref")
    check_flags(stochastic, key, rht_sign_mask)
    u = _uniforms(key, x.shape) if stochastic else None
    mask = None if rht_sign_mask is None else int(rht_sign_mask)
    codes, scales, s_dec = _quantize_ref_jit(x, amax, u, tile_2d=bool(tile_2d),
                                             four_over_six=bool(four_over_six), rht_sign_mask=mask)
    return NVFP4Tensor(codes, scales, s_dec, tuple(x.shape), bool(tile_2d),
                       None if rht_sign_mask is None else int(rht_sign_mask))


def fake_quantize_ref(x, *, tile_2d=False, four_over_six=True, stochastic=False, key=None,
                      rht_sign_mask=None, amax=None) -> jax.Array:
    """dequantize(quantize_ref(x, ...)) without packing: float32 of x's shape."""
    _check_input(x, tile_2d, "fake_quantize_ref")
    check_flags(stochastic, key, rht_sign_mask)
    u = _uniforms(key, x.shape) if stochastic else None
    mask = None if rht_sign_mask is None else int(rht_sign_mask)
    return _fake_quantize_ref_jit(x, amax, u, tile_2d=bool(tile_2d), four_over_six=bool(four_over_six),
                                  rht_sign_mask=mask)


def unpack_codes(codes: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> uint8 [..., K] of 4-bit codes (element 2j from the low nibble)."""
    lo, hi = codes & 0xF, codes >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(codes.shape[:-1] + (codes.shape[-1] * 2,))


def expand_scales(q: NVFP4Tensor) -> jax.Array:
    """Block scales as float32 broadcast to the per-row 1x16 layout [..., K/16] (tile rows repeated)."""
    s = q.scales.astype(jnp.float32)
    if q.tile_2d:
        m = q.shape[-2]
        s = jnp.repeat(s, BLOCK, axis=-2)[..., :m, :]
    return s


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """x_hat = (e2m1_value(code) * float(S)) * s_dec, cast to dtype (float32 math)."""
    nib = unpack_codes(q.codes)
    mag = jnp.asarray(E2M1_VALUES)[nib & 7]
    val = jnp.where((nib & 8) != 0, -mag, mag)
    s = jnp.repeat(expand_scales(q), BLOCK, axis=-1)
    return ((val * s) * q.global_scale).astype(dtype)


# --------------------------------------------------------------------------------------------
# The CUDA kernels through XLA FFI (kernels/nvfp4_quantize.cu via ffi/nvfp4_quantize.cc)


def _mask_attr(rht_sign_mask):
    return np.int32(-1 if rht_sign_mask is None else int(rht_sign_mask))


def _amax_ffi(x, rht_sign_mask):
    call = jax.ffi.ffi_call(AMAX_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32), vmap_method="sequential")
    return call(x, rht_sign_mask=_mask_attr(rht_sign_mask))


def _out_shapes(shape, tile_2d):
    *lead, k = shape
    codes = jax.ShapeDtypeStruct(tuple(lead) + (k // 2,), jnp.uint8)
    if tile_2d:
        *lead2, m = lead
        sshape = tuple(lead2) + (-(-m // BLOCK), k // BLOCK)
    else:
        sshape = tuple(lead) + (k // BLOCK,)
    return (codes, jax.ShapeDtypeStruct(sshape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((), jnp.float32))


def _quantize_ffi(x, amax, seed, *, tile_2d, four_over_six, stochastic, rht_sign_mask):
    call = jax.ffi.ffi_call(QUANTIZE_TARGET, _out_shapes(x.shape, tile_2d), vmap_method="sequential")
    return call(x, jnp.asarray(amax, jnp.float32).reshape((1,)), seed.reshape((2,)).astype(jnp.uint32),
                tile_2d=np.int32(tile_2d), four_over_six=np.int32(four_over_six),
                stochastic=np.int32(stochastic), rht_sign_mask=_mask_attr(rht_sign_mask))


def _pick(impl, ffi, ref):
    if impl == "ref":
        return ref
    if impl == "ffi":
        return ffi
    return functools.partial(jax.lax.platform_dependent, cuda=ffi, default=ref)


def _num_shards(x, tile_2d, mesh) -> int:
    """Data shards on_shards would split x into over `mesh`, or 1 when x must be quantized whole."""
    axes = data_axes(mesh)
    if not axes or x.ndim < 2:
        return 1
    shape = dict(mesh.shape)
    n = int(np.prod([shape[a] for a in axes]))
    if x.shape[0] % n:
        return 1
    if tile_2d and x.ndim == 2 and x.shape[0] % (BLOCK * n):
        return 1  # splitting M would cut through 16-row tiles
    return n


def _resolve(impl, x):
    impl = resolve_impl(impl, "nvfp4_quantize")
    if impl != "ref" and jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        if impl == "ffi":
            raise TypeError(f"nvfp4: impl='ffi' supports float32/bfloat16/float16, got {x.dtype}")
        impl = "ref"
    return impl


def _shards(fn, n, mesh, args, batched, out_batched):
    if n == 1:
        return fn(*args)
    return on_shards(fn, *args, mesh=mesh, batched=batched, out_batched=out_batched)


def global_amax(x: jax.Array, *, rht_sign_mask: int | None = None, impl: str | None = None,
                mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """max |x| (of rht(x) along the last axis when rht_sign_mask is given), float32 []; NaN if any.
    mesh: per data shard of the leading axis, then the max over shards (as `quantize`)."""
    _check_input(x, False, "global_amax")
    check_flags(False, None, rht_sign_mask)
    return _global_amax(x, rht_sign_mask, _resolve(impl, x), _num_shards(x, False, mesh), mesh)


def _global_amax(x, rht_sign_mask, impl, n, mesh):
    if x.size == 0:
        return jnp.float32(0.0)
    ref = lambda x: _amax_ref(_prepare(x, rht_sign_mask)).reshape((1,))
    fn = _pick(impl, functools.partial(_amax_ffi, rht_sign_mask=rht_sign_mask), ref)
    per_shard = _shards(lambda x: (fn(x),), n, mesh, (x,), (True,), (True,))[0]
    return jnp.max(per_shard)  # NaN-propagating


def quantize(x, *, tile_2d=False, four_over_six=True, stochastic=False, key=None,
             rht_sign_mask=None, amax=None, impl=None, mesh=None) -> NVFP4Tensor:
    """Quantizes x (float32/bfloat16/float16, last axis a multiple of 16) to NVFP4.

    tile_2d: 16x16 tiles over the last two axes (weights) instead of 1x16 blocks along the last.
    four_over_six: per-block choice between max-scaling to 6 and to 4 (global scale with 256).
    stochastic: stochastic rounding (gradients); needs `key`.
    rht_sign_mask: apply the 16-point random Hadamard transform along the last axis first (see
      surogate_jax.precision.hadamard; e.g. hadamard.DEFAULT_SIGN_MASK).
    amax: optional precomputed float32 amax of the (transformed) tensor; computed otherwise.
    impl: None/"auto" (CUDA kernels on GPU), "ffi" or "ref"; SUROGATE_JAX_OPS=ref forces "ref".
    mesh (a Mesh / AbstractMesh with data axes): the kernels run per shard of the leading axis
    (on_shards) with one global amax, so the result equals the unsharded one (stochastic bits
    aside); None quantizes x in one call.
    """
    _check_input(x, tile_2d, "quantize")
    check_flags(stochastic, key, rht_sign_mask)
    impl = _resolve(impl, x)
    if x.size == 0 or impl == "ref":
        return quantize_ref(x, tile_2d=tile_2d, four_over_six=four_over_six, stochastic=stochastic,
                            key=key, rht_sign_mask=rht_sign_mask, amax=amax)
    return _quantize_sharded(x, tile_2d, four_over_six, stochastic, key, rht_sign_mask, amax, impl, mesh)


def _quantize_sharded(x, tile_2d, four_over_six, stochastic, key, rht_sign_mask, amax, impl, mesh):
    """The kernel path ("ffi"/"auto"; "ref" too for CPU tests of the wiring): per data shard of mesh."""
    meta = (tuple(x.shape), bool(tile_2d), None if rht_sign_mask is None else int(rht_sign_mask))
    n = _num_shards(x, tile_2d, mesh)
    if amax is None:
        amax = _global_amax(x, rht_sign_mask, impl, n, mesh)
    amax = jnp.asarray(amax, jnp.float32).reshape(())
    # Two uint32 words seed the stochastic rounding (the kernel's Philox key). Per shard they
    # are offset by the shard index so shards draw independent bits.
    seed = jax.random.bits(key, (2,), jnp.uint32) if stochastic else jnp.zeros((2,), jnp.uint32)
    opts = {"tile_2d": tile_2d, "four_over_six": four_over_six, "rht_sign_mask": rht_sign_mask}

    def shard_seed(seed):
        if n == 1:
            return seed
        return seed + jnp.stack([jnp.uint32(0), jax.lax.axis_index(data_axes(mesh)).astype(jnp.uint32)])

    def ffi(x, amax, seed):
        return _quantize_ffi(x, amax, shard_seed(seed), stochastic=stochastic, **opts)

    def ref(x, amax, seed):
        u = None
        if stochastic:
            seed = shard_seed(seed)
            k = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
            u = jax.random.uniform(k, x.shape, jnp.float32)
        return _quantize_ref_arrays(x, amax, u, **opts)

    fn = _pick(impl, ffi, ref)
    codes, scales, s_dec = _shards(fn, n, mesh, (x, amax, seed), (True, False, False), (True, True, False))
    return NVFP4Tensor(codes, scales, s_dec, *meta)


def fake_quantize(x, *, tile_2d=False, four_over_six=True, stochastic=False, key=None,
                  impl=None, mesh=None) -> jax.Array:
    """Quantize-then-dequantize by the NVFP4 formulas: float32 of x's shape.

    The last axis is the block axis (1x16 blocks); tile_2d uses 16x16 tiles over the last two
    axes. four_over_six (default on) picks per block the scale mapping the block max to 4 or 6,
    whichever has the lower squared error (ties -> 6), with global scale 6*256/amax (else
    6*448/amax). stochastic rounding needs `key` (a jax PRNG key). The last axis must be a
    multiple of 16 (ValueError otherwise). See the module docstring for every formula.
    mesh: as for `quantize` (the kernel path quantizes per data shard; the reference runs whole).
    """
    _check_input(x, tile_2d, "fake_quantize")
    check_flags(stochastic, key, None)
    if _resolve(impl, x) == "ref":
        return fake_quantize_ref(x, tile_2d=tile_2d, four_over_six=four_over_six,
                                 stochastic=stochastic, key=key)
    q = quantize(x, tile_2d=tile_2d, four_over_six=four_over_six, stochastic=stochastic, key=key,
                 impl=impl, mesh=mesh)
    return dequantize(q)
