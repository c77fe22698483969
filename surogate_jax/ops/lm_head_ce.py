"""Fused LM head + token cross-entropy, chunked over tokens (and over the vocabulary for the head's
gradient): [tokens, vocab] logits never exist whole.

    loss_sum, count = lm_head_ce(hidden [..., D], head [D, V] (or [V, D]), targets [...], mask [...])

Shapes and dtypes:
  hidden [..., D] float32 / bfloat16 / float16 (the compute dtype); head [D, V] (head_layout="DV")
  or [V, D] (head_layout="VD": a tied embedding table used as is, no transposed copy), cast to
  hidden.dtype; targets [...] integer; mask [...] (any real dtype, used as per-token weights, None =
  all ones). Returns two float32 scalars: the weighted SUM of token losses and the count (sum of
  weights). Positions with target == ignore_index get weight 0.

Per token i with weight w_i != 0 (x = logits row = h_i @ W in fp32 accumulation, lse = logsumexp x):
  loss_i = w_i * (lse - x[t_i] + z * lse^2)                     (z = z_loss, PaLM's auxiliary term)
  dloss_i/dx_j = w_i * (softmax(x)_j * (1 + 2 z lse) - [j == t_i])
Tokens with w_i == 0 contribute nothing (their logits are not even read by the kernel).
A target outside [0, V) at a position with w_i != 0 (and != ignore_index) is a data bug: that
token's loss is NaN (so the sum is NaN) and so is its gradient row, on both implementations.

Backward: the loss sum is linear in its cotangent g, so the forward rule (under differentiation)
computes what it can right away and saves it. Pass 1, per chunk of C tokens:
  logits_CV = h_CD @ W            (XLA/cuBLAS GEMM, fp32 output by default: logits_dtype)
  loss_C, lse_C, dlogits_CV = kernel(logits_CV)   our CUDA kernel (on Hopper each logit is read
                                  from DRAM once: a thread-block cluster keeps the row in shared
                                  memory between its two passes); dlogits in the compute dtype,
                                  written over the logits buffer when the dtypes match
                                  (input_output_aliases)
  dh_CD = dlogits_CV @ W^T        (saved; the backward rule only scales it: dh = g * dh)
The head gradient dW = h^T @ dlogits sums over all N tokens; `head_grad` picks how:
  "vocab_chunks" (default). Pass 2, in the backward rule, over blocks of Cv vocabulary columns
    (`vocab_chunk`, a static smaller last block, no padded columns):
      x_NCv = h_ND @ W[:, v]      (the block's logits recomputed, logits_dtype)
      dl_NCv = g w (1 + 2 z lse) exp(x - lse) - g w [t == v]   (pass 1's lse; pure jnp, XLA fuses
                                  it: one read of x, one write of dl in the compute dtype; rows
                                  with w = 0 give 0, supervised out-of-range targets NaN)
      dW[:, v] = h_ND^T @ dl_NCv  (fp32 accumulation inside the GEMM over all N tokens, written
                                  once in W's dtype into the loop-carried dW: no [D, V]
                                  accumulator, and one rounding instead of one per token chunk)
    g is folded into dl before its cast (bf16/f32 share fp32's exponent range); for f16, where
    that could flush small probabilities to zero, the GEMM writes fp32 and is scaled after.
    Cost: 4 GEMMs of 2 N D V FLOPs for full fine-tuning (the block logits are recomputed).
  "token_accum". Pass 1 also accumulates dW_DV += h_CD^T @ dlogits_CV across token chunks in an
    fp32 (`dhead_accum_dtype`) [D, V] accumulator and saves dW; the backward rule scales it.
    3 GEMMs, but D x V x 4 bytes more memory (0.6 GB at D = 1024, 2.5 GB at D = 4096, V = 151936)
    and that accumulator's read+write per chunk.
dW is computed only when the head is being differentiated (full fine-tuning): the custom_vjp uses
symbolic zeros, so with a frozen head (LoRA) its forward sees `perturbed=False` and skips pass 2
(or the dW GEMMs); likewise dh when hidden is not differentiated (then pass 1 runs the loss-only
kernel for loss and lse). Outside differentiation (eval) only the loss is computed (one GEMM and a
loss-only kernel pass per chunk). The pure-JAX chunked loss (lm_head_ce_ref) recomputes every
chunk's logits in its backward too, but holds dW across chunks like "token_accum".

Memory (per call, besides inputs/outputs; the peak is the larger pass, they never overlap):
pass 1 holds one chunk's logits (C x V x 4 bytes, fp32) + dlogits (C x V x 2, bf16; none extra
when logits_dtype == compute dtype, in place) and the saved dh rows [N, D] (+ lse [N] fp32);
pass 2 holds one block's x [N, Cv] (fp32) + dl [N, Cv] (compute dtype) + [D, Cv] slices of W and
dW, its output being dW itself. With "token_accum" add the fp32 [D, V] accumulator (and its
cast) during pass 1.
The chunk length C (`chunk`, default `default_chunk(...)`: 512 tokens for fp32 logits at V = 151936,
1536 for bf16 logits; with "token_accum" and a trainable head at least 2048, to amortize the
accumulator's read+write per chunk: 8 D V bytes against 6 C D V GEMM FLOPs, ~330/C of the GEMM
time on an H100) trades that memory against GEMM efficiency. The vocab block Cv
(`vocab_chunk`, default `default_vocab_chunk(...)`: the largest multiple of 256 whose pass-2
buffers fit 512 MiB, then evened out over the same number of blocks: 16896 at N = 4096,
D = 1024, V = 151936; 12800 at D = 4096) does the same for pass 2; larger blocks make the two
[N, D] x [D, Cv] / [D, N] x [N, Cv] GEMMs more efficient. Expected peak temporaries at N = 4096,
V = 151936, bf16: ~0.45-0.5 GiB (either pass; estimated from the buffer sizes above) against
~7 GiB for the unfused loss.

Sharding: with `mesh=` both passes run per data shard (ops/_sharding.on_shards): tokens (and their lse) split
along the leading axis, W replicated, the loss sum and dW (each shard's over its own tokens) psum-ed
(on an Explicit mesh on_shards also brings replicated targets/mask or a sharded head to those layouts
itself).

Implementations (`impl`, see ops/_loader.py): the CUDA row kernel (kernels/lm_head_ce.cu through
ffi/lm_head_ce.cc) or its pure-jnp twin `_rows_ref` inside the same chunked custom_vjp;
`lm_head_ce_ref` is the independent autodiff reference (the plain chunked scan with jax.checkpoint,
fp32 softmax) the tests compare against. Design follows the fused linear cross-entropy of
Liger-Kernel (chunked GEMM + in-place logits gradient) and Apple's Cut Cross-Entropy analysis
(Wijmans et al. 2024, arXiv:2411.09009) of where the memory goes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._loader import resolve_impl
from surogate_jax.ops._sharding import on_shards

LOSS_TARGET = "surogate_lm_head_ce_loss"
GRAD_TARGET = "surogate_lm_head_ce_grad"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
LAYOUTS = ("DV", "VD")
KERNELS = {"auto": 0, "two_pass": 1}  # gradient kernel variants (kernels/lm_head_ce.h LmHeadCeAlgo)
IGNORE_INDEX = -100
# Default chunk: the largest multiple of 256 tokens whose logits (+ dlogits) fit this many bytes,
# at least MIN_CHUNK (GEMM efficiency) and at least GRAD_HEAD_MIN_CHUNK with a trainable head.
# (512 MiB: 512 tokens of fp32 logits + bf16 dlogits at V = 151936, ~1/15 of the unfused
# loss's ~7.1 GiB of temporaries at 4096 tokens; 1536 tokens of in-place bf16 logits.)
CHUNK_BYTES = 1 << 29
MIN_CHUNK = 512
GRAD_HEAD_MIN_CHUNK = 2048


HEAD_GRADS = ("vocab_chunks", "token_accum")  # how d_head is computed (module docstring, "Backward")
# Default vocab block of pass 2: the largest multiple of 256 columns whose logits + dlogits [N, Cv]
# and W / d_head slices [D, Cv] fit CHUNK_BYTES, at least MIN_VOCAB_CHUNK (GEMM efficiency).
MIN_VOCAB_CHUNK = 2048


def default_chunk(vocab: int, logits_dtype, compute_dtype, head_grad: bool) -> int:
    """Tokens per chunk when the caller gives none (see the module docstring for the trade-off).
    head_grad: the chunk loop accumulates d_head (head_grad="token_accum" with a trainable head)."""
    per_token = vocab * jnp.dtype(logits_dtype).itemsize
    if jnp.dtype(logits_dtype) != jnp.dtype(compute_dtype):
        per_token += vocab * jnp.dtype(compute_dtype).itemsize  # separate dlogits buffer
    c = max(MIN_CHUNK, CHUNK_BYTES // per_token // 256 * 256)
    return max(c, GRAD_HEAD_MIN_CHUNK) if head_grad else c


def default_vocab_chunk(tokens: int, hidden: int, vocab: int, logits_dtype, compute_dtype) -> int:
    """Vocabulary columns per pass-2 block (head_grad="vocab_chunks") when the caller gives none:
    ~CHUNK_BYTES of [tokens, Cv] logits + dlogits and two [hidden, Cv] slices (W's, d_head's)."""
    cb = jnp.dtype(compute_dtype).itemsize
    per_col = tokens * (jnp.dtype(logits_dtype).itemsize + cb) + 2 * hidden * cb
    return min(vocab, max(MIN_VOCAB_CHUNK, CHUNK_BYTES // per_col // 256 * 256))


# ------------------------------------------------------------------------------------------------
# Small shared helpers


def _token_weights(targets_N, mask_N, ignore_index):
    w = jnp.ones(targets_N.shape, jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.where(targets_N == ignore_index, 0.0, w))


def _logits(h_CD, W, layout, out_dtype):
    """h_CD @ W in fp32 accumulation; W is [D, V] ("DV") or [V, D] ("VD")."""
    dims = (((1,), (0,)), ((), ())) if layout == "DV" else (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(h_CD, W, dims, preferred_element_type=out_dtype)


def _dhidden(dl_CV, W, layout, out_dtype):
    dims = (((1,), (1,)), ((), ())) if layout == "DV" else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(dl_CV, W, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def _dhead(h_CD, dl_CV, layout, out_dtype):
    """h^T @ dlogits in W's layout (fp32 accumulation inside the GEMM, output in out_dtype)."""
    if layout == "DV":
        return jax.lax.dot_general(h_CD, dl_CV, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)
    return jax.lax.dot_general(dl_CV, h_CD, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)


