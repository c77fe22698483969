"""bitsandbytes NF4 (QLoRA) weights in JAX: quantize, dequantize, and the HF/bitsandbytes checkpoint format.

Source of the format (read, not copied): bitsandbytes 0.50.2, `bitsandbytes/functional.py` (`quantize_4bit`,
`dequantize_4bit`, `quantize_blockwise`, `create_dynamic_map`, `get_4bit_type`, `QuantState.as_dict`),
`bitsandbytes/backends/default/ops.py` (the `quantize_4bit` kernel its CPU backend runs), `csrc/cpu_ops.cpp`
(`quantize_cpu_impl`: the 8-bit blockwise quantizer used for double quantization), `bitsandbytes/utils.py`
(`pack_dict_to_tensor`) and `bitsandbytes/nn/modules.py` (`Linear4bit._save_to_state_dict`); the NF4 code book is
from Dettmers et al., "QLoRA" (arXiv 2305.14314). Everything below is our own code.

Format. A weight w [out, in] (HF/PyTorch layout) is flattened row-major into n = out * in values and cut into
blocks of `block_size` (the last block may be short). Per block, absmax = max |x|; each x is scaled into [-1, 1]
and replaced by the index of the nearest of the 16 NF4 values (`NF4_CODE`; ties go to the lower code); two codes
are packed per byte, the first element in the HIGH nibble (an odd n pads with code 7, the code of 0.0). With double
quantization (DQ) the fp32 absmax vector is stored as 8 bits: offset = mean(absmax), then absmax - offset is
quantized blockwise (blocks of `NESTED_BLOCK` = 256) with the signed dynamic 8-bit map (`DYNAMIC_MAP`), keeping
one fp32 absmax2 per 256 absmaxes. Dequantization: w = NF4_CODE[q] * absmax, absmax = DYNAMIC_MAP[q2] * absmax2 +
offset under DQ, in fp32.

Our parameter names (per projection): "nf4_codes" uint8 [ceil(n/2)], "nf4_absmax" uint8 [nblocks] under DQ else
fp32 [nblocks], "nf4_absmax2" fp32 [ceil(nblocks/256)] and "nf4_offset" fp32 [] (DQ only). `to_hf`/`from_hf` map
them to the keys transformers saves for a bnb `Params4bit` weight: "weight" (uint8 [ceil(n/2), 1]),
"weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map" and
"weight.quant_state.bitsandbytes__nf4" (the UTF-8 bytes of a JSON object, as uint8).

What bitsandbytes' CPU backend does, exactly, and what we reproduce:
  * full blocks are scaled as x * (1 / max(absmax, 1e-38)) (one reciprocal, then a multiply); the short last block
    as x / max(absmax_tail, 1e-38) (a true division), and its STORED absmax is the clamped one, so an all-zero tail
    block stores 1e-38 (the fp32 subnormal 9.99999935e-39) where an all-zero full block stores 0;
  * the DQ offset is torch's float32 `mean` on CPU: its single-threaded cascade sum (8-float vectors, 4-way ILP,
    levels of 16) divided by nblocks (`_torch_cpu_sum`);
  * the 8-bit DQ step (`quantize_cpu_impl` in csrc/cpu_ops.cpp) maps v = c * (1 / absmax2) through a 65536-entry
    lookup table, index trunc(((clamp(v) + 1) / 2) * 65535 + 0.5), rather than an exact nearest-code search; we
    reproduce it with 255 precomputed fp32 thresholds on v (`_DQ_THRESHOLDS`), found by bisection over that table;
  * an all-zero DQ block stores absmax2 = 0 and codes 0.

Where results are bit-exact:
  * CPU (jax on CPU vs bitsandbytes 0.50.2 on x86 CPU with torch's serial sum): codes, absmax, absmax2, offset,
    the JSON blob and the dequantized fp32 weight are byte-identical, for every block size in `BLOCK_SIZES`, with and
    without DQ, any n. Two limits: torch sums a vector of more than 32768 absmax (more than 2M weights at block 64)
    across its threads, so bnb's own offset then depends on torch.get_num_threads() and can differ from ours (the
    serial order) in the last bit; and XLA on CPU flushes subnormals to zero, so a block whose values are all below
    ~1.2e-38 (nothing a real weight has) can differ.
  * GPU: no step divides in floating point or fuses a multiply with an add. Reciprocals, the tail division and the
    mean's division are correctly rounded in integer arithmetic (`_div_rn`); the scaling is one fp32 multiply;
    code selection compares with fp32 thresholds; sums are explicit chains of adds in torch's order; absmax is an
    integer max over the bit patterns; the DQ dequantization's multiply and add are kept apart by an optimization
    barrier so XLA cannot contract them into an FMA. So on a GPU the results should be the same bits as on CPU
    (same subnormal caveat); this is by construction and has not yet been checked on a GPU. bitsandbytes' CUDA
    kernels are NOT the reference: they pick DQ codes by a binary search over the map (`dQuantize` in
    csrc/kernels.cu), not through the CPU lookup table, and torch on CUDA sums in another order.
  * NaN/Inf weights: unspecified (bnb itself is not consistent across backends there).
"""

