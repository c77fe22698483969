"""CPU tests of surogate_jax.ops.lm_head_ce: the public op (impl="ref": the chunked custom_vjp with
the kernel's jnp twin) and the autodiff reference `lm_head_ce_ref`, both against a direct
full-logits jnp formulation (loss sum, count, d_hidden, d_head), with z-loss, masks, ignore_index,
tied/[V, D] heads, N not a multiple of the chunk; plus frozen-head / eval program structure, the
ffi/ref selection logic, out-of-range targets, and the per-shard (4-device) run."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import _loader, lm_head_ce, lm_head_ce_ref, resolve_impl
from surogate_jax.ops.lm_head_ce import _rows_ref

N, D, V, CHUNK = 37, 64, 1001, 16


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # The fp32 cases compare differently shaped GEMMs; on a GPU (the GPU session runs tests/ops too)
    # XLA would otherwise use TF32 for them.
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(key, n=N, d=D, v=V, dtype=jnp.float32, layout="DV", mask_frac=0.3, lead=None):
    kh, kw, kt, km = jax.random.split(key, 4)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d) * 3.0).astype(dtype)
    if layout == "VD":
        w = w.T
    t = jax.random.randint(kt, (n,), 0, v)
    m = (jax.random.uniform(km, (n,)) >= mask_frac).astype(jnp.float32)
    if lead is not None:  # [B, T, ...] leading shape
        h, t, m = h.reshape(*lead, d), t.reshape(lead), m.reshape(lead)
    return h, w, t, m


def _direct(h, w, t, m, layout="DV", z_loss=0.0, ignore_index=-100):
    """Full [N, V] fp32 logits, log_softmax: the unfused formulation."""
    hd = h.reshape(-1, h.shape[-1])
    W = w.astype(h.dtype)
    x = jnp.dot(hd, W if layout == "DV" else W.T, preferred_element_type=jnp.float32)
    tt = t.reshape(-1)
    wt = jnp.where(tt == ignore_index, 0.0, m.reshape(-1).astype(jnp.float32))
    lse = jax.nn.logsumexp(x, axis=-1)
    xt = jnp.take_along_axis(x, jnp.clip(tt, 0, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    return jnp.sum(wt * (lse - xt + z_loss * lse * lse)), jnp.sum(wt)


def _value_and_grads(fn, h, w, t, m, **kw):
    def loss(h, w):
        s, c = fn(h, w, t, m, **kw)
        return s, c

    (s, c), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)
    return s, c, dh, dw


def _check(got, want, dtype, assert_close):
    s, c, dh, dw = got
    s_r, c_r, dh_r, dw_r = want
    assert dh.dtype == dh_r.dtype and dw.dtype == dw_r.dtype
    # The loss comes from the same fp32-accumulated GEMM in both: fp32 tolerance.
    assert_close(s, s_r, jnp.float32, "loss sum")
    assert float(c) == float(c_r)
    assert_close(dh, dh_r, dtype, "d_hidden")
    assert_close(dw, dw_r, dtype, "d_head")


# head_grad -> extra arguments: vocab blocks of 256 columns (3 + a 233-column remainder at V = 1001)
HEAD_GRADS = {"vocab_chunks": {"head_grad": "vocab_chunks", "vocab_chunk": 300},
              "token_accum": {"head_grad": "token_accum"}}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", ["DV", "VD"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("head_grad", list(HEAD_GRADS))
def test_op_and_reference_match_direct(dtype, layout, z_loss, head_grad, assert_close):
    h, w, t, m = _inputs(jax.random.key(7), dtype=dtype, layout=layout)
    t = t.at[3].set(-100)  # an ignored position
    want = _value_and_grads(_direct, h, w, t, m, layout=layout, z_loss=z_loss)
    op = jax.jit(lambda *a: _value_and_grads(
        lambda h, w, t, m: lm_head_ce(h, w, t, m, head_layout=layout, z_loss=z_loss, chunk=CHUNK,
                                      impl="ref", **HEAD_GRADS[head_grad]), *a))
    _check(op(h, w, t, m), want, dtype, assert_close)
    if head_grad == "token_accum":  # (the reference does not depend on head_grad)
        ref = _value_and_grads(lm_head_ce_ref, h, w, t, m, head_layout=layout, z_loss=z_loss, chunk=CHUNK)
        _check(ref, want, dtype, assert_close)


@pytest.mark.parametrize("case", [  # (dtype, layout, N, V, chunk, vocab_chunk)
    ("float32", "DV", 37, 1001, 16, 7),       # many blocks (143 of 7), no remainder
    ("float32", "VD", 37, 1001, 16, 1000),    # 2 blocks of 501 / 500
    ("bfloat16", "DV", 29, 32003, 8, 4096),   # 7 blocks of 4096 + 3331
    ("bfloat16", "VD", 29, 32003, None, None),  # defaults: one block
    ("float16", "DV", 37, 1001, 16, 300),     # f16: g applied to the fp32 GEMM output
    ("float16", "VD", 37, 1001, 16, 5000),    # block larger than V
], ids=str)
def test_vocab_chunks_head_grad(case, assert_close):
    """The default head gradient (pass 2 over vocab blocks) with a loss cotangent g != 1 (a mean
    loss times a constant), z-loss, a zero-weight mask, ignore_index, N not a multiple of the
    chunk and V not a multiple of the block, against the direct full-logits formulation."""
    name, layout, n, v, chunk, vchunk = case
    dtype = jnp.dtype(name)
    h, w, t, m = _inputs(jax.random.key(n + v), n=n, v=v, dtype=dtype, layout=layout)
    t = t.at[3].set(-100).at[0].set(v - 1).at[1].set(0)
    m = m.at[0].set(1.0).at[1].set(1.0)
    kw = {"layout": layout, "z_loss": 1e-3}

    def mean(fn, **kw):
        def loss(h, w):
            s, c = fn(h, w, t, m, **kw)
            return 0.37 * s / c
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    want = mean(_direct, **kw)(h, w)
    got = mean(lm_head_ce, head_layout=layout, z_loss=1e-3, chunk=chunk, vocab_chunk=vchunk, impl="ref")(h, w)
    assert got[1][1].dtype == w.dtype and got[1][1].shape == w.shape
    assert_close(got[0], want[0], jnp.float32, "loss")
    assert_close(got[1][0], want[1][0], dtype, "d_hidden")
    assert_close(got[1][1], want[1][1], dtype, "d_head")


def test_vocab_blocks():
    from surogate_jax.ops.lm_head_ce import _vocab_blocks, default_vocab_chunk
    for v, c in [(1001, 300), (1001, 7), (1001, 5000), (32003, 4096), (151936, 18688), (7, 3), (1, 1)]:
        k, cv, r = _vocab_blocks(v, c)
        assert k * cv + r == v and 0 <= r < cv and k >= 1
        assert -(-v // cv) == -(-v // min(c, v))  # evening out keeps the number of blocks
    assert _vocab_blocks(1001, 300) == (3, 256, 233)
    # the pass-2 buffers of the default block fit CHUNK_BYTES at the shapes
    from surogate_jax.ops.lm_head_ce import CHUNK_BYTES
    for d in (1024, 4096):
        c = default_vocab_chunk(4096, d, 151936, jnp.float32, jnp.bfloat16)
        assert c % 256 == 0 and c * (4096 * 6 + 2 * d * 2) <= CHUNK_BYTES


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 64, None])
def test_chunk_sizes_and_leading_shape(chunk, assert_close):
    h, w, t, m = _inputs(jax.random.key(chunk or 0), lead=(1, 37))
    want = _value_and_grads(_direct, h, w, t, m)
    got = _value_and_grads(lambda *a: lm_head_ce(*a, chunk=chunk, impl="ref"), h, w, t, m)
    assert got[2].shape == h.shape
    _check(got, want, jnp.float32, assert_close)


def test_tied_embedding_both_layouts(assert_close):
    # head = embedding.T given as a transposed [D, V] view, or the [V, D] table itself.
    h, emb, t, m = _inputs(jax.random.key(3), layout="VD")
    a = _value_and_grads(lambda h, e, t, m: lm_head_ce(h, e.T, t, m, chunk=CHUNK, impl="ref"), h, emb, t, m)
    b = _value_and_grads(lambda h, e, t, m: lm_head_ce(h, e, t, m, head_layout="VD", chunk=CHUNK, impl="ref"),
                         h, emb, t, m)
    assert a[3].shape == emb.shape == b[3].shape
    _check(a, b, jnp.float32, assert_close)


def test_float_head_with_bf16_hidden(assert_close):
    # An fp32 head is cast to the compute dtype; its gradient comes back in fp32.
    h, w, t, m = _inputs(jax.random.key(4), dtype=jnp.bfloat16)
    w32 = w.astype(jnp.float32)
    got = _value_and_grads(lambda *a: lm_head_ce(*a, chunk=CHUNK, impl="ref"), h, w32, t, m)
    want = _value_and_grads(lambda h, w, t, m: _direct(h, w.astype(jnp.bfloat16), t, m), h, w32, t, m)
    assert got[3].dtype == jnp.float32
    _check(got, want, jnp.bfloat16, assert_close)


def test_bf16_head_grad_accumulator(tolerance, assert_close):
    # The head gradient accumulated across chunks (2 + a tail) in bf16 instead of fp32.
    h, w, t, m = _inputs(jax.random.key(14), dtype=jnp.bfloat16)
    want = _value_and_grads(_direct, h, w, t, m)
    got = _value_and_grads(lambda *a: lm_head_ce(*a, chunk=CHUNK, head_grad="token_accum",
                                                 dhead_accum_dtype=jnp.bfloat16, impl="ref"), h, w, t, m)
    _check(got[:3] + (want[3],), want, jnp.bfloat16, assert_close)  # loss, count, d_hidden
    # d_head is rounded to bf16 once per chunk (3 times) instead of once: 3x bf16's tolerance.
    tol = 3 * tolerance(jnp.bfloat16)["rtol"]
    ref = np.asarray(want[3], np.float32)
    np.testing.assert_allclose(np.asarray(got[3], np.float32), ref, rtol=tol, atol=tol * np.sqrt(np.mean(ref**2)))
    bf16_dv = f"bf16[{D},{V}]"
    jaxpr = _jaxpr(jax.grad(lambda w: lm_head_ce(h, w, t, m, chunk=CHUNK, head_grad="token_accum",
                                                 dhead_accum_dtype=jnp.bfloat16, impl="ref")[0]), w)
    assert f"{bf16_dv} = dot_general" in jaxpr  # the per-chunk head gradient GEMM writes bf16
    assert f"f32[{D},{V}] = dot_general" not in jaxpr and f"f32[{D},{V}] = add" not in jaxpr


def test_no_mask_all_ones_and_all_masked(assert_close):
    h, w, t, _ = _inputs(jax.random.key(5))
    s, c = lm_head_ce(h, w, t, None, chunk=CHUNK, impl="ref")
    s_r, c_r = _direct(h, w, t, jnp.ones_like(t, jnp.float32))
    assert_close(s, s_r, jnp.float32)
    assert float(c) == N == float(c_r)
    zero = jnp.zeros((N,), jnp.float32)
    s, c, dh, dw = _value_and_grads(lambda *a: lm_head_ce(*a, chunk=CHUNK, impl="ref"), h, w, t, zero)
    assert float(s) == 0 and float(c) == 0
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_weights_scale_loss_and_grads(assert_close):
    h, w, t, _ = _inputs(jax.random.key(6))
    m = jax.random.uniform(jax.random.key(60), (N,), minval=0.0, maxval=2.0)
    want = _value_and_grads(_direct, h, w, t, m)
    got = _value_and_grads(lambda *a: lm_head_ce(*a, chunk=CHUNK, impl="ref"), h, w, t, m)
    assert_close(got[1], want[1], jnp.float32)
    _check(got[:1] + (want[1],) + got[2:], want, jnp.float32, assert_close)


def test_out_of_range_targets():
    h, w, t, m = _inputs(jax.random.key(8), mask_frac=0.0)
    # masked positions may hold any target (padding): ignored
    t_bad = t.at[2].set(V + 5).at[4].set(-7)
    m0 = m.at[2].set(0.0).at[4].set(0.0)
    for fn in (lambda *a: lm_head_ce(*a, chunk=CHUNK, impl="ref"), lambda *a: lm_head_ce_ref(*a, chunk=CHUNK)):
        s, c = fn(h, w, t_bad, m0)
        assert np.isfinite(float(s)) and float(c) == N - 2
        # a supervised out-of-range target: the loss sum is NaN
        s, c = fn(h, w, t_bad, m)
        assert np.isnan(float(s)) and float(c) == N
    for head_grad, kw in HEAD_GRADS.items():
        op = lambda *a, kw=kw: lm_head_ce(*a, chunk=CHUNK, impl="ref", **kw)
        _, _, dh, dw = _value_and_grads(op, h, w, t_bad, m)
        dh = np.asarray(dh)
        assert np.all(np.isnan(dh[2])) and np.all(np.isnan(dh[4])) and np.all(np.isfinite(dh[5])), head_grad
        assert np.all(np.isnan(np.asarray(dw))), head_grad  # every column sums the NaN rows
        # masked bad targets: finite gradients
        _, _, dh, dw = _value_and_grads(op, h, w, t_bad, m0)
        assert np.all(np.isfinite(np.asarray(dh))) and np.all(np.isfinite(np.asarray(dw))), head_grad


def test_rows_twin_against_numpy(assert_close):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 130)) * 4
    t = rng.integers(0, 130, 9)
    w = rng.uniform(0.5, 1.5, 9)
    w[1] = 0.0
    z = 0.05
    lse = np.log(np.sum(np.exp(x - x.max(1, keepdims=True)), 1)) + x.max(1)
    loss = w * (lse - x[np.arange(9), t] + z * lse**2)
    p = np.exp(x - lse[:, None])
    dl = w[:, None] * (p * (1 + 2 * z * lse)[:, None] - np.eye(130)[t])
    loss[1], lse[1], dl[1] = 0, 0, 0
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    got_loss, got_lse, got_dl = _rows_ref(f32(x), jnp.asarray(t, jnp.int32), f32(w), z, jnp.float32)
    assert_close(got_loss, loss, jnp.float32, "loss")
    assert_close(got_lse, lse, jnp.float32, "lse")
    assert_close(got_dl, dl, jnp.float32, "dlogits")


def _jaxpr(fn, *args):
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("head_grad", list(HEAD_GRADS))
def test_frozen_head_skips_dhead_and_eval_skips_grads(head_grad):
    h, w, t, m = _inputs(jax.random.key(9), dtype=jnp.bfloat16)
    dv = f"f32[{D},{V}]"  # only the fp32 dW accumulator has this type (the head is bf16)
    op = lambda h, w: lm_head_ce(h, w, t, m, chunk=CHUNK, impl="ref", **HEAD_GRADS[head_grad])[0]
    full = _jaxpr(jax.grad(op, argnums=(0, 1)), h, w)
    frozen = _jaxpr(jax.grad(op), h, w)  # LoRA: no gradient for the head
    evaluation = _jaxpr(op, h, w)
    if head_grad == "token_accum":
        assert dv in full  # the fp32 [D, V] accumulator
    else:  # no [D, V] fp32 value at all; d_head blocks written in place into the bf16 output
        assert dv not in full and "dynamic_update_slice" in full
    assert dv not in frozen and dv not in evaluation
    assert full.count("dot_general") > frozen.count("dot_general") > evaluation.count("dot_general")
    assert evaluation.count("dot_general") == 2  # the scan's logits GEMM + the tail chunk's
    # frozen head gives the same d_hidden
    g_full = jax.grad(op, argnums=(0, 1))(h, w)[0]
    np.testing.assert_array_equal(np.asarray(jax.grad(op)(h, w)), np.asarray(g_full))
    # a frozen hidden (head only) gives the same d_head
    g_head = jax.grad(op, argnums=1)(h, w)
    g_both = jax.grad(op, argnums=(0, 1))(h, w)[1]
    np.testing.assert_array_equal(np.asarray(g_head, np.float32), np.asarray(g_both, np.float32))


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.cpu  # the CPU compiler's buffer plan; test_lm_head_ce_gpu.py checks the GPU's
def test_vocab_chunks_compiled_memory():
    """With a trainable head, the compiled temporaries of jit(grad) hold no [D, V] fp32 accumulator:
    far below the unfused loss's and below D * V * 4 bytes; "token_accum" at the same chunk holds
    about that accumulator more. (CPU figures; the GPU test checks the issue's shape.)"""
    n, d, v = 512, 256, 32000
    sds = jax.ShapeDtypeStruct
    args = (sds((n, d), jnp.bfloat16), sds((d, v), jnp.bfloat16), sds((n,), jnp.int32), sds((n,), jnp.float32))

    def grad(fn):
        return jax.value_and_grad(lambda h, w, t, m: fn(h, w, t, m)[0], argnums=(0, 1))

    unfused = _temp_bytes(grad(_direct), *args)
    kw = {"chunk": 32, "impl": "ref"}
    vocab = _temp_bytes(grad(lambda *a: lm_head_ce(*a, vocab_chunk=1024, **kw)), *args)
    accum = _temp_bytes(grad(lambda *a: lm_head_ce(*a, head_grad="token_accum", **kw)), *args)
    print(f"temp MiB: unfused {unfused / 2**20:.1f}, vocab_chunks {vocab / 2**20:.1f}, "
          f"token_accum {accum / 2**20:.1f}, D*V*4 {d * v * 4 / 2**20:.1f}")
    assert vocab * 10 <= unfused
    assert vocab < d * v * 4 / 2
    assert accum - vocab >= d * v * 4 * 0.75


def test_grad_under_remat_vmap_and_unused_loss(assert_close):
    h, w, t, m = _inputs(jax.random.key(10))
    op = lambda h, w: lm_head_ce(h, w, t, m, chunk=CHUNK, impl="ref")
    g = jax.grad(jax.checkpoint(lambda h, w: op(h, w)[0]), argnums=(0, 1))(h, w)
    g_ref = jax.grad(lambda h, w: _direct(h, w, t, m)[0], argnums=(0, 1))(h, w)
    assert_close(g[0], g_ref[0], jnp.float32)
    assert_close(g[1], g_ref[1], jnp.float32)
    # only the count used: zero gradients
    gz = jax.grad(lambda h: op(h, w)[1] + 0.0 * op(h, w)[0])(h)
    assert not np.any(np.asarray(gz))
    # vmap over independent batches
    hb = jnp.stack([h, -h])
    got = jax.vmap(lambda h: op(h, w)[0])(hb)
    want = jnp.stack([_direct(h, w, t, m)[0], _direct(-h, w, t, m)[0]])
    assert_close(got, want, jnp.float32)


def test_zero_tokens():
    h = jnp.zeros((0, D), jnp.float32)
    w = jnp.ones((D, V), jnp.float32)
    t = jnp.zeros((0,), jnp.int32)
    s, c = lm_head_ce(h, w, t, None, impl="ref")
    assert float(s) == 0 and float(c) == 0
    dw = jax.grad(lambda w: lm_head_ce(h, w, t, None, impl="ref")[0])(w)
    assert dw.shape == w.shape and not np.any(np.asarray(dw))


def test_env_forces_reference_and_ffi_selection(monkeypatch, force_ref, assert_close):
    h, w, t, m = _inputs(jax.random.key(11), dtype=jnp.bfloat16)
    grad = lambda impl, **kw: jax.grad(
        lambda h: lm_head_ce(h, w, t, m, chunk=CHUNK, impl=impl, **kw)[0])
    # Register the real extension first where there is one (this file also runs in the GPU
    # session, where "auto" then runs the kernel and needs its targets registered).
    have_ffi = _loader.ffi_available()
    # Pretend the extension is there: impl="ffi" traces the FFI targets (tracing needs no GPU).
    monkeypatch.setattr(_loader, "ffi_available", lambda: True)
    traced = _jaxpr(grad("ffi"), h)
    assert "surogate_lm_head_ce_grad" in traced
    assert "surogate_lm_head_ce_grad" in _jaxpr(grad("ffi", kernel="two_pass"), h)
    assert "surogate_lm_head_ce_loss" in _jaxpr(lambda h: lm_head_ce(h, w, t, m, impl="ffi")[0], h)
    # bf16 logits = compute dtype: dlogits written over the logits buffer
    assert "input_output_aliases" in _jaxpr(grad("ffi", logits_dtype=jnp.bfloat16), h)
    # "auto" lowers the kernel for CUDA and the reference elsewhere: on CPU it runs the reference.
    if jax.default_backend() == "cpu" or have_ffi:
        auto = jax.jit(grad(None))(h)
        assert_close(auto, grad("ref")(h), jnp.bfloat16)
    with pytest.raises(TypeError, match="ffi"):
        lm_head_ce(h, w, t, m, impl="ffi", logits_dtype=jnp.float16)  # bf16 -> f16 pair: no kernel
    force_ref("ref")
    assert resolve_impl("ffi") == "ref"
    assert "surogate_lm_head_ce" not in _jaxpr(grad("ffi"), h)


def test_bad_arguments():
    h, w, t, m = _inputs(jax.random.key(12))
    with pytest.raises(ValueError, match="layout"):
        lm_head_ce(h, w, t, m, head_layout="dv")
    with pytest.raises(ValueError, match="hidden size"):
        lm_head_ce(h, w.T, t, m)
    with pytest.raises(ValueError, match="targets"):
        lm_head_ce(h, w, t[:-1], m)
    with pytest.raises(TypeError, match="integer"):
        lm_head_ce(h, w, t.astype(jnp.float32), m)
    with pytest.raises(ValueError, match="chunk"):
        lm_head_ce(h, w, t, m, chunk=0)
    with pytest.raises(ValueError, match="kernel"):
        lm_head_ce(h, w, t, m, kernel="one_pass")


def test_checkpoint_name_tag():
    h, w, t, m = _inputs(jax.random.key(13))
    assert "lm_head_ce" in _jaxpr(lambda h: lm_head_ce(h, w, t, m, impl="ref")[0], h)


SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import lm_head_ce
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
h = jnp.asarray(rng.normal(size=(8, 5, 16)), jnp.float32)
w = jnp.asarray(rng.normal(size=(16, 101)) * 0.3, jnp.float32)
t = jnp.asarray(rng.integers(0, 101, size=(8, 5)), jnp.int32)
m = jnp.asarray(rng.uniform(size=(8, 5)) > 0.3, jnp.float32)

def loss(h, w, head_grad="vocab_chunks", mesh=None):
    s, c = lm_head_ce(h, w, t, m, chunk=7, z_loss=1e-3, head_grad=head_grad, vocab_chunk=40, mesh=mesh)
    return s, c

want = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w, "token_accum")
for kind, head_grad in [(jax.sharding.AxisType.Explicit, "vocab_chunks"), (jax.sharding.AxisType.Auto, "vocab_chunks"),
                        (jax.sharding.AxisType.Auto, "token_accum")]:
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    hs = jax.device_put(h, NamedSharding(mesh, P("data")))
    f = jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, head_grad, mesh), argnums=(0, 1), has_aux=True))
    got = f(hs, w)
    hlo = f.lower(hs, w).as_text()
    assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
    (s, c), (dh, dw) = got
    (s_r, c_r), (dh_r, dw_r) = want
    np.testing.assert_allclose(s, s_r, rtol=1e-5)
    assert float(c) == float(c_r)
    np.testing.assert_allclose(dh, dh_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_per_shard_matches_unsharded():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SHARD_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
