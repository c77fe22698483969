"""CPU tests of surogate_jax.optim.adamw_8bit: the dynamic maps against bitsandbytes' anchors,
quantization error bounds, the reference against a float32 numpy twin (bit for bit: same ops, same
order) and a float64 numpy implementation, the kernel's nearest-code search (mirrored in numpy)
against searchsorted, the fp32 small-tensor path against optax.adam, weight-decay masks, schedules,
the fused path and the folded clip, jit with donation, Orbax, and a 500-step training run against
fp32 optax.adamw."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from surogate_jax.config import OptimConfig
from surogate_jax.optim import (
    adamw_8bit,
    apply_fused,
    chain_clip,
    decay_mask,
    fp32_state_mask,
    make_optimizer,
)
from surogate_jax.optim import adamw_8bit as _module  # noqa: F401  (the function shadows the module)
from surogate_jax.optim.adamw_8bit import (
    B1,
    B2,
    CODE_S,
    CODE_U,
    DECAY,
    EPS_HAT,
    GSCALE,
    MID_S,
    MID_U,
    N_SCALARS,
    OMB1,
    OMB2,
    STEP,
    ZERO_S,
    Adam8bitState,
    QuantizedMoment,
    T,
    dequantize,
    quantize,
    state_bytes,
    update_8bit_ref,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from tiny import CFG, random_batch

f32 = np.float32


def _scalars(t=3, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, decay=1.0, gscale=1.0):
    bc1 = 1 - b1**t
    sq = np.sqrt(1 - b2**t)
    s = np.zeros(N_SCALARS, np.float32)
    s[[B1, OMB1, B2, OMB2]] = [f32(b1), f32(1) - f32(b1), f32(b2), f32(1) - f32(b2)]
    s[[STEP, EPS_HAT, DECAY, GSCALE, T]] = [lr * sq / bc1, eps * sq, decay, gscale, t]
    return s


def _random_state(rng, shape, block=256):
    """Codes and absmax as after a few steps: moments of gradient-like magnitudes."""
    n = int(np.prod(shape))
    nb = -(-n // block)
    m = rng.standard_normal(nb * block).astype(np.float32) * 1e-2
    v = (rng.standard_normal(nb * block).astype(np.float32) * 1e-2) ** 2 * rng.uniform(0.1, 1, nb * block).astype(f32)
    am = np.abs(m).reshape(nb, block).max(1)
    av = v.reshape(nb, block).max(1)
    qm = np.asarray(quantize(jnp.asarray((m.reshape(nb, block) / am[:, None]).reshape(-1)), True))
    qv = np.asarray(quantize(jnp.asarray((v.reshape(nb, block) / av[:, None]).reshape(-1)), False))
    return np.array(qm[:n].reshape(shape)), np.array(qv[:n].reshape(shape)), am, av


# ---------------------------------------------------------------------------------------------
# numpy twins of the algorithm


def np_step_f32(g, p, qm, qv, am, av, s, block=256):
    """The algorithm in float32 numpy, one rounding per operation (numpy never fuses ops)."""
    n, nb = p.size, am.size
    pad = nb * block - n

    def blocks(x, fill):
        return np.concatenate([x.reshape(-1), np.full(pad, fill, x.dtype)]).reshape(nb, block)

    gs = blocks(np.asarray(g, np.float32), 0) * s[GSCALE]
    ok = np.isfinite(gs)
    pf = blocks(np.asarray(p, np.float32), 0)
    m0 = CODE_S[blocks(qm, ZERO_S)] * am[:, None]
    v0 = CODE_U[blocks(qv, 0)] * av[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.where(ok, s[B1] * m0 + s[OMB1] * gs, m0)
        v = np.where(ok, s[B2] * v0 + (s[OMB2] * gs) * gs, v0)
    am1 = np.abs(m).max(1)
    av1 = v.max(1)
    with np.errstate(invalid="ignore", over="ignore"):
        p1 = np.where(ok, (pf - s[STEP] * (m / (np.sqrt(v) + s[EPS_HAT]))) * s[DECAY], pf)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # subnormal absmax: 1 / it is inf
        inv_m = np.divide(f32(1), am1, out=np.zeros_like(am1), where=am1 > 0)
        inv_v = np.divide(f32(1), av1, out=np.zeros_like(av1), where=av1 > 0)
        xm, xv = m * inv_m[:, None], v * inv_v[:, None]
    qm1 = np.searchsorted(MID_S, xm, side="left")
    qm1 = np.where((xm < 0) & (qm1 >= ZERO_S), qm1 - 1, qm1)
    qv1 = np.searchsorted(MID_U, xv, side="left")
    cut = lambda x: x.reshape(-1)[:n].reshape(p.shape)
    return (cut(p1).astype(p.dtype), cut(qm1).astype(np.uint8), cut(qv1).astype(np.uint8), am1, av1)


def np_step_f64(g, p, m, v, t, lr, b1, b2, eps, wd):
    """The reference algorithm (peers_and_algorithms.md 4a) in float64 on dequantized moments."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    p = (p - step * m / (np.sqrt(v) + eps * np.sqrt(1 - b2**t))) * (1 - lr * wd)
    return p, m, v