from __future__ import annotations

import json
from fractions import Fraction
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from surogate_jax.names import NF4_BLOCK_SIZES
from surogate_jax.ops.nf4_dequantize import nf4_dequantize
from surogate_jax.qlora import _checks

__all__ = [
    "BLOCK_SIZES",
    "DYNAMIC_MAP",
    "NESTED_BLOCK",
    "NF4_CODE",
    "dequantize",
    "dequantize_nf4",
    "from_hf",
    "param_shapes",
    "quantize",
    "quantize_nf4",
    "to_hf",
]

BLOCK_SIZES = NF4_BLOCK_SIZES
NESTED_BLOCK = 256

# The 16 NF4 values, exactly bnb's `get_4bit_type("nf4")` (normal quantiles with offset 0.9677083, scaled to [-1, 1]).
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)

_HF_DTYPES = ("float32", "bfloat16", "float16")
_TINY_BITS = 0x006CE3EE  # bits of np.float32(1e-38), the clamp bnb puts under every absmax before dividing by it
_TORCH_SUM_LANES = 8  # torch's CPU sum kernel runs on 8-float vectors (AVX2 and AVX512 builds alike)


# ---------------------------------------------------------------------------------------------------------------
# Tables (numpy, built once at import)
# ---------------------------------------------------------------------------------------------------------------


def _round_f32(x) -> np.float32:
    """Round an exact rational (fractions.Fraction) to the nearest float32, ties to even."""
    c = np.float32(float(x))
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d = abs(Fraction(float(cand)) - x)
        even = int(np.asarray(cand).view(np.uint32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, cand)
    return np.float32(best[1])


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=float32) on CPU: its scalar kernel, start + step * i for the first
    half and end - step * (steps - 1 - i) for the rest, each a fused multiply-add (as the compiled kernel does)."""
    s, e = np.float32(start), np.float32(end)
    step = np.float32((e - s) / np.float32(steps - 1))
    out = []
    for i in range(steps):
        if i < steps // 2:
            exact = Fraction(float(s)) + Fraction(float(step)) * i
        else:
            exact = Fraction(float(e)) - Fraction(float(step)) * (steps - 1 - i)
        out.append(_round_f32(exact))
    return np.array(out, np.float32)


def _signed_dynamic_map() -> np.ndarray:
    """bnb's `create_dynamic_map(signed=True)`: for exponent level i = 0..6, the 2**i midpoints of
    linspace(0.1, 1, 2**i + 1) scaled by 10**(i - 6) (in fp32), with their negatives, plus 0 and 1; sorted."""
    data = [np.float32(0.0), np.float32(1.0)]
    for i in range(7):
        bounds = _torch_linspace_f32(0.1, 1.0, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (i - 6))
        data += list(scale * means) + list(-scale * means)
    out = np.sort(np.array(data, np.float32))
    assert out.shape == (256,)
    return out


DYNAMIC_MAP = _signed_dynamic_map()

# NF4 decision thresholds: code(v) = number of midpoints strictly below v (torch.bucketize, right=False).
_NF4_BOUNDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2.0)


def _dq_lut() -> np.ndarray:
    """bnb's CPU quantizer table: entry i is the number of code midpoints below -1 + (2 i) / 65535."""
    mids = np.float32(0.5) * (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])
    i = np.arange(65536)
    val = np.float32(-1.0) + (np.float32(2.0) * i.astype(np.float32)) / np.float32(65535.0)
    return np.searchsorted(mids, val, side="left")


