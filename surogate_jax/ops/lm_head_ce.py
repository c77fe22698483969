"""Fused LM head + token cross-entropy, chunked over tokens: [tokens, vocab] logits never exist whole.

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
computes the gradients right away and saves them: per chunk of C tokens
  logits_CV = h_CD @ W            (XLA/cuBLAS GEMM, fp32 output by default: logits_dtype)
  loss_C, dlogits_CV = kernel(logits_CV)   our CUDA kernel (on Hopper each logit is read from
                                  DRAM once: a thread-block cluster keeps the row in shared memory
                                  between its two passes); dlogits in the compute dtype, written over
                                  the logits buffer when the dtypes match (input_output_aliases)
  dh_CD = dlogits_CV @ W^T        dW_DV += h_CD^T @ dlogits_CV  (fp32 accumulator across chunks)
and the backward only scales: dh = g * dh, dW = g * dW. Nothing is recomputed (the pure-JAX
chunked loss recomputed every chunk's logits GEMM in its backward: 4 GEMMs instead of 3). dW is
computed only when the head is being differentiated (full fine-tuning): the custom_vjp uses
symbolic zeros, so with a frozen head (LoRA) its forward sees `perturbed=False` and skips the dW
GEMMs; likewise dh when hidden is not differentiated. Outside differentiation (eval) only the loss
is computed (one GEMM and a loss-only kernel pass per chunk).

Memory (per call, besides inputs/outputs): one chunk's logits (C x V x 4 bytes, fp32) + dlogits
(C x V x 2, bf16; none extra when logits_dtype == compute dtype, in place), the dh rows [N, D], and
with a trainable head the fp32 accumulator [D, V] plus the dW residual in the head's dtype.
The chunk length C (`chunk`, default `default_chunk(...)`: 512 tokens for fp32 logits at V = 151936,
1536 for bf16 logits, at least 2048 with a trainable head) trades that memory against GEMM
efficiency and, with a trainable head, the accumulator's read+write per chunk (8 D V bytes against
6 C D V GEMM FLOPs: ~330/C of the GEMM time on an H100, 16% at C = 2048).

Sharding: the whole chunked computation runs per data shard (ops/_sharding.on_shards): tokens split
along the leading axis, W replicated, the loss sum and dW psum-ed (on an Explicit mesh on_shards
also brings replicated targets/mask or a sharded head to those layouts itself).

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


def default_chunk(vocab: int, logits_dtype, compute_dtype, head_grad: bool) -> int:
    """Tokens per chunk when the caller gives none (see the module docstring for the trade-off)."""
    per_token = vocab * jnp.dtype(logits_dtype).itemsize
    if jnp.dtype(logits_dtype) != jnp.dtype(compute_dtype):
        per_token += vocab * jnp.dtype(compute_dtype).itemsize  # separate dlogits buffer
    c = max(MIN_CHUNK, CHUNK_BYTES // per_token // 256 * 256)
    return max(c, GRAD_HEAD_MIN_CHUNK) if head_grad else c


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
# The chunked driver (runs per shard)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    layout: str
    z_loss: float
    chunk: int | None
    logits_dtype: str  # numpy dtype name
    impl: str
    kernel: str = "auto"
    dhead_accum: str = "float32"  # dtype of the head-gradient accumulator across chunks


def _chunked(h_ND, W, t_N, w_N, *, cfg: _Cfg, need_dh: bool, need_dw: bool, grad: bool):
    """Scan over chunks of tokens. Returns [loss_sum] + [dh_ND if need_dh] + [dW (W.dtype) if need_dw]."""
    N, D = h_ND.shape
    ldt = jnp.dtype(cfg.logits_dtype)
    V = W.shape[1] if cfg.layout == "DV" else W.shape[0]
    C = cfg.chunk or default_chunk(V, ldt, h_ND.dtype, grad and need_dw)
    C = max(1, min(C, N))
    k, r = divmod(N, C)
    rows = functools.partial(_rows_fn(cfg.impl, cfg.kernel), z=cfg.z_loss)

    def one(h_CD, t_C, w_C, dw_acc):
        logits = _logits(h_CD, W, cfg.layout, ldt)
        if not grad:
            loss, _, _ = rows(logits, t_C, w_C, dl_dtype=None)
            return jnp.sum(loss), None, dw_acc
        loss, _, dl = rows(logits, t_C, w_C, dl_dtype=h_ND.dtype)
        dh = _dhidden(dl, W, cfg.layout, h_ND.dtype) if need_dh else None
        if need_dw:  # written as acc + dot so XLA can fuse the add into the GEMM (beta = 1)
            dw_acc = dw_acc + _dhead(h_CD, dl, cfg.layout, dw_acc.dtype)
        return jnp.sum(loss), dh, dw_acc

    dw0 = jnp.zeros(W.shape, jnp.dtype(cfg.dhead_accum)) if grad and need_dw else None
    total = jnp.zeros((), jnp.float32)
    dh_parts = []
    if k:
        def body(carry, xs):
            tot, acc = carry
            l, dh, acc = one(*xs, acc)
            return (tot + l, acc), dh

        xs = (h_ND[: k * C].reshape(k, C, D), t_N[: k * C].reshape(k, C), w_N[: k * C].reshape(k, C))
        (total, dw0), dh_k = jax.lax.scan(body, (total, dw0), xs)
        if dh_k is not None:
            dh_parts.append(dh_k.reshape(k * C, D))
    if r:  # the last partial chunk, at its own (static) size: no padded GEMM rows
        l, dh, dw0 = one(h_ND[k * C:], t_N[k * C:], w_N[k * C:], dw0)
        total = total + l
        if dh is not None:
            dh_parts.append(dh)
    outs = [total]
    if grad and need_dh:
        outs.append(dh_parts[0] if len(dh_parts) == 1 else jnp.concatenate(dh_parts, axis=0))
    if grad and need_dw:
        outs.append(dw0.astype(W.dtype))
    return tuple(outs)


def _sharded(h, W, t, w, *, cfg, need_dh, need_dw, grad):
    fn = functools.partial(_chunked, cfg=cfg, need_dh=need_dh, need_dw=need_dw, grad=grad)
    out_batched, out_summed = [False], [True]  # loss sum: per-shard partial sums
    if grad and need_dh:
        out_batched.append(True)
        out_summed.append(False)
    if grad and need_dw:
        out_batched.append(False)
        out_summed.append(True)
    return on_shards(fn, h, W, t, w, batched=(True, False, True, True), out_batched=tuple(out_batched),
                     out_summed=tuple(out_summed))


# ------------------------------------------------------------------------------------------------
# custom_vjp: the forward rule computes the gradients; the backward rule scales them.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lm_head_ce(h, W, t, w, cfg):
    return _sharded(h, W, t, w, cfg=cfg, need_dh=False, need_dw=False, grad=False)[0]


def _vjp_fwd(h, W, t, w, cfg):
    need_dh, need_dw = bool(h.perturbed), bool(W.perturbed)
    h, W, t, w = h.value, W.value, t.value, w.value
    outs = _sharded(h, W, t, w, cfg=cfg, need_dh=need_dh, need_dw=need_dw, grad=need_dh or need_dw)
    loss, rest = outs[0], list(outs[1:])
    dh = rest.pop(0) if need_dh else None
    dW = rest.pop(0) if need_dw else None
    return loss, (dh, dW)


def _vjp_bwd(cfg, res, g):
    del cfg
    dh, dW = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):  # the loss sum was not used
        return None, None, None, None
    scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
    return scale(dh), scale(dW), None, None


_lm_head_ce.defvjp(_vjp_fwd, _vjp_bwd, symbolic_zeros=True)


def _kernel_supports(logits_dtype, compute_dtype) -> bool:
    """The kernel reads logits and writes dlogits (compute dtype): equal dtypes or one is fp32."""
    ok = tuple(jnp.dtype(d) for d in KERNEL_DTYPES)
    ldt, cdt = jnp.dtype(logits_dtype), jnp.dtype(compute_dtype)
    return ldt in ok and cdt in ok and (ldt == cdt or jnp.float32 in (ldt, cdt))


def lm_head_ce(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
               head_layout: str = "DV", z_loss: float = 0.0, ignore_index: int = IGNORE_INDEX,
               chunk: int | None = None, logits_dtype=jnp.float32, dhead_accum_dtype=jnp.float32,
               impl: str | None = None, kernel: str = "auto"):
    """(weighted sum of token cross-entropy (+ z_loss * lse^2), sum of token weights), float32.

    hidden [..., D]; head [D, V] (head_layout="DV") or [V, D] ("VD", e.g. a tied embedding table);
    targets [...] integers; mask [...] token weights (None: all ones); targets == ignore_index are
    ignored. chunk: tokens per chunk (None: `default_chunk`). logits_dtype: dtype of the logits GEMM
    output the kernel reads (float32 default; the compute dtype halves that traffic and memory and
    works in place, at the price of rounding the logits). dhead_accum_dtype: the head gradient's
    accumulator across chunks (float32 default: [D, V] fp32 while the op runs; the head's own
    dtype halves that at one rounding per chunk). impl: None/"auto", "ffi" or "ref"
    (SUROGATE_JAX_OPS=ref forces the reference). kernel: "auto" (on Hopper, the single-read cluster
    kernel where the row fits its shared memory) or "two_pass" (a tuning/testing knob). The loss
    sum is tagged
    `checkpoint_name(..., "lm_head_ce")`.
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
    cfg = _Cfg(head_layout, float(z_loss), chunk, ldt.name, impl, kernel, jnp.dtype(dhead_accum_dtype).name)
    loss = _lm_head_ce(h_ND, head.astype(hidden.dtype), t_N, w_N, cfg)
    return checkpoint_name(loss, "lm_head_ce"), count