# ---------------------------------------------------------------------------------------------
# maps and quantization


def test_dynamic_maps_match_the_anchors():
    assert CODE_S.dtype == np.float32 and np.unique(CODE_S).size == 256 and np.all(np.diff(CODE_S) > 0)
    np.testing.assert_allclose([CODE_S.min(), CODE_S.max(), CODE_S[CODE_S > 0].min()],
                               [-0.99296875, 1.0, 5.5e-7], rtol=1e-6)
    assert np.sum(CODE_S < 0) == 127 and CODE_S[ZERO_S] == 0.0 and -1.0 not in CODE_S
    assert np.unique(CODE_U).size == 256 and CODE_U.min() == 0.0 and CODE_U.max() == 1.0
    np.testing.assert_allclose(CODE_U[1:3], [3.25e-7, 7.75e-7], rtol=1e-6)
    # level i of the unsigned map holds 2^(i+1) codes in [0.1, 1] * 10^(i-6)
    for i in range(7):
        lo, hi = 0.1 * 10.0 ** (i - 6), 10.0 ** (i - 6)
        assert np.sum((CODE_U > lo) & (CODE_U < hi)) == 2 ** (i + 1)
        assert np.sum((CODE_S > lo) & (CODE_S < hi)) == 2**i


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code_within_half_spacing(signed):
    code = CODE_S if signed else CODE_U
    rng = np.random.default_rng(0)
    # log-uniform magnitudes over the map's whole range, plus every code, midpoint and neighbour
    x = np.exp(rng.uniform(np.log(1e-8), 0, 20000)).astype(np.float32)
    mids = (MID_S if signed else MID_U)
    x = np.concatenate([x, code, mids, np.nextafter(mids, 2), np.nextafter(mids, -2), [0.0]]).astype(np.float32)
    if signed:
        x = np.concatenate([x, -x])
    x = np.clip(x, code.min() if not signed else -1.0, 1.0)
    q = np.asarray(jax.jit(quantize, static_argnums=1)(jnp.asarray(x), signed)).astype(int)
    err = np.abs(code[q].astype(np.float64) - x)
    best = np.abs(code[None, :].astype(np.float64) - x[:, None]).min(1)
    guarded = signed & (x < 0) & (code[np.searchsorted(mids, x)] >= 0)  # tiny negatives: sign guard
    # the nearest code, up to one ulp of x where x sits on a (float32-rounded) midpoint
    ulp = np.abs(np.spacing(x)).astype(np.float64)
    assert np.all(err[~guarded] <= best[~guarded] + ulp[~guarded])
    spacing = np.diff(code.astype(np.float64))
    hi = np.minimum(np.searchsorted(code, x), 255)
    lo = np.maximum(hi - 1, 0)
    half = np.maximum(spacing[np.minimum(lo, 254)], 0) / 2
    assert np.all(err[~guarded] <= half[~guarded] + ulp[~guarded])
    if signed:
        assert np.all(code[q][x < 0] < 0)  # the sign guard: negatives stay negative
        assert np.all(err[guarded] <= CODE_S[ZERO_S + 1] + 1e-12)
    # dequantize(quantize(x)) round trips every code exactly
    qc = np.asarray(quantize(jnp.asarray(code), signed))
    assert np.array_equal(qc, np.arange(256)) and np.array_equal(np.asarray(dequantize(jnp.asarray(qc), signed)), code)


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_search_equals_searchsorted(signed):
    """quantize (the kernel's bucket + forward-scan search) is exactly searchsorted + sign guard,
    also on every midpoint, its float32 neighbours, 0, 1, just above 1 and tiny values."""
    rng = np.random.default_rng(1)
    mids = MID_S if signed else MID_U
    x = np.exp(rng.uniform(np.log(1e-9), 0, 20000)).astype(np.float32)
    x = np.concatenate([x, mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2)),
                        CODE_S if signed else CODE_U, [0.0, 1.0, np.nextafter(np.float32(1), np.float32(2)), 1e-30]])
    x = np.concatenate([x, -x]) if signed else np.abs(x)
    x = x.astype(np.float32)
    want = np.searchsorted(mids, x, side="left")
    if signed:
        want = np.where((x < 0) & (want >= ZERO_S), want - 1, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(quantize, static_argnums=1)(jnp.asarray(x), signed)), want)


