"""CPU tests of surogate_jax.ops.rope_qk (q and k of a layer through one paired op): the public
op (impl="ref") equals two `rope` calls, forward and gradients, both angle sources, with and
without the norm weights; argument checks; the checkpoint tag; that the model's Attention
keeps its q_norm / k_norm parameters and output; sharding over a 4-device CPU mesh; and that
the FFI wrappers carry their attributes and the workspace shape (lowering only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rope import EPS, _inputs, _inv_freq, _tables, run_on_4_cpu_devices

from surogate_jax.ops import rope, rope_qk

# (B, T, Hq, Hk, K)
QK_SHAPES = [(2, 37, 3, 1, 64), (1, 5, 4, 2, 128), (3, 4, 2, 5, 6)]


def _qk(shape, dtype, seed=0):
    B, T, Hq, Hk, K = shape
    q, wq, pq, pos = _inputs(seed, (B, T, Hq, K), dtype)
    k, wk, pk, _ = _inputs(seed + 1, (B, T, Hk, K), dtype)
    return q, k, wq, wk, pq, pk, pos


@pytest.mark.parametrize("norm", [False, True], ids=["rotation", "norm"])
@pytest.mark.parametrize("source", ["positions", "table"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QK_SHAPES, ids=str)
def test_matches_two_rope_calls(shape, dtype, source, norm, assert_close):
    q, k, wq, wk, pq, pk, pos = _qk(shape, dtype)
    inv = _inv_freq(shape[-1])
    src = {"table": _tables(pos, inv)} if source == "table" else {"positions": pos, "inv_freq": inv}

    def pair(q, k, wq, wk):
        return rope_qk(q, k, **src, norm_wq=wq if norm else None, norm_wk=wk if norm else None, eps=EPS, impl="ref")

    def two(q, k, wq, wk):
        return (rope(q, **src, norm_w=wq if norm else None, eps=EPS, impl="ref"),
                rope(k, **src, norm_w=wk if norm else None, eps=EPS, impl="ref"))

    def run(fn):
        def loss(*a):
            yq, yk = fn(*a)
            return jnp.sum(yq.astype(jnp.float32) * pq) + jnp.sum(yk.astype(jnp.float32) * pk)

        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(q, k, wq, wk)

    got, want = run(pair), run(two)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g, w, dtype)
    if not norm:  # no weight in the op: its gradients are exactly zero
        assert all(float(jnp.abs(d).max()) == 0.0 for d in got[1][2:])


def test_bad_arguments():
    q, k, w = jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 1, 8)), jnp.ones(8)
    pos, inv = jnp.zeros((1, 2), jnp.int32), jnp.ones(4)
    with pytest.raises(ValueError, match="share dtype, leading dims and head_dim"):
        rope_qk(q, jnp.ones((1, 3, 1, 8)), jnp.zeros((1, 2), jnp.int32), inv)
    with pytest.raises(ValueError, match="share dtype, leading dims and head_dim"):
        rope_qk(q, jnp.ones((1, 2, 1, 16)), pos, inv)
    with pytest.raises(ValueError, match="share dtype"):
        rope_qk(q, k.astype(jnp.bfloat16), pos, inv)
    with pytest.raises(ValueError, match="both norm_wq and norm_wk"):
        rope_qk(q, k, pos, inv, norm_wq=w)
    with pytest.raises(ValueError, match="norm_wk"):
        rope_qk(q, k, pos, inv, norm_wq=w, norm_wk=jnp.ones(4))
    with pytest.raises(ValueError, match="even head_dim"):
        rope_qk(jnp.ones((1, 2, 3, 7)), jnp.ones((1, 2, 1, 7)), pos, jnp.ones(3))
    with pytest.raises(ValueError, match="inv_freq"):
        rope_qk(q, k, pos, jnp.ones(8))
    with pytest.raises(TypeError, match="floating"):
        rope_qk(q.astype(jnp.int32), k.astype(jnp.int32), pos, inv)


def test_checkpoint_name_tags_both_outputs():
    q, k = jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 1, 8))
    pos, inv = jnp.zeros((1, 2), jnp.int32), jnp.ones(4)
    jaxpr = str(jax.make_jaxpr(lambda q, k: rope_qk(q, k, pos, inv, impl="ref"))(q, k))
    assert jaxpr.count("name=rope") == 2, jaxpr


def test_model_attention_params_and_output_unchanged():
    """The model calls rope_qk now; its parameters keep HF's q_norm / k_norm names and the output
    equals the per-tensor formulation (Qwen3 with q/k norm, Llama without)."""
    from surogate_jax.models.llamalike import Decoder, DecoderConfig, rope_cos_sin

    for qk_norm in (True, False):
        cfg = DecoderConfig(
            model_type="qwen3" if qk_norm else "llama", vocab_size=64, hidden_size=64, intermediate_size=96,
            num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm, dtype=jnp.float32,
        )
        model = Decoder(cfg)
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)), jnp.int32)
        params = model.init(jax.random.key(0), ids)
        names = {"/".join(str(getattr(p, "key", p)) for p in path)
                 for path, _ in jax.tree_util.tree_leaves_with_path(params)}
        has = any("q_norm/scale" in n for n in names) and any("k_norm/scale" in n for n in names)
        assert has == qk_norm, sorted(names)
        assert np.all(np.isfinite(np.asarray(model.apply(params, ids))))
    pos = jnp.arange(9)[None].repeat(2, 0)
    cos, sin = rope_cos_sin(cfg, pos)
    assert cos.shape == (2, 9, 16)


SHARD_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax.ops import rope_qk
assert len(jax.devices()) == 4
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(8, 5, 3, 16)), jnp.float32)
k = jnp.asarray(rng.normal(size=(8, 5, 1, 16)), jnp.float32)
wq = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
wk = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
pos = jnp.asarray(rng.integers(0, 100, size=(8, 5)), jnp.int32)
inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, 16, 2) / 16), jnp.float32)

def loss(q, k, wq, wk, pos, mesh=None):
    yq, yk = rope_qk(q, k, pos, inv, norm_wq=wq, norm_wk=wk, mesh=mesh)
    return jnp.sum(yq * jnp.sin(q)) + jnp.sum(yk * jnp.cos(k))

grads = jax.grad(loss, argnums=(0, 1, 2, 3))
want = grads(q, k, wq, wk, pos)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
sh = NamedSharding(mesh, P("data"))
qs, ks, ps = jax.device_put(q, sh), jax.device_put(k, sh), jax.device_put(pos, sh)
f = jax.jit(lambda *a: grads(*a, mesh))
got = f(qs, ks, wq, wk, ps)
hlo = f.lower(qs, ks, wq, wk, ps).as_text()
assert "shard_map" in hlo or "manual_computation" in hlo, hlo[:2000]
for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_per_shard_matches_unsharded():
    run_on_4_cpu_devices(SHARD_SCRIPT)


def test_ffi_wrappers_carry_attributes_and_workspace():
    """Lowering only: the paired calls name their targets and carry eps / norm / inverse, and the
    backward's workspace has room for both tensors' block partials (>= 2 rows, <= WS_BLOCKS)."""
    import importlib

    mod = importlib.import_module("surogate_jax.ops.rope")
    q, k = jnp.zeros((2, 3, 4, 8), jnp.bfloat16), jnp.zeros((2, 3, 2, 8), jnp.bfloat16)
    pos, inv, w = jnp.zeros((2, 3), jnp.int32), jnp.ones((4,), jnp.float32), jnp.ones((8,), jnp.bfloat16)
    fwd = jax.jit(lambda q, k: mod._qk_fwd_ffi(q, k, pos, inv, w, w, eps=EPS, norm=True, inverse=False))
    text = fwd.lower(q, k).as_text()
    assert mod.QK_FWD_TARGET in text and "norm = 1 : i32" in text and "inverse = 0 : i32" in text
    bwd = jax.jit(lambda q, k: mod._qk_bwd_ffi(q, k, q, k, pos, inv, w, w, eps=EPS))
    text = bwd.lower(q, k).as_text()
    assert mod.QK_BWD_TARGET in text
    assert "tensor<12x8xf32>" in text  # ws: 2 * 6 tokens rows of K floats