def _dq_code_reference(v: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """bnb's CPU 8-bit code of scaled values v (fp32), through its lookup table (numpy, exact)."""
    v = np.clip(v.astype(np.float32), np.float32(-1.0), np.float32(1.0))
    h = ((v + np.float32(1.0)) * np.float32(0.5)).astype(np.float64)
    # h * 65535 + 0.5 is exact in float64 (at most 48 significant bits here); one rounding to fp32, as an FMA does.
    # (Rounding h * 65535 to fp32 first, as an unfused multiply would, gives the same index for every fp32 h.)
    idx = (h * 65535.0 + 0.5).astype(np.float32).astype(np.int64)
    return lut[idx]


def _f32_from_key(k: np.ndarray) -> np.ndarray:
    k = k.astype(np.int64)
    bits = np.where(k >= 0, k, (-k) | 0x80000000).astype(np.uint32)
    return bits.view(np.float32)


def _f32_key(v: np.ndarray) -> np.ndarray:
    bits = v.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(bits & 0x80000000, -(bits & 0x7FFFFFFF), bits)


def _dq_thresholds() -> np.ndarray:
    """T[j - 1] = the smallest fp32 v with bnb CPU code(v) >= j, j = 1..255, so code(v) = #{T <= v}."""
    lut = _dq_lut()
    j = np.arange(1, 256)
    lo = np.full(j.shape, int(_f32_key(np.float32(-1.0))), np.int64)  # code(-1) = 0 < j
    hi = np.full(j.shape, int(_f32_key(np.float32(1.0))), np.int64)  # code(1) = 255 >= j
    assert _dq_code_reference(np.float32([-1.0]), lut)[0] == 0 and _dq_code_reference(np.float32([1.0]), lut)[0] == 255
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        ok = _dq_code_reference(_f32_from_key(mid), lut) >= j
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    return _f32_from_key(hi)


_DQ_THRESHOLDS = _dq_thresholds()


# ---------------------------------------------------------------------------------------------------------------
# Exact arithmetic helpers (jnp; no floating-point division, no multiply-add)
# ---------------------------------------------------------------------------------------------------------------


def _u32(x):
    return jnp.asarray(x, jnp.uint32)


def _normalize(bits):
    """Split positive fp32 bit patterns (normal or subnormal, nonzero) into (E, M): value = M * 2**(E - 150) with
    M in [2**23, 2**24)."""
    e = (bits >> 23).astype(jnp.int32)
    m = bits & _u32(0x7FFFFF)
    sub = e == 0
    shift = jnp.where(sub, jax.lax.clz(m).astype(jnp.int32) - 8, 0)
    mm = jnp.where(sub, m << shift.astype(jnp.uint32), m | _u32(0x800000))
    return jnp.where(sub, 1 - shift, e), mm


def _div_rn(x, y):
    """x / y in fp32, correctly rounded (ties to even), from integer long division: the same bits on any backend.

    x: finite fp32; y: finite fp32 > 0. Where the quotient would be subnormal or overflow, or an input is not
    finite, it falls back to the backend's division (bnb never reaches that for real weights).
    """
    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    xb = jax.lax.bitcast_convert_type(x, jnp.uint32)
    yb = jax.lax.bitcast_convert_type(y, jnp.uint32)
    sign = xb & _u32(0x80000000)
    ax = xb & _u32(0x7FFFFFFF)
    ex, mx = _normalize(jnp.maximum(ax, _u32(1)))
    ey, my = _normalize(jnp.maximum(yb, _u32(1)))
    # q = floor(mx * 2**25 / my), built 1 + 8 + 8 + 8 + 1 bits at a time; every intermediate stays below 2**32.
    q = mx // my
    r = mx - q * my
    for b in (8, 8, 8, 1):
        r = r << _u32(b)
        d = r // my
        r = r - d * my
        q = (q << _u32(b)) + d
    big = q >= _u32(1 << 25)  # mx >= my: the quotient of the mantissas is in [1, 2)
    mant = jnp.where(big, q >> _u32(2), q >> _u32(1))
    rbit = jnp.where(big, (q >> _u32(1)) & _u32(1), q & _u32(1))
    sticky = jnp.where(big, (q & _u32(1)) | (r != 0).astype(jnp.uint32), (r != 0).astype(jnp.uint32))
    mant = mant + (rbit & (sticky | (mant & _u32(1))))
    exp = ex - ey + jnp.where(big, 127, 126)
    exp_final = exp + (mant >> _u32(24)).astype(jnp.int32)  # rounding may carry into the exponent
    bits = (exp << 23).astype(jnp.uint32) + (mant - _u32(0x800000))
    exact = jax.lax.bitcast_convert_type(bits | sign, jnp.float32)
    finite = (ax < _u32(0x7F800000)) & (yb < _u32(0x7F800000)) & (yb > 0)
    ok = finite & (ax != 0) & (exp >= 1) & (exp_final <= 254)
    zero = jax.lax.bitcast_convert_type(sign, jnp.float32)
    return jnp.where(ok, exact, jnp.where((ax == 0) & finite, zero, x / y))


def _absmax_bits(a, axis=-1):
    """max |a| along `axis` as fp32, computed on the bit patterns (exact, also for subnormals; NaN wins)."""
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32) & _u32(0x7FFFFFFF)
    return jnp.max(bits, axis=axis)