# ---------------------------------------------------------------------------------------------
# one update of one tensor


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(64, 80), (4097,), (3, 1001)], ids=str)
def test_reference_is_the_float32_twin_bit_for_bit(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    qm, qv, am, av = _random_state(rng, shape)
    am[1] = av[1] = 0.0  # an all-zero block
    qm.reshape(-1)[256:512] = ZERO_S
    qv.reshape(-1)[256:512] = 0
    g = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    g.reshape(-1)[[3, 700]] = [np.nan, np.inf]  # skipped elements
    p = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    s = _scalars(t=5, decay=1 - 1e-2 * 0.1, gscale=0.7)
    got = jax.jit(update_8bit_ref)(jnp.asarray(g), jnp.asarray(p), jnp.asarray(qm), jnp.asarray(qv),
                                   jnp.asarray(am), jnp.asarray(av), jnp.asarray(s))
    want = np_step_f32(g, np.asarray(p), qm, qv, am, av, s)
    for name, a, b in zip(("p", "qm", "qv", "am", "av"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32), err_msg=name)
    assert np.asarray(got[0]).reshape(-1)[3] == np.asarray(p).reshape(-1)[3]  # NaN grad: param kept


def test_one_step_against_float64():
    rng = np.random.default_rng(7)
    shape = (8, 1000)
    qm, qv, am, av = _random_state(rng, shape)
    g = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    p = rng.standard_normal(shape).astype(np.float32)
    t, lr, wd = 4, 1e-3, 0.1
    s = _scalars(t=t, lr=lr, decay=1 - lr * wd)
    p1, qm1, qv1, am1, av1 = (np.asarray(x) for x in jax.jit(update_8bit_ref)(
        *(jnp.asarray(x) for x in (g, p, qm, qv, am, av, s))))
    nb = am.size
    blk = lambda x: np.concatenate([x.reshape(-1), np.zeros(nb * 256 - x.size)]).reshape(nb, 256)
    m0 = blk(CODE_S[qm].astype(np.float64)) * am[:, None]
    v0 = blk(CODE_U[qv].astype(np.float64)) * av[:, None]
    pe, me, ve = np_step_f64(blk(g.astype(np.float64)), blk(p.astype(np.float64)), m0, v0, t, lr, 0.9, 0.999, 1e-8, wd)
    n = p.size
    np.testing.assert_allclose(p1.reshape(-1), pe.reshape(-1)[:n], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(am1, np.abs(me).max(1), rtol=1e-6)
    np.testing.assert_allclose(av1, ve.max(1), rtol=1e-6)
    # re-quantized moments: within half a code spacing (times absmax) of the float64 moments
    mq = blk(CODE_S[qm1].astype(np.float64)) * am1[:, None]
    vq = blk(CODE_U[qv1].astype(np.float64)) * av1[:, None]
    for q, exact, absmax, code in ((mq, me, am1, CODE_S), (vq, ve, av1, CODE_U)):
        x = exact / absmax[:, None]
        hi = np.clip(np.searchsorted(code, x), 1, 255)
        half = (code[hi].astype(np.float64) - code[hi - 1]) / 2
        half = np.maximum(half, code[0] - x)  # the signed map has no -1.0: -1 maps to -0.99296875
        assert np.all(np.abs(q - exact) <= (half * absmax[:, None]) * (1 + 1e-5) + 1e-30)


# ---------------------------------------------------------------------------------------------
# the transform


def _tree(rng, dtype=jnp.float32):
    return {"w": jnp.asarray(rng.standard_normal((40, 130)), dtype),
            "emb": jnp.asarray(rng.standard_normal((4097,)), dtype),
            "norm": {"scale": jnp.asarray(1 + 0.1 * rng.standard_normal((64,)), dtype)}}


def _grads(rng, params):
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 1e-2, p.dtype), params)