# ------------------------------------------------------------------------------------------------
# Reference: the plain chunked loss, differentiated by JAX (recomputes each chunk in backward)


def lm_head_ce_ref(hidden, head, targets, mask=None, *, head_layout: str = "DV", z_loss: float = 0.0,
                   ignore_index: int = IGNORE_INDEX, chunk: int = 2048):
    """Pure-JAX reference (autodiff-able): (weighted sum of token CE (+ z-loss), sum of weights).

    Same contract as `lm_head_ce`; fp32 logits and softmax; each chunk is rematerialized in the
    backward pass (jax.checkpoint), so at most one chunk's [C, V] fp32 logits exist at a time.
    """
    D = hidden.shape[-1]
    h_ND = hidden.reshape(-1, D)
    W = head.astype(hidden.dtype)
    V = W.shape[1] if head_layout == "DV" else W.shape[0]
    t_N = targets.reshape(-1).astype(jnp.int32)
    w_N = _token_weights(t_N, None if mask is None else mask.reshape(-1), ignore_index)
    n = h_ND.shape[0]
    if n == 0:
        return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    chunk = max(1, min(chunk, n))
    pad = (-n) % chunk
    if pad:
        h_ND = jnp.pad(h_ND, ((0, pad), (0, 0)))
        t_N = jnp.pad(t_N, (0, pad))
        w_N = jnp.pad(w_N, (0, pad))
    k = h_ND.shape[0] // chunk

    @jax.checkpoint
    def chunk_loss(h_CD, t_C, w_C):
        x = _logits(h_CD, W, head_layout, jnp.float32)
        lse = jax.nn.logsumexp(x, axis=-1)
        valid = (t_C >= 0) & (t_C < V)
        xt = jnp.take_along_axis(x, jnp.clip(t_C, 0, V - 1)[:, None], axis=-1)[:, 0]
        row = w_C * (lse - jnp.where(valid, xt, jnp.nan) + z_loss * jnp.square(lse))
        return jnp.sum(jnp.where(w_C != 0, row, 0.0))

    def body(total, xs):
        return total + chunk_loss(*xs), None

    xs = (h_ND.reshape(k, chunk, D), t_N.reshape(k, chunk), w_N.reshape(k, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total, jnp.sum(w_N)


# ------------------------------------------------------------------------------------------------
# Row functions: per row of a chunk's logits -> loss (and dlogits). The CUDA kernel and its twin.


def _rows_ref(logits_CV, t_C, w_C, z, dl_dtype):
    """Pure-jnp twin of the kernel. Returns (loss_C, lse_C, dlogits_CV or None), fp32 math."""
    V = logits_CV.shape[-1]
    x = logits_CV.astype(jnp.float32)
    active = w_C != 0
    valid = (t_C >= 0) & (t_C < V)
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = (m + jnp.log(s))[:, 0]
    xt = jnp.take_along_axis(x, jnp.clip(t_C, 0, V - 1)[:, None], axis=-1)[:, 0]
    loss = jnp.where(active, jnp.where(valid, w_C * (lse - xt + z * jnp.square(lse)), jnp.nan), 0.0)
    lse = jnp.where(active, jnp.where(valid, lse, jnp.nan), 0.0)
    if dl_dtype is None:
        return loss, lse, None
    coef = (w_C * (1.0 + 2.0 * z * lse))[:, None] / s
    onehot = jnp.arange(V, dtype=jnp.int32)[None, :] == t_C[:, None]
    dl = coef * e - jnp.where(onehot, w_C[:, None], 0.0)
    dl = jnp.where(active[:, None], jnp.where(valid[:, None], dl, jnp.nan), 0.0)
    return loss, lse, dl.astype(dl_dtype)


# vmap_method="broadcast_all": a vmapped call just has more rows (leading dims are flattened by the
# handler), which is exactly the batched semantics of a row-wise op.


def _rows_ffi(logits_CV, t_C, w_C, z, dl_dtype, kernel="auto"):
    rows = logits_CV.shape[:-1]
    f32 = lambda: jax.ShapeDtypeStruct(rows, jnp.float32)
    if dl_dtype is None:
        call = jax.ffi.ffi_call(LOSS_TARGET, (f32(), f32()), vmap_method="broadcast_all")
        loss, lse = call(logits_CV, t_C, w_C, z_loss=np.float32(z))
        return loss, lse, None
    out = (f32(), f32(), jax.ShapeDtypeStruct(logits_CV.shape, dl_dtype))
    # dlogits over the logits buffer when the dtypes match (the logits are dead after this call).
    aliases = {0: 2} if jnp.dtype(dl_dtype) == logits_CV.dtype else None
    call = jax.ffi.ffi_call(GRAD_TARGET, out, vmap_method="broadcast_all", input_output_aliases=aliases)
    return call(logits_CV, t_C, w_C, z_loss=np.float32(z), algo=np.int32(KERNELS[kernel]))


def _rows_fn(impl, kernel):
    ffi = functools.partial(_rows_ffi, kernel=kernel)
    if impl == "ref":
        return _rows_ref
    if impl == "ffi":
        return ffi

    def auto(logits_CV, t_C, w_C, z, dl_dtype):
        kw = {"z": z, "dl_dtype": dl_dtype}
        return jax.lax.platform_dependent(logits_CV, t_C, w_C, cuda=functools.partial(ffi, **kw),
                                          default=functools.partial(_rows_ref, **kw))

    return auto


# ------------------------------------------------------------------------------------------------
# The chunked drivers (run per shard)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    layout: str
    z_loss: float
    chunk: int | None
    logits_dtype: str  # numpy dtype name
    impl: str
    kernel: str = "auto"
    dhead_accum: str = "float32"  # token_accum: dtype of the head-gradient accumulator across chunks
    head_grad: str = "vocab_chunks"  # see HEAD_GRADS
    vocab_chunk: int | None = None  # vocab_chunks: columns per pass-2 chunk (None: default_vocab_chunk)
    mesh: Mesh | AbstractMesh | None = None  # tokens split over its data axes (on_shards); None: whole


def _chunked(h_ND, W, t_N, w_N, *, cfg: _Cfg, need_dh: bool, need_dw: bool, grad: bool, need_lse: bool = False):
    """Scan over chunks of tokens. Returns [loss_sum] + [dh_ND if need_dh] + [dW (W.dtype) if need_dw]
    + [lse_N (fp32) if need_lse]; dh/dW only when grad."""
    N, D = h_ND.shape
    ldt = jnp.dtype(cfg.logits_dtype)
    V = W.shape[1] if cfg.layout == "DV" else W.shape[0]
    C = cfg.chunk or default_chunk(V, ldt, h_ND.dtype, grad and need_dw)
    C = max(1, min(C, N))
    k, r = divmod(N, C)
    rows = functools.partial(_rows_fn(cfg.impl, cfg.kernel), z=cfg.z_loss)
    need_dh, need_dw = grad and need_dh, grad and need_dw

    def one(h_CD, t_C, w_C, dw_acc):
        logits = _logits(h_CD, W, cfg.layout, ldt)
        if not (need_dh or need_dw):  # loss (and lse) only: the loss-only kernel
            loss, lse, _ = rows(logits, t_C, w_C, dl_dtype=None)
            return jnp.sum(loss), None, lse if need_lse else None, dw_acc
        loss, lse, dl = rows(logits, t_C, w_C, dl_dtype=h_ND.dtype)
        dh = _dhidden(dl, W, cfg.layout, h_ND.dtype) if need_dh else None
        if need_dw:  # written as acc + dot so XLA can fuse the add into the GEMM (beta = 1)
            dw_acc = dw_acc + _dhead(h_CD, dl, cfg.layout, dw_acc.dtype)
        return jnp.sum(loss), dh, lse if need_lse else None, dw_acc

    dw0 = jnp.zeros(W.shape, jnp.dtype(cfg.dhead_accum)) if need_dw else None
    total = jnp.zeros((), jnp.float32)
    dh_parts, lse_parts = [], []
    if k:
        def body(carry, xs):
            tot, acc = carry
            l, dh, lse, acc = one(*xs, acc)
            return (tot + l, acc), (dh, lse)

        xs = (h_ND[: k * C].reshape(k, C, D), t_N[: k * C].reshape(k, C), w_N[: k * C].reshape(k, C))
        (total, dw0), (dh_k, lse_k) = jax.lax.scan(body, (total, dw0), xs)
        if dh_k is not None:
            dh_parts.append(dh_k.reshape(k * C, D))
        if lse_k is not None:
            lse_parts.append(lse_k.reshape(k * C))
    if r:  # the last partial chunk, at its own (static) size: no padded GEMM rows
        l, dh, lse, dw0 = one(h_ND[k * C:], t_N[k * C:], w_N[k * C:], dw0)
        total = total + l
        if dh is not None:
            dh_parts.append(dh)
        if lse is not None:
            lse_parts.append(lse)
    cat = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    outs = [total]
    if need_dh:
        outs.append(cat(dh_parts))
    if need_dw:
        outs.append(dw0.astype(W.dtype))
    if need_lse:
        outs.append(cat(lse_parts))
    return tuple(outs)


def _vocab_blocks(V: int, Cv: int) -> tuple[int, int, int]:
    """(k, Cv, r): k full blocks of Cv columns + a static remainder of r < Cv. The requested Cv is
    evened out over the same number of blocks (rounded up to a multiple of 256 where that keeps the
    count), so the remainder GEMM is not a sliver."""
    Cv = max(1, min(Cv, V))
    n = -(-V // Cv)  # number of blocks at the requested size
    even = -(-V // n)
    even256 = -(-even // 256) * 256
    if -(-V // even256) == n:
        even = even256
    Cv = min(even, V)
    k, r = divmod(V, Cv)
    return k, Cv, r


def _dhead_vocab(h_ND, W, t_N, w_N, lse_N, g, *, cfg: _Cfg):
    """Pass 2 of the vocab_chunks head gradient: dW = g * h^T @ dlogits, one block of Cv vocabulary
    columns at a time (the logits block recomputed from h and W, its softmax from pass 1's lse).
    Returns (dW,) in W's dtype and layout. No [D, V] accumulator: each block's GEMM reduces over
    all N tokens (fp32 accumulation inside the GEMM) and writes its slice of dW once, in place
    (dynamic_update_slice into the loop-carried output)."""
    N, D = h_ND.shape
    ldt = jnp.dtype(cfg.logits_dtype)
    cdt = h_ND.dtype
    dv = cfg.layout == "DV"
    V = W.shape[1] if dv else W.shape[0]
    k, Cv, r = _vocab_blocks(V, cfg.vocab_chunk or default_vocab_chunk(N, D, V, ldt, cdt))
    g = jnp.asarray(g, jnp.float32)
    # g folded into dlogits before their cast to the compute dtype where that dtype has fp32's
    # exponent range (f32, bf16); f16 would flush g-scaled probabilities to zero: there the GEMM
    # writes fp32 and g is applied to its output.
    fold = jnp.finfo(cdt).maxexp >= jnp.finfo(jnp.float32).maxexp
    active = w_N != 0
    valid = (t_N >= 0) & (t_N < V)
    ok = active & valid
    scale = g if fold else jnp.float32(1.0)
    wt_N = jnp.where(ok, scale * w_N, 0.0)  # the one-hot term's weight
    coef_N = wt_N * (1.0 + 2.0 * cfg.z_loss * jnp.where(ok, lse_N, 0.0))
    lse_N = jnp.where(ok, lse_N, 0.0)
    # rows: ok -> gradient; active with a bad target -> NaN (as _rows_ref); inactive -> 0
    fill_N = jnp.where(active & ~valid, jnp.nan, 0.0)

    def block(v0, size):
        Wv = jax.lax.dynamic_slice_in_dim(W, v0, size, axis=1 if dv else 0)
        x = _logits(h_ND, Wv, cfg.layout, ldt).astype(jnp.float32)  # [N, size]
        cols = v0 + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
        dl = coef_N[:, None] * jnp.exp(x - lse_N[:, None]) - jnp.where(cols == t_N[:, None], wt_N[:, None], 0.0)
        dl = jnp.where(ok[:, None], dl, fill_N[:, None]).astype(cdt)
        if fold:
            return _dhead(h_ND, dl, cfg.layout, W.dtype)
        return (g * _dhead(h_ND, dl, cfg.layout, jnp.float32)).astype(W.dtype)

    def put(dW, blk, v0):
        return jax.lax.dynamic_update_slice(dW, blk, (0, v0) if dv else (v0, 0))

    def body(dW, v0):
        return put(dW, block(v0, Cv), v0), None

    dW = jnp.zeros(W.shape, W.dtype)
    dW, _ = jax.lax.scan(body, dW, jnp.arange(k, dtype=jnp.int32) * Cv)
    if r:  # the remainder block at its own static size
        dW = put(dW, block(k * Cv, r), k * Cv)
    return (dW,)


def _sharded(h, W, t, w, *, cfg, need_dh, need_dw, grad, need_lse=False):
    fn = functools.partial(_chunked, cfg=cfg, need_dh=need_dh, need_dw=need_dw, grad=grad, need_lse=need_lse)
    out_batched, out_summed = [False], [True]  # loss sum: per-shard partial sums
    if grad and need_dh:
        out_batched.append(True)
        out_summed.append(False)
    if grad and need_dw:
        out_batched.append(False)
        out_summed.append(True)
    if need_lse:
        out_batched.append(True)
        out_summed.append(False)
    return on_shards(fn, h, W, t, w, mesh=cfg.mesh, batched=(True, False, True, True),
                     out_batched=tuple(out_batched), out_summed=tuple(out_summed))


def _sharded_dhead_vocab(h, W, t, w, lse, g, *, cfg):
    fn = functools.partial(_dhead_vocab, cfg=cfg)
    return on_shards(fn, h, W, t, w, lse, g, mesh=cfg.mesh, batched=(True, False, True, True, True, False),
                     out_batched=(False,), out_summed=(True,))[0]


# ------------------------------------------------------------------------------------------------
# custom_vjp: the forward rule computes the loss, d_hidden (scaled in the backward rule) and, with
# head_grad="token_accum", d_head; with "vocab_chunks" the backward rule computes d_head (pass 2).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lm_head_ce(h, W, t, w, cfg):
    return _sharded(h, W, t, w, cfg=cfg, need_dh=False, need_dw=False, grad=False)[0]


def _vjp_fwd(h, W, t, w, cfg):
    need_dh, need_dw = bool(h.perturbed), bool(W.perturbed)
    h, W, t, w = h.value, W.value, t.value, w.value
    if need_dw and cfg.head_grad == "vocab_chunks":
        # pass 1: loss, lse and (if needed) d_hidden per token chunk; d_head waits for pass 2
        outs = _sharded(h, W, t, w, cfg=cfg, need_dh=need_dh, need_dw=False, grad=need_dh, need_lse=True)
        loss, rest = outs[0], list(outs[1:])
        dh = rest.pop(0) if need_dh else None
        return loss, (dh, None, (h, W, t, w, rest.pop(0)))
    outs = _sharded(h, W, t, w, cfg=cfg, need_dh=need_dh, need_dw=need_dw, grad=need_dh or need_dw)
    loss, rest = outs[0], list(outs[1:])
    dh = rest.pop(0) if need_dh else None
    dW = rest.pop(0) if need_dw else None
    return loss, (dh, dW, None)


def _vjp_bwd(cfg, res, g):
    dh, dW, pass2 = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):  # the loss sum was not used
        return None, None, None, None
    scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
    if pass2 is not None:  # vocab_chunks: d_head = g * h^T dlogits, block by block (g inside)
        return scale(dh), _sharded_dhead_vocab(*pass2, g, cfg=cfg), None, None
    return scale(dh), scale(dW), None, None


_lm_head_ce.defvjp(_vjp_fwd, _vjp_bwd, symbolic_zeros=True)


def _kernel_supports(logits_dtype, compute_dtype) -> bool:
    """The kernel reads logits and writes dlogits (compute dtype): equal dtypes or one is fp32."""
    ok = tuple(jnp.dtype(d) for d in KERNEL_DTYPES)
    ldt, cdt = jnp.dtype(logits_dtype), jnp.dtype(compute_dtype)
    return ldt in ok and cdt in ok and (ldt == cdt or jnp.float32 in (ldt, cdt))


def lm_head_ce(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
               head_layout: str = "DV", z_loss: float = 0.0, ignore_index: int = IGNORE_INDEX,
               chunk: int | None = None, logits_dtype=jnp.float32, head_grad: str = "vocab_chunks",
               vocab_chunk: int | None = None, dhead_accum_dtype=jnp.float32, impl: str | None = None,
               kernel: str = "auto", mesh: Mesh | AbstractMesh | None = None):
    """(weighted sum of token cross-entropy (+ z_loss * lse^2), sum of token weights), float32.

    hidden [..., D]; head [D, V] (head_layout="DV") or [V, D] ("VD", e.g. a tied embedding table);
    targets [...] integers; mask [...] token weights (None: all ones); targets == ignore_index are
    ignored. chunk: tokens per chunk (None: `default_chunk`). logits_dtype: dtype of the logits GEMM
    output the kernel reads (float32 default; the compute dtype halves that traffic and memory and
    works in place, at the price of rounding the logits). head_grad (used only when the head is
    differentiated): "vocab_chunks" (default: d_head in the backward pass, one block of
    `vocab_chunk` vocabulary columns at a time, recomputing that block's logits; no [D, V]
    accumulator) or "token_accum" (d_head accumulated across the token chunks in the forward pass:
    one GEMM fewer, a [D, V] accumulator more). vocab_chunk: columns per block (None:
    `default_vocab_chunk`). dhead_accum_dtype ("token_accum" only): the accumulator's dtype (float32
    default; the head's own dtype halves it at one rounding per chunk). impl: None/"auto", "ffi" or "ref"
    (SUROGATE_JAX_OPS=ref forces the reference). kernel: "auto" (on Hopper, the single-read cluster
    kernel where the row fits its shared memory) or "two_pass" (a tuning/testing knob). mesh: tokens
    are split over its data axes (module docstring, "Sharding"; None: one call on all tokens). The
    loss sum is tagged `checkpoint_name(..., "lm_head_ce")`.
    """
    if head_layout not in LAYOUTS:
        raise ValueError(f"lm_head_ce: head_layout must be one of {LAYOUTS}, got {head_layout!r}")
    if hidden.ndim < 1 or head.ndim != 2:
        raise ValueError(f"lm_head_ce: need hidden [..., D] and a 2-D head, got {hidden.shape}, {head.shape}")
    D = hidden.shape[-1]
    hd = head.shape[0] if head_layout == "DV" else head.shape[1]
    if hd != D:
        raise ValueError(f"lm_head_ce: head {head.shape} (layout {head_layout}) does not match hidden size {D}")
    if targets.shape != hidden.shape[:-1] or (mask is not None and mask.shape != targets.shape):
        raise ValueError(f"lm_head_ce: targets {targets.shape} and mask {None if mask is None else mask.shape} "
                         f"must have shape {hidden.shape[:-1]}")
    if not jnp.issubdtype(hidden.dtype, jnp.floating) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"lm_head_ce: hidden must be floating and targets integer, got {hidden.dtype}, "
                        f"{targets.dtype}")
    if kernel not in KERNELS:
        raise ValueError(f"lm_head_ce: kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"lm_head_ce: chunk must be >= 1, got {chunk}")
    if head_grad not in HEAD_GRADS:
        raise ValueError(f"lm_head_ce: head_grad must be one of {HEAD_GRADS}, got {head_grad!r}")
    if vocab_chunk is not None and vocab_chunk < 1:
        raise ValueError(f"lm_head_ce: vocab_chunk must be >= 1, got {vocab_chunk}")
    impl = resolve_impl(impl, "lm_head_ce")
    ldt = jnp.dtype(logits_dtype)
    if impl != "ref" and not _kernel_supports(ldt, hidden.dtype):
        if impl == "ffi":
            raise TypeError(f"lm_head_ce: impl='ffi' supports float32/bfloat16/float16 with logits in the "
                            f"compute dtype or float32, got hidden {hidden.dtype}, logits {ldt}")
        impl = "ref"
    h_ND = hidden.reshape(-1, D)
    t_N = targets.reshape(-1).astype(jnp.int32)
    w_N = _token_weights(t_N, None if mask is None else mask.reshape(-1), ignore_index)
    count = jnp.sum(w_N)
    if h_ND.shape[0] == 0:
        return jnp.zeros((), jnp.float32), count
    cfg = _Cfg(head_layout, float(z_loss), chunk, ldt.name, impl, kernel, jnp.dtype(dhead_accum_dtype).name,
               head_grad, vocab_chunk, mesh)
    loss = _lm_head_ce(h_ND, head.astype(hidden.dtype), t_N, w_N, cfg)
    return checkpoint_name(loss, "lm_head_ce"), count
