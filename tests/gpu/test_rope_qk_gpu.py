"""GPU tests of the paired q/k RoPE kernels (`rope_qk`, impl="ffi"): against two `rope_ref` calls,
forward and gradients (q, k and both norm weights), both angle sources, f32/bf16/f16, q and k
with different head counts (k with more heads too), odd shapes and the Qwen3 0.6B / 8B q/k
shapes, outputs on poisoned memory; the FFI calls themselves (the paired launch, and the
per-tensor launches of long rows), the paired forward bitwise equal to the single-tensor kernel,
vmap, and the model's wiring."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rope_gpu import DTYPES, EPS, _inputs, _inv_freq, _poison_allocator, _tables

from surogate_jax.ops import ffi_available, rope_qk, rope_ref

pytestmark = pytest.mark.gpu

# (B, T, Hq, Hk, K): vector path (64/96/128/256), scalar path (6, 72 in 16-bit, 130), long rows
# (1024: the per-tensor fallback), Hk > Hq, single heads, and the Qwen3-0.6B / -8B shapes.
QK_SHAPES = [
    (1, 1, 1, 1, 128), (2, 37, 3, 1, 64), (2, 19, 5, 3, 96), (1, 33, 2, 2, 72), (2, 7, 3, 5, 6),
    (2, 5, 4, 2, 130), (2, 513, 8, 2, 256), (1, 9, 2, 1, 1024), (4, 2048, 16, 8, 128), (2, 2048, 32, 8, 128),
]
MODES = ["positions", "table", "positions+norm", "table+norm"]


@pytest.fixture(autouse=True)
def _need_extension():
    if not ffi_available():
        pytest.fail("the CUDA extension surogate_jax._ffi is not available on a GPU machine")


def _qk_inputs(shape, dtype):
    B, T, Hq, Hk, K = shape
    q, wq, pq, pos = _inputs((B, T, Hq, K), dtype)
    k, wk, pk, _ = _inputs((B, T, Hk, K), dtype)
    return q, k, wq, wk, pq, pk, pos


def _src(mode, pos, inv):
    return {"table": _tables(pos, inv)} if mode.startswith("table") else {"positions": pos, "inv_freq": inv}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=str)
def test_public_op_matches_reference(shape, dtype, mode, assert_close):
    q, k, wq, wk, pq, pk, pos = _qk_inputs(shape, dtype)
    inv = _inv_freq(shape[-1])
    norm = mode.endswith("norm")
    src = _src(mode, pos, inv)

    def op(q, k, wq, wk):
        return rope_qk(q, k, **src, norm_wq=wq if norm else None, norm_wk=wk if norm else None, eps=EPS, impl="ffi")

    def ref(q, k, wq, wk):
        return (rope_ref(q, pos, inv, norm_w=wq if norm else None, eps=EPS),
                rope_ref(k, pos, inv, norm_w=wk if norm else None, eps=EPS))

    def run(fn):
        def loss(q, k, wq, wk):
            yq, yk = fn(q, k, wq, wk)
            return jnp.sum(yq.astype(jnp.float32) * pq) + jnp.sum(yk.astype(jnp.float32) * pk)

        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, wq, wk)

    (yq_r, yk_r), grads_r = run(ref)
    _poison_allocator()
    (yq, yk), grads = run(op)
    names = ("dq", "dk", "dwq", "dwk") if norm else ("dq", "dk")
    for name, g, r in zip(("yq", "yk", *names), (yq, yk, *grads), (yq_r, yk_r, *grads_r)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert bool(jnp.all(jnp.isfinite(g))), f"{name} has non-finite values (unwritten?)"
        assert_close(g, r, dtype, f"{mode} {name}")


# The paired launch against the reference formulas for every norm / inverse combination (rows of
# more than one chunk per lane, K = 1024, 130 and 72 in 16-bit, take the per-tensor launches); the
# single-tensor kernel itself: test_rope_gpu.py.
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=str)
def test_fwd_matches_reference_and_single_kernel(shape, dtype, assert_close):
    """The paired forward against the reference, and bitwise against the single-tensor kernel
    (same per-row math)."""
    from surogate_jax.ops.rope import _fwd_ffi, _qk_fwd_ffi, _qk_fwd_ref

    q, k, wq, wk, _, _, pos = _qk_inputs(shape, dtype)
    inv = _inv_freq(shape[-1])
    for source in ("positions", "table"):
        a, b = (pos, inv) if source == "positions" else _tables(pos, inv)
        for norm, inverse in ((False, False), (False, True), (True, False)):
            wq_, wk_ = (wq, wk) if norm else (jnp.zeros((0,), dtype),) * 2
            kw = {"eps": EPS, "norm": norm, "inverse": inverse}
            want = jax.jit(lambda *x: _qk_fwd_ref(*x, **kw))(q, k, a, b, wq_, wk_)  # noqa: B023
            one_each = jax.jit(lambda q, k, a, b, wq, wk: (_fwd_ffi(q, a, b, wq, **kw),  # noqa: B023
                                                           _fwd_ffi(k, a, b, wk, **kw)))  # noqa: B023
            single = one_each(q, k, a, b, wq_, wk_)
            _poison_allocator()
            got = jax.jit(lambda *x: _qk_fwd_ffi(*x, **kw))(q, k, a, b, wq_, wk_)  # noqa: B023
            for name, g, r, s in zip(("yq", "yk"), got, want, single):
                what = f"{source} norm={norm} inverse={inverse} {name}"
                assert g.shape == r.shape and g.dtype == r.dtype, what
                assert bool(jnp.all(jnp.isfinite(g))), f"{what}: non-finite values (unwritten?)"
                assert_close(g, r, dtype, what)
                np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(s.astype(jnp.float32)),
                                              err_msg=f"{what}: paired vs single kernel")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=str)
def test_bwd_matches_reference(shape, dtype, assert_close):
    """The paired norm backward (one launch + one two-tensor column sum; per tensor for the long
    rows, as in the forward) against the reference backward."""
    from surogate_jax.ops.rope import _qk_bwd_ffi, _qk_bwd_ref

    q, k, wq, wk, pq, pk, pos = _qk_inputs(shape, dtype)
    dyq, dyk = pq.astype(dtype), pk.astype(dtype)
    inv = _inv_freq(shape[-1])
    for source in ("positions", "table"):
        a, b = (pos, inv) if source == "positions" else _tables(pos, inv)
        want = jax.jit(lambda *x: _qk_bwd_ref(*x, eps=EPS))(dyq, dyk, q, k, a, b, wq, wk)
        _poison_allocator()
        got = jax.jit(lambda *x: _qk_bwd_ffi(*x, eps=EPS))(dyq, dyk, q, k, a, b, wq, wk)
        for name, g, r in zip(("dq", "dk", "dwq", "dwk"), got, want):
            what = f"{source} {name}"
            assert g.shape == r.shape and g.dtype == r.dtype, what
            assert bool(jnp.all(jnp.isfinite(g))), f"{what}: non-finite values (unwritten?)"
            assert_close(g, r, dtype, what)


def test_paired_backward_is_deterministic():
    from surogate_jax.ops.rope import _qk_bwd_ffi

    q, k, wq, wk, pq, pk, pos = _qk_inputs((2, 2048, 32, 8, 128), jnp.bfloat16)
    a, b = _tables(pos, _inv_freq(128))
    fn = jax.jit(lambda *x: _qk_bwd_ffi(*x, eps=EPS))
    first = fn(pq.astype(q.dtype), pk.astype(k.dtype), q, k, a, b, wq, wk)
    again = fn(pq.astype(q.dtype), pk.astype(k.dtype), q, k, a, b, wq, wk)
    for g, h in zip(first, again):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(h.astype(jnp.float32)))


def test_vmap_with_batched_weights(assert_close):
    """vmap over a leading axis of q, k, tables and norm weights (the handler's weight groups)."""
    V, shape = 3, (2, 19, 4, 2, 64)
    qs, ks, wqs, wks, pqs, pks, poss = zip(*(_qk_inputs(shape, jnp.bfloat16) for _ in range(V)))
    q, k, wq, wk, pq, pk = (jnp.stack(t) for t in (qs, ks, wqs, wks, pqs, pks))
    cos, sin = (jnp.stack(t) for t in zip(*(_tables(p, _inv_freq(64)) for p in poss)))

    def loss(fn, q, k, cos, sin, wq, wk):
        yq, yk = jax.vmap(fn)(q, k, cos, sin, wq, wk)
        return jnp.sum(yq.astype(jnp.float32) * pq) + jnp.sum(yk.astype(jnp.float32) * pk), (yq, yk)

    def op(q, k, c, s, wq, wk):
        return rope_qk(q, k, table=(c, s), norm_wq=wq, norm_wk=wk, eps=EPS, impl="ffi")

    def ref(q, k, c, s, wq, wk):
        return rope_qk(q, k, table=(c, s), norm_wq=wq, norm_wk=wk, eps=EPS, impl="ref")

    g = jax.jit(jax.value_and_grad(lambda *a: loss(op, *a), argnums=(0, 1, 4, 5), has_aux=True))
    r = jax.jit(jax.value_and_grad(lambda *a: loss(ref, *a), argnums=(0, 1, 4, 5), has_aux=True))
    (_, got_y), got_g = g(q, k, cos, sin, wq, wk)
    (_, want_y), want_g = r(q, k, cos, sin, wq, wk)
    for name, a, b in zip(("yq", "yk", "dq", "dk", "dwq", "dwk"), (*got_y, *got_g), (*want_y, *want_g)):
        assert_close(a, b, jnp.bfloat16, name)


def test_mismatched_pair_is_an_error():
    from surogate_jax.ops.rope import _qk_fwd_ffi

    q, k, wq, wk, _, _, pos = _qk_inputs((1, 4, 2, 2, 64), jnp.bfloat16)
    k_other = jnp.zeros((1, 5, 2, 64), jnp.bfloat16)  # other token count
    with pytest.raises(Exception, match="leading dims"):
        jax.block_until_ready(jax.jit(lambda: _qk_fwd_ffi(q, k_other, pos, _inv_freq(64), wq, wk, eps=EPS,
                                                          norm=True, inverse=False))())


def test_qwen3_attention_uses_the_paired_kernel():
    from surogate_jax.models.llamalike import Decoder, DecoderConfig

    cfg = DecoderConfig(
        model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, dtype=jnp.bfloat16,
    )
    model = Decoder(cfg)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 24)), jnp.int32)
    params = model.init(jax.random.key(0), ids)
    hlo = jax.jit(jax.grad(lambda p: model.apply(p, ids).astype(jnp.float32).sum())).lower(params).as_text()
    assert "surogate_rope_qk_fwd" in hlo and "surogate_rope_qk_bwd" in hlo