def test_state_layout_and_bytes():
    params = _tree(np.random.default_rng(0))
    tx = adamw_8bit(1e-3, min_8bit_size=1000)
    st = tx.init(params)
    assert isinstance(st, Adam8bitState) and st.count.dtype == jnp.int32
    w = st.mu["w"]
    assert isinstance(w, QuantizedMoment) and w.codes.shape == (40, 130) and w.codes.dtype == jnp.uint8
    assert w.absmax.shape == (-(-40 * 130 // 256),) and w.absmax.dtype == jnp.float32
    assert np.all(np.asarray(w.codes) == ZERO_S) and np.all(np.asarray(st.nu["w"].codes) == 0)
    assert st.mu["norm"]["scale"].dtype == jnp.float32 and st.mu["norm"]["scale"].shape == (64,)
    big = {"w": jnp.zeros((4096, 256))}
    per_param = state_bytes(adamw_8bit(1e-3).init(big)) / big["w"].size
    assert per_param == 2 + 8 / 256  # 2.03125 bytes per parameter, vs 8 for fp32 AdamW


def test_small_tensors_are_fp32_adam():
    """With weight decay 0 the fp32 path is Adam: optax.adam to float32 rounding over 5 steps."""
    rng = np.random.default_rng(1)
    params = _tree(rng)
    tx, ref = adamw_8bit(3e-3, min_8bit_size=10**9), optax.adam(3e-3)
    s, r = tx.init(params), ref.init(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s.mu))
    p, q = params, params
    for _ in range(5):
        g = _grads(rng, params)
        u, s = jax.jit(tx.update)(g, s, p)
        v, r = jax.jit(ref.update)(g, r, q)
        p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_weight_decay_mask_and_schedule():
    rng = np.random.default_rng(2)
    params = _tree(rng)
    sched = lambda c: 1e-2 / (1.0 + c)
    wd = 0.5
    mask = lambda p: {"w": True, "emb": False, "norm": {"scale": True}}
    tx = adamw_8bit(sched, weight_decay=wd, mask=mask, min_8bit_size=1000)
    st = tx.init(params)
    p = params
    for step in range(3):
        g = jax.tree.map(jnp.zeros_like, params)  # zero grads: the update is the decay alone
        p_new, st = jax.jit(apply_fused, static_argnums=0)(tx, g, st, p)
        lr = f32(1e-2) / f32(1.0 + step)
        np.testing.assert_array_equal(p_new["emb"], p["emb"])  # masked: no decay
        for k in ("w",):
            np.testing.assert_allclose(p_new[k], p[k] * (f32(1) - lr * f32(wd)), rtol=1e-6)
        np.testing.assert_allclose(p_new["norm"]["scale"], p["norm"]["scale"] * (f32(1) - lr * f32(wd)), rtol=1e-6)
        p = p_new
    assert int(st.count) == 3


def test_update_adds_back_and_fused_equals_update():
    rng = np.random.default_rng(3)
    for dtype in (jnp.float32, jnp.bfloat16):
        params = _tree(rng, dtype)
        tx = adamw_8bit(1e-2, weight_decay=0.1, min_8bit_size=1000)
        st = tx.init(params)
        g = _grads(rng, params)
        u, s1 = jax.jit(tx.update)(g, st, params)
        p2, s2 = jax.jit(apply_fused, static_argnums=0)(tx, g, st, params)
        assert all(x.dtype == dtype for x in jax.tree.leaves(u))
        # p + (p' - p) == p' whenever p' is within a factor 2 of p (Sterbenz); else one rounding
        for a, b, p in zip(jax.tree.leaves(optax.apply_updates(params, u)), jax.tree.leaves(p2),
                           jax.tree.leaves(params), strict=True):
            a, b, p = (np.asarray(x, np.float32) for x in (a, b, p))
            ulp = 2 * np.maximum(np.abs(b), np.abs(p)) * float(jnp.finfo(dtype).eps)  # one rounding
            assert np.all(np.abs(a - b) <= ulp) and np.mean(a == b) > 0.9
        for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
            np.testing.assert_array_equal(a, b)


def test_chain_clip_folds_the_clip_into_the_update():
    rng = np.random.default_rng(4)
    params = _tree(rng)
    tx = chain_clip(0.05, adamw_8bit(1e-2, min_8bit_size=1000))
    plain = optax.chain(optax.clip_by_global_norm(0.05), adamw_8bit(1e-2, min_8bit_size=1000))
    st = tx.init(params)
    assert jax.tree.structure(st) == jax.tree.structure(plain.init(params))
    for scale in (1.0, 0.01):  # clipped, then under the threshold
        g = jax.tree.map(lambda x: x * scale, _grads(rng, params))
        pf, sf = jax.jit(apply_fused, static_argnums=0)(tx, g, st, params)
        u, sp = jax.jit(plain.update)(g, st, params)
        pp = optax.apply_updates(params, u)
        for a, b in zip(jax.tree.leaves(pf), jax.tree.leaves(pp), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(sp), strict=True):
            if a.dtype == jnp.uint8:  # one rounding of the scale may move a code by one step
                assert np.mean(np.asarray(a) != np.asarray(b)) < 1e-2
                assert np.max(np.abs(np.asarray(a, int) - np.asarray(b, int))) <= 1
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)