def _from_bits(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _seq_sum(a, axis):
    """0 + a[0] + a[1] + ... along `axis`, left to right (a chain of adds XLA keeps in order)."""
    a = jnp.moveaxis(a, axis, 0)
    s = jnp.zeros(a.shape[1:], a.dtype)
    for i in range(a.shape[0]):
        s = s + a[i]
    return s


def _ceil_log2(n: int) -> int:
    return 1 if n <= 2 else (n - 1).bit_length()


def _cascade(rows):
    """torch's `multi_row_sum` over rows [m, 4, W]: four levels, each summing groups of 2**level_power in order."""
    m = rows.shape[0]
    step = 1 << max(4, _ceil_log2(m) // 4)
    zero = jnp.zeros(rows.shape[1:], rows.dtype)
    g0 = m // step
    s0 = _seq_sum(rows[: g0 * step].reshape(g0, step, *rows.shape[1:]), 1) if g0 else rows[:0]
    acc0 = _seq_sum(rows[g0 * step :], 0) if m > g0 * step else zero
    g1 = g0 // step
    s1 = _seq_sum(s0[: g1 * step].reshape(g1, step, *rows.shape[1:]), 1) if g1 else rows[:0]
    acc1 = _seq_sum(s0[g1 * step :], 0) if g0 > g1 * step else zero
    g2 = g1 // step
    s2 = _seq_sum(s1[: g2 * step].reshape(g2, step, *rows.shape[1:]), 1) if g2 else rows[:0]
    acc2 = _seq_sum(s1[g2 * step :], 0) if g1 > g2 * step else zero
    acc3 = _seq_sum(s2, 0) if g2 else zero
    return ((acc0 + acc1) + acc2) + acc3


def _row_sum(v):
    """torch's `row_sum` over v [k, W]: 4-way ILP partial sums, leftovers into the first, then the four combined."""
    k = v.shape[0]
    m = k // 4
    ps = _cascade(v[: 4 * m].reshape(m, 4, v.shape[1])) if m else jnp.zeros((4, v.shape[1]), v.dtype)
    p0 = ps[0]
    for i in range(4 * m, k):
        p0 = p0 + v[i]
    return ((p0 + ps[1]) + ps[2]) + ps[3]


def _torch_cpu_sum(x):
    """float32 sum of a 1-D array in exactly the order of torch's single-threaded CPU sum kernel (cascade_sum)."""
    n = x.shape[0]
    lanes = _TORCH_SUM_LANES
    if n < lanes:  # scalar path
        return _row_sum(x.reshape(n, 1))[0]
    nv = n // lanes
    p = _row_sum(x[: nv * lanes].reshape(nv, lanes))
    acc = jnp.zeros((), x.dtype)
    for i in range(nv * lanes, n):
        acc = acc + x[i]
    for lane in range(lanes):
        acc = acc + p[lane]
    return acc


def _count_below(v, bounds: np.ndarray, *, inclusive: bool):
    """#{b in bounds: b < v} (or b <= v when inclusive), as uint8; bounds sorted ascending."""
    if len(bounds) <= 16:  # a fused chain of compares: no [n, len(bounds)] intermediate
        q = jnp.zeros(v.shape, jnp.uint8)
        for b in bounds:
            hit = (v >= np.float32(b)) if inclusive else (v > np.float32(b))
            q = q + hit.astype(jnp.uint8)
        return q
    side = "right" if inclusive else "left"
    return jnp.searchsorted(jnp.asarray(bounds), v, side=side, method="scan").astype(jnp.uint8)


# ---------------------------------------------------------------------------------------------------------------
# Validation and shapes
# ---------------------------------------------------------------------------------------------------------------


def _check_block_size(size) -> int:
    return _checks.block_size(size, BLOCK_SIZES, "nf4")


def _check_shape(shape) -> tuple[int, int]:
    return _checks.weight_shape(shape, "nf4")


def _sizes(shape, block_size: int) -> tuple[int, int, int]:
    n = shape[0] * shape[1]
    nblocks = -(-n // block_size)
    return n, nblocks, -(-nblocks // NESTED_BLOCK)


def param_shapes(shape, *, block_size: int = 64, double_quant: bool = True) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the parameters `quantize` returns for a weight of `shape` [out, in]."""
    block_size = _check_block_size(block_size)
    n, nblocks, nblocks2 = _sizes(_check_shape(shape), block_size)
    out = {"nf4_codes": jax.ShapeDtypeStruct(((n + 1) // 2,), jnp.uint8)}
    if double_quant:
        out["nf4_absmax"] = jax.ShapeDtypeStruct((nblocks,), jnp.uint8)
        out["nf4_absmax2"] = jax.ShapeDtypeStruct((nblocks2,), jnp.float32)
        out["nf4_offset"] = jax.ShapeDtypeStruct((), jnp.float32)
    else:
        out["nf4_absmax"] = jax.ShapeDtypeStruct((nblocks,), jnp.float32)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Quantize / dequantize (jnp, jit-able)
# ---------------------------------------------------------------------------------------------------------------


def _quantize_blocks(x, block_size: int):
    """NF4 codes (uint8, one per value) and fp32 absmax of a 1-D fp32 array, as bnb's quantize_4bit."""
    n = x.shape[0]
    nfull, rem = divmod(n, block_size)
    tiny = _u32(_TINY_BITS)
    codes, absmax = [], []
    if nfull:
        xb = x[: nfull * block_size].reshape(nfull, block_size)
        am_bits = _absmax_bits(xb)
        recip = _div_rn(jnp.ones((nfull,), jnp.float32), _from_bits(jnp.maximum(am_bits, tiny)))
        scaled = xb * recip[:, None]
        codes.append(_count_below(scaled, _NF4_BOUNDS, inclusive=False).reshape(-1))
        absmax.append(_from_bits(am_bits))
    if rem:
        xt = x[nfull * block_size :]
        am_t = _from_bits(jnp.maximum(_absmax_bits(xt, axis=0), tiny))  # bnb stores the clamped tail absmax
        scaled = _div_rn(xt, jnp.broadcast_to(am_t, xt.shape))
        codes.append(_count_below(scaled, _NF4_BOUNDS, inclusive=False))
        absmax.append(am_t[None])
    return jnp.concatenate(codes), jnp.concatenate(absmax)


def _pack(q):
    if q.shape[0] % 2:
        q = jnp.concatenate([q, jnp.full((1,), 7, jnp.uint8)])  # bnb pads the scaled values with 0.0 -> code 7
    return (q[0::2] << 4) | q[1::2]


def _quantize_absmax(absmax):
    """bnb's double quantization of the absmax vector: offset = torch CPU mean, then the CPU 8-bit blockwise
    quantizer (blocks of 256, signed dynamic map through its lookup table)."""
    offset = _div_rn(_torch_cpu_sum(absmax), jnp.float32(absmax.shape[0]))
    q2, absmax2 = _quantize_8bit(absmax - offset)
    return q2, absmax2, offset


def _quantize_8bit(c):
    """bnb's CPU `quantize_blockwise(c, blocksize=256)` with the signed dynamic map: (uint8 codes, fp32 absmax)."""
    nb = c.shape[0]
    nb2 = -(-nb // NESTED_BLOCK)
    cp = jnp.pad(c, (0, nb2 * NESTED_BLOCK - nb)).reshape(nb2, NESTED_BLOCK)  # zero padding leaves the max alone
    a2_bits = _absmax_bits(cp)
    recip = _div_rn(jnp.ones((nb2,), jnp.float32), _from_bits(jnp.maximum(a2_bits, _u32(1))))
    v = cp * recip[:, None]
    q2 = _count_below(v, _DQ_THRESHOLDS, inclusive=True)
    q2 = jnp.where((a2_bits == 0)[:, None], jnp.uint8(0), q2)  # bnb writes code 0 for an all-zero block
    return q2.reshape(-1)[:nb], _from_bits(a2_bits)


@partial(jax.jit, static_argnames=("block_size", "double_quant"))
def _quantize_flat(x, *, block_size: int, double_quant: bool):
    q, absmax = _quantize_blocks(x, block_size)
    out = {"nf4_codes": _pack(q)}
    if double_quant:
        out["nf4_absmax"], out["nf4_absmax2"], out["nf4_offset"] = _quantize_absmax(absmax)
    else:
        out["nf4_absmax"] = absmax
    return out


def _check_w(w):
    ndim = getattr(w, "ndim", None)
    dtype = getattr(w, "dtype", None)
    if ndim != 2:
        raise ValueError(f"w must be a 2-D weight [out, in], got {ndim}-D (shape {getattr(w, 'shape', None)})")
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"w must be a floating-point array (float32, bfloat16, float16), got dtype {dtype}")
    if min(w.shape) < 1:
        raise ValueError(f"w must not be empty, got shape {w.shape}")


def quantize(w, *, block_size: int = 64, double_quant: bool = True) -> dict[str, jax.Array]:
    """Quantize w [out, in] (any float dtype) to NF4 model parameters, bit-exact with bitsandbytes' CPU
    `quantize_4bit(w, blocksize=block_size, quant_type="nf4", compress_statistics=double_quant)`.

    Jit-able (block_size and double_quant static). Returns {"nf4_codes", "nf4_absmax"} and, under double
    quantization, {"nf4_absmax2", "nf4_offset"}; see the module docstring for dtypes, shapes and exactness.
    """
    block_size = _check_block_size(block_size)
    _check_w(w)
    x = jnp.asarray(w).astype(jnp.float32).reshape(-1)  # bf16/fp16 -> fp32 is exact, as bnb's A.float()
    return _quantize_flat(x, block_size=block_size, double_quant=bool(double_quant))


def double_quant_absmax(params):
    """absmax = DYNAMIC_MAP[q2] * absmax2 + offset, two roundings (the barrier stops an FMA contraction)."""
    q2 = jnp.asarray(params["nf4_absmax"]).astype(jnp.int32)
    a2 = jnp.asarray(params["nf4_absmax2"], jnp.float32)
    nb = q2.shape[0]
    # a broadcast, not jnp.repeat: its index arrays got constant-folded by XLA (a minute of a 30B-A3B compile)
    scale = jnp.broadcast_to(a2[:, None], (a2.shape[0], NESTED_BLOCK)).reshape(-1)[:nb]
    prod = jax.lax.optimization_barrier(jnp.asarray(DYNAMIC_MAP)[q2] * scale)
    return prod + jnp.asarray(params["nf4_offset"], jnp.float32)


def _absmax_f32(params, double_quant: bool):
    return double_quant_absmax(params) if double_quant else jnp.asarray(params["nf4_absmax"], jnp.float32)


@partial(jax.jit, static_argnames=("shape", "block_size", "double_quant", "dtype", "mesh"))
def _dequantize(params, group_sizes, *, shape, block_size: int, double_quant: bool, dtype, mesh):
    return nf4_dequantize(params["nf4_codes"], _absmax_f32(params, double_quant), NF4_CODE, shape=shape,
                          block_size=block_size, out_dtype=dtype, group_sizes=group_sizes, mesh=mesh)


def dequantize(params, shape, *, block_size: int = 64, double_quant: bool = True, dtype=jnp.bfloat16,
               mesh=None, group_sizes=None) -> jax.Array:
    """w [out, in] = NF4_CODE[q] * absmax (absmax = DYNAMIC_MAP[q2] * absmax2 + offset under double quantization),
    computed in fp32 and cast once to `dtype`; in fp32 it equals bitsandbytes' `dequantize_4bit` bit for bit.
    The unpacking is ops.nf4_dequantize (our kernel on a GPU); mesh: the devices it runs on, group_sizes: stacked
    MoE experts' token counts for a selective dequantization (see that op)."""
    block_size = _check_block_size(block_size)
    shape = _check_shape(shape)
    _check_params(params, shape, block_size, bool(double_quant))
    return _dequantize(
        {k: params[k] for k in param_shapes(shape, block_size=block_size, double_quant=double_quant)},
        group_sizes,
        shape=shape,
        block_size=block_size,
        double_quant=bool(double_quant),
        dtype=jnp.dtype(dtype),
        mesh=mesh,
    )


def fp8_weight(params, shape, *, block_size: int = 64, double_quant: bool = True, dtype=jnp.bfloat16,
               mesh=None, group_sizes=None) -> tuple[jax.Array, jax.Array]:
    """(wq float8_e4m3fn [out, in], scale f32 []) = fp8-hybrid's frozen cache of the weight dequantized in `dtype`:
    W = dtype(NF4_CODE[q] * absmax), scale = 448 / max|W|, wq = E4M3(clip(W * scale)), in one kernel pass.
    max|W| comes from the absmaxes alone: each block's largest |value| is stored as code +-1, so it dequantizes to
    exactly its absmax, and rounding to `dtype` is monotonic (for a tensor bnb did not write, an upper bound)."""
    from surogate_jax.ops.fp8_formats import E4M3, current_scale

    block_size = _check_block_size(block_size)
    shape = _check_shape(shape)
    _check_params(params, shape, block_size, bool(double_quant))
    absmax = _absmax_f32(params, bool(double_quant))
    am = jnp.max(jnp.abs(absmax)).astype(dtype).astype(jnp.float32) if absmax.size else jnp.float32(0)
    scale = current_scale(am)
    wq = nf4_dequantize(params["nf4_codes"], absmax, NF4_CODE, scale, shape=shape, block_size=block_size,
                        out_dtype=E4M3, via_dtype=dtype, group_sizes=group_sizes, mesh=mesh)
    return wq, scale


def _check_params(params, shape, block_size: int, double_quant: bool) -> None:
    want = param_shapes(shape, block_size=block_size, double_quant=double_quant)
    for key, spec in want.items():
        if key not in params:
            raise ValueError(f"params is missing {key!r} (have {sorted(params)})")
        got = params[key]
        if tuple(np.shape(got)) != spec.shape or jnp.dtype(got.dtype) != spec.dtype:
            raise ValueError(
                f"params[{key!r}] must be {spec.dtype} {spec.shape} for shape {shape}, block_size {block_size}, "
                f"double_quant {double_quant}; got {got.dtype} {tuple(np.shape(got))}"
            )


# ---------------------------------------------------------------------------------------------------------------
# HF / bitsandbytes checkpoint parts
# ---------------------------------------------------------------------------------------------------------------

_BLOB_KEY = "weight.quant_state.bitsandbytes__nf4"


def to_hf(params, shape, *, block_size: int = 64, double_quant: bool = True, dtype="bfloat16") -> dict[str, np.ndarray]:
    """The state-dict parts transformers saves for this bnb 4-bit weight (keys relative to the module prefix),
    byte-identical to bnb's packed weight + `QuantState.as_dict(packed=True)`; `dtype` is the original weight's
    dtype name recorded in the JSON blob ("float32", "bfloat16" or "float16")."""
    block_size = _check_block_size(block_size)
    shape = _check_shape(shape)
    double_quant = bool(double_quant)
    dtype = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in _HF_DTYPES:
        raise ValueError(f"dtype must be one of {_HF_DTYPES} (bnb 4-bit supports only these), got {dtype!r}")
    _check_params(params, shape, block_size, double_quant)
    p = {k: np.asarray(v) for k, v in params.items()}
    parts = {
        "weight": np.ascontiguousarray(p["nf4_codes"].astype(np.uint8).reshape(-1, 1)),
        "weight.absmax": np.ascontiguousarray(p["nf4_absmax"]),
        "weight.quant_map": NF4_CODE.copy(),
    }
    blob = {"quant_type": "nf4", "blocksize": block_size, "dtype": dtype, "shape": list(shape)}
    if double_quant:
        parts["weight.nested_absmax"] = np.ascontiguousarray(p["nf4_absmax2"].astype(np.float32))
        parts["weight.nested_quant_map"] = DYNAMIC_MAP.copy()
        blob.update(
            nested_blocksize=NESTED_BLOCK,
            nested_dtype="float32",
            nested_offset=float(np.float32(p["nf4_offset"])),
        )
    parts[_BLOB_KEY] = np.frombuffer(json.dumps(blob).encode("utf-8"), np.uint8).copy()
    return parts


def _read_blob(parts) -> dict:
    blob_keys = [k for k in parts if k.startswith("weight.quant_state.")]
    if _BLOB_KEY not in parts:
        if blob_keys:
            raise ValueError(f"quant_type: only nf4 is supported, found the quant-state part {blob_keys[0]!r}")
        raise ValueError(f"missing part {_BLOB_KEY!r} (have {sorted(parts)})")
    raw = np.asarray(parts[_BLOB_KEY])
    try:
        blob = json.loads(raw.astype(np.uint8).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"part {_BLOB_KEY!r} is not a UTF-8 JSON object: {e}") from None
    if not isinstance(blob, dict):
        raise ValueError(f"part {_BLOB_KEY!r} must hold a JSON object, got {type(blob).__name__}")
    return blob


def _bytes_u8(parts, key: str, size: int) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(parts[key]))
    if a.nbytes != size:
        raise ValueError(f"part {key!r} must hold {size} bytes (uint8 [{size}, 1]), got {a.dtype} {a.shape}")
    return a.reshape(-1).view(np.uint8).copy()  # bnb's quant_storage may be another dtype: the bytes are the codes


def _same_f32(a: np.ndarray, ref: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.shape == ref.shape and np.array_equal(a.view(np.uint32), ref.view(np.uint32))


def _f32_part(parts, key: str, size: int) -> np.ndarray:
    a = np.asarray(parts[key])
    if a.dtype != np.float32 or a.size != size:
        raise ValueError(f"part {key!r} must be float32 [{size}], got {a.dtype} {a.shape}")
    return a.reshape(-1).copy()


def from_hf(parts, shape) -> tuple[dict[str, np.ndarray], int, bool]:
    """Read the parts of one bnb 4-bit weight (numpy arrays as loaded from safetensors, keys as `to_hf` writes)
    into (params as numpy, block_size, double_quant); any inconsistency raises ValueError naming the part."""
    shape = _check_shape(shape)
    blob = _read_blob(parts)
    if blob.get("quant_type") != "nf4":
        raise ValueError(f"part {_BLOB_KEY!r}: quant_type must be 'nf4', got {blob.get('quant_type')!r}")
    block_size = blob.get("blocksize")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"part {_BLOB_KEY!r}: blocksize must be one of {BLOCK_SIZES}, got {block_size!r}")
    if blob.get("shape") != list(shape):
        raise ValueError(f"part {_BLOB_KEY!r}: shape {blob.get('shape')!r} does not match the expected {list(shape)}")
    if blob.get("dtype") not in _HF_DTYPES:
        raise ValueError(f"part {_BLOB_KEY!r}: dtype must be one of {_HF_DTYPES}, got {blob.get('dtype')!r}")
    double_quant = "weight.nested_absmax" in parts
    nested_fields = ("nested_blocksize", "nested_dtype", "nested_offset")
    if double_quant != any(k in blob for k in nested_fields):
        raise ValueError(
            f"part {_BLOB_KEY!r}: nested fields {'missing' if double_quant else 'present'} while "
            f"'weight.nested_absmax' is {'present' if double_quant else 'missing'}"
        )
    for key in ("weight", "weight.absmax", "weight.quant_map") + (
        ("weight.nested_absmax", "weight.nested_quant_map") if double_quant else ()
    ):
        if key not in parts:
            raise ValueError(f"missing part {key!r} (have {sorted(parts)})")
    qmap = np.asarray(parts["weight.quant_map"])
    if not _same_f32(qmap, NF4_CODE):
        raise ValueError("part 'weight.quant_map' must equal NF4_CODE (bnb's 16 NF4 values as float32)")
    n, nblocks, nblocks2 = _sizes(shape, block_size)
    params = {"nf4_codes": _bytes_u8(parts, "weight", (n + 1) // 2)}
    if double_quant:
        if blob.get("nested_blocksize") != NESTED_BLOCK or blob.get("nested_dtype") != "float32":
            raise ValueError(
                f"part {_BLOB_KEY!r}: nested_blocksize/nested_dtype must be {NESTED_BLOCK}/'float32', got "
                f"{blob.get('nested_blocksize')!r}/{blob.get('nested_dtype')!r}"
            )
        offset = blob.get("nested_offset")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise ValueError(f"part {_BLOB_KEY!r}: nested_offset must be a number, got {offset!r}")
        nmap = np.asarray(parts["weight.nested_quant_map"])
        if not _same_f32(nmap, DYNAMIC_MAP):
            raise ValueError("part 'weight.nested_quant_map' must equal DYNAMIC_MAP (bnb's signed dynamic 8-bit map)")
        absmax = np.asarray(parts["weight.absmax"])
        if absmax.dtype != np.uint8 or absmax.size != nblocks:
            raise ValueError(f"part 'weight.absmax' must be uint8 [{nblocks}] (double quantization), got "
                             f"{absmax.dtype} {absmax.shape}")
        params["nf4_absmax"] = absmax.reshape(-1).copy()
        params["nf4_absmax2"] = _f32_part(parts, "weight.nested_absmax", nblocks2)
        params["nf4_offset"] = np.asarray(offset, np.float32)
    else:
        params["nf4_absmax"] = _f32_part(parts, "weight.absmax", nblocks)
    return params, block_size, double_quant


# ---------------------------------------------------------------------------------------------------------------
# Public numpy-level API
# ---------------------------------------------------------------------------------------------------------------


def quantize_nf4(w, *, block_size: int = 64, double_quant: bool = True) -> dict[str, np.ndarray]:
    """Quantize w [out, in] to the bnb/transformers checkpoint parts (numpy), recording w's dtype in the blob."""
    _check_w(w)
    name = jnp.dtype(w.dtype).name
    if name not in _HF_DTYPES:
        raise ValueError(f"w must be float32, bfloat16 or float16 (what bnb 4-bit records), got dtype {name}")
    params = quantize(w, block_size=block_size, double_quant=double_quant)
    return to_hf(params, w.shape, block_size=block_size, double_quant=double_quant, dtype=name)


def dequantize_nf4(parts) -> np.ndarray:
    """The fp32 weight [out, in] stored in bnb/transformers checkpoint parts (shape read from the blob)."""
    shape = _read_blob(parts).get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
        raise ValueError(f"part {_BLOB_KEY!r}: shape must be [out, in], got {shape!r}")
    params, block_size, double_quant = from_hf(parts, shape)
    w = dequantize(params, shape, block_size=block_size, double_quant=double_quant, dtype=jnp.float32)
    return np.asarray(w)