def test_jit_with_donated_state_and_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(5)
    params = _tree(rng)
    tx = chain_clip(1.0, adamw_8bit(1e-2, weight_decay=0.01, min_8bit_size=1000))
    step = jax.jit(lambda p, s, g: apply_fused(tx, g, s, p), donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    grads = [_grads(rng, params) for _ in range(4)]
    for g in grads[:2]:
        p, s = step(p, s, g)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", {"p": p, "s": s})
    ckpt.wait_until_finished()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"p": p, "s": s})
    restored = ckpt.restore(tmp_path / "state", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure({"p": p, "s": s})
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"p": p, "s": s}), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    p2, s2 = restored["p"], restored["s"]
    for g in grads[2:]:
        p, s = step(p, s, g)
        p2, s2 = step(p2, s2, g)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_works_inside_optax_wrappers():
    rng = np.random.default_rng(6)
    params = _tree(rng)
    tx = optax.multi_transform({"a": adamw_8bit(1e-2, min_8bit_size=1000), "s": optax.sgd(1e-2)},
                               {"w": "a", "emb": "a", "norm": {"scale": "s"}})
    st = tx.init(params)
    u, st = jax.jit(tx.update)(_grads(rng, params), st, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))


def test_make_optimizer_adamw_8bit_keeps_norms_fp32():
    params = {"embedding": jnp.ones((300, 64)),
              "layers": {"mlp": {"up_proj": {"kernel": jnp.ones((2, 64, 128))}},
                         "input_layernorm": {"scale": jnp.ones((2, 4096))}}}
    tx, _ = make_optimizer(OptimConfig(optimizer="adamw_8bit", weight_decay=0.1), 100)
    st = tx.init(params)
    inner = st[1]  # (clip state, adamw_8bit state), as optax.chain(clip, tx) would have it
    assert isinstance(inner, Adam8bitState)
    assert isinstance(inner.mu["layers"]["mlp"]["up_proj"]["kernel"], QuantizedMoment)
    assert isinstance(inner.mu["embedding"], QuantizedMoment)
    assert inner.mu["layers"]["input_layernorm"]["scale"].dtype == jnp.float32  # a norm: fp32 moments
    g = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, x.dtype), params)
    p1, _ = jax.jit(apply_fused, static_argnums=0)(tx, g, st, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p1))
    tx_nc, _ = make_optimizer(OptimConfig(optimizer="adamw_8bit", max_grad_norm=0.0), 100)
    assert isinstance(tx_nc.init(params), Adam8bitState)  # no clip: the transform itself


# ---------------------------------------------------------------------------------------------
# training: 500 steps on the tiny model against fp32 AdamW


def _trainer(tx_ref, tx, batches, steps):
    """One jitted program (the model compiled once): params [3, ...] -> losses [3, steps]; rows 0
    and 1 train with tx_ref (two init seeds), row 2 with tx, all in one lax.scan."""
    from surogate_jax import train as T
    from surogate_jax.models import Decoder

    model = Decoder(CFG)
    nb = batches["input_ids"].shape[0]
    grad = jax.vmap(jax.value_and_grad(lambda p, b: T.batch_loss(model, {}, p, b, None), has_aux=True),
                    in_axes=(0, None))
    split = lambda t: (jax.tree.map(lambda x: x[:2], t), jax.tree.map(lambda x: x[2], t))

    def one(carry, i):
        p, s_ref, s = carry
        (loss, n), g = grad(p, jax.tree.map(lambda x: x[i % nb], batches))
        g = jax.tree.map(lambda x: x / n.reshape((3,) + (1,) * (x.ndim - 1)), g)
        (p_ref, p8), (g_ref, g8) = split(p), split(g)
        p_ref, s_ref = jax.vmap(lambda g, s, p: apply_fused(tx_ref, g, s, p))(g_ref, s_ref, p_ref)
        p8, s = apply_fused(tx, g8, s, p8)
        p = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), p_ref, p8)
        return (p, s_ref, s), loss / n

    def run(p):
        p_ref, p8 = split(p)
        init = (p, jax.vmap(tx_ref.init)(p_ref), tx.init(p8))
        return jax.lax.scan(one, init, jnp.arange(steps))[1].T

    return run


def test_500_step_loss_trajectory_matches_fp32_adamw():
    """The tiny Qwen3 (every tensor but the norms 8-bit: blocks of 256) against fp32 optax.adamw,
    same clip, schedule and decay mask; "noise" is fp32 AdamW's own spread over two init seeds."""
    rng = np.random.default_rng(0)
    raw = [random_batch(rng, 2, 16) for _ in range(8)]
    batches = {k: jnp.asarray(np.stack([b[k] for b in raw])) for k in raw[0]}
    steps, lr = 500, 3e-3
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, 25, steps, lr * 0.1)
    adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01, mask=decay_mask))
    tx = chain_clip(1.0, adamw_8bit(sched, weight_decay=0.01, mask=decay_mask, min_8bit_size=256,
                                    fp32_mask=fp32_state_mask))
    from surogate_jax.models import Decoder

    # the tiny model's parameter tree, filled in numpy (a compiled Flax init costs a minute on CPU):
    # N(0, 0.2) like its initializer_range, norm scales 1; seeds 0, 1 and 0 again for the 8-bit run
    shapes = jax.eval_shape(lambda: Decoder(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    shapes = jax.tree.map(lambda x: getattr(x, "value", x), shapes, is_leaf=lambda x: hasattr(x, "value"))

    def fill(seed):
        r = np.random.default_rng(seed)
        return jax.tree_util.tree_map_with_path(
            lambda path, x: np.ones(x.shape, np.float32) if path[-1].key == "scale"
            else (0.2 * r.standard_normal(x.shape)).astype(np.float32), shapes)

    seeds = jax.tree.map(lambda *x: jnp.asarray(np.stack(x)), fill(0), fill(1), fill(0))
    ref, ref2, q8 = np.asarray(jax.jit(_trainer(adamw, tx, batches, steps))(seeds))
    smooth = lambda x: np.convolve(x, np.ones(25) / 25, mode="valid")
    a, b, c = smooth(ref), smooth(ref2), smooth(q8)
    noise = np.abs(a - b)[-100:].mean()
    print(f"final losses: fp32 {a[-1]:.4f} (other seed {b[-1]:.4f}), 8-bit {c[-1]:.4f}; noise {noise:.4f}")
    assert c[-1] < 0.1 * c[0]  # it learns (4.1 -> ~0.06)
    assert np.abs(c - a)[-100:].mean() <= max(2 * noise, 0.02 * a[-1])
    assert np.abs(c - a)[50:].max() < 0.1 * a[50:].max()  # the whole curve, not just the end


# ---------------------------------------------------------------------------------------------
# kernel tables, absmax layout, eager init


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_lookup_equals_searchsorted_and_the_reference(signed):
    """lookup_np is the .cu's one-probe arithmetic; it must be searchsorted + sign guard exactly at
    every midpoint, its float neighbours, every bucket edge and random magnitudes."""
    from surogate_jax.optim.adamw_8bit import LOOKUP_BITS_S, LOOKUP_BITS_U, lookup_np
    mid = MID_S if signed else MID_U
    pos = mid[mid > 0]
    bits = LOOKUP_BITS_S if signed else LOOKUP_BITS_U
    edges = ((np.arange((127 - 102 + 1) << bits, dtype=np.uint32) + (102 << bits)) << (23 - bits)).view(np.float32)
    rng = np.random.default_rng(7)
    x = np.concatenate([pos, np.nextafter(pos, f32(0)), np.nextafter(pos, f32(2)), edges,
                        np.nextafter(edges, f32(0)), [0.0, 1.0, 1.0000001, 1.5, 1e-30, 2.0**-25, 3e-8],
                        rng.uniform(0, 1, 20000), 10.0 ** rng.uniform(-9, 0, 20000)]).astype(f32)
    if signed:
        x = np.concatenate([x, -x, [-0.0]]).astype(f32)
    want = np.searchsorted(mid, x, side="left")
    if signed:
        want = np.where((x < 0) & (want >= ZERO_S), want - 1, want)
    np.testing.assert_array_equal(lookup_np(x, signed), want.astype(np.uint8))
    np.testing.assert_array_equal(lookup_np(x, signed), np.asarray(quantize(jnp.asarray(x), signed)))


def test_kernel_aux_layout():
    """The offsets the .cu reads (kernels/adamw_8bit.h) hold what the .py file built."""
    import re

    from surogate_jax.optim.adamw_8bit import KERNEL_AUX, LOOKUP_S, LOOKUP_U
    header = (Path(__file__).resolve().parents[2] / "kernels/adamw_8bit.h").read_text()
    offsets = dict(re.findall(r"constexpr int kAdamw8bit(Aux\w+) = .*// (\d+)", header))
    assert offsets == {"AuxLookupS": "512", "AuxLookupU": "2176", "AuxWords": "5504"}, offsets
    assert KERNEL_AUX.dtype == np.uint32 and KERNEL_AUX.shape == (5504,)
    np.testing.assert_array_equal(KERNEL_AUX[:256].view(np.float32), CODE_S)
    np.testing.assert_array_equal(KERNEL_AUX[256:512].view(np.float32), CODE_U)
    np.testing.assert_array_equal(KERNEL_AUX[512:2176], LOOKUP_S)
    np.testing.assert_array_equal(KERNEL_AUX[2176:], LOOKUP_U)


def test_absmax_layout_is_a_reshape_of_flat_blocks():
    from surogate_jax.optim.adamw_8bit import absmax_shape
    assert absmax_shape((28, 1024, 3072)) == (28, 1024, 12)
    assert absmax_shape((28, 1024, 16, 128)) == (28, 1024, 8)
    assert absmax_shape((151936, 1024)) == (151936, 4)
    assert absmax_shape((40, 130)) == (21,)  # not a multiple of 256: flat, padded last block
    assert absmax_shape((4, 64)) == (1,)
    rng = np.random.default_rng(3)
    shape = (3, 8, 96)  # 8 * 96 = 768 = 3 blocks per leading index
    qm, qv, am, av = _random_state(rng, shape)
    g = rng.standard_normal(shape).astype(f32) * f32(1e-2)
    p = rng.standard_normal(shape).astype(f32)
    s = jnp.asarray(_scalars())
    flat = update_8bit_ref(g, p, qm, qv, am, av, s)
    shaped = update_8bit_ref(g, p, qm, qv, am.reshape(3, 3), av.reshape(3, 3), s)
    assert shaped[3].shape == (3, 3) and shaped[4].shape == (3, 3)
    for a, b in zip(flat, shaped, strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
    st = adamw_8bit(1e-3, min_8bit_size=256).init({"w": jnp.zeros(shape)})
    assert st.mu["w"].absmax.shape == (3, 3)


def test_eager_init_has_distinct_buffers_and_can_be_donated():
    params = {"w": jnp.ones((8, 1024)), "n": jnp.ones((10,)), "b": jnp.ones((10,))}
    tx = adamw_8bit(1e-3)
    state = tx.init(params)  # outside jit
    ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(ptrs)) == len(ptrs)
    step = jax.jit(lambda p, s, g: apply_fused(tx, g, s, p), donate_argnums=(0, 1))
    _, s2 = step(jax.tree.map(jnp.copy, params), state, jax.tree.map(lambda x: 0.1 * x, params))
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    assert int(s2.count) == 1 and float(jnp.max(jnp.abs(s2.mu["n"]))) > 0

