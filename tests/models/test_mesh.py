"""DecoderConfig.mesh: every op of the decoder (norms, q/k RoPE, the residual add + norm, SwiGLU or
SwiGLU+LoRA, the recipe GEMMs, the MoE block with its router losses) and the LM-head loss run per data shard of that
mesh, with the loss
and gradients of the unsplit model; without it (even inside jax.set_mesh) nothing splits; and the
train / eval step builders attach the layout's mesh themselves. On a 4-device CPU mesh."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r'''
import dataclasses, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax import train as T
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.parallel import Layout
from surogate_jax.precision.recipe import QuantRecipe
assert len(jax.devices()) == 4
base = DecoderConfig(model_type="qwen3", vocab_size=67, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, initializer_range=0.2,
                     kernels=("rope", "rms_norm", "add_rms_norm", "swiglu", "swiglu_lora"))
mesh = T.make_mesh()
rng = np.random.default_rng(0)
batch = {k: jnp.asarray(rng.integers(1, 67, (8, 16)), jnp.int32) for k in ("input_ids", "targets")}
batch["positions"] = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (8, 16))
batch["segment_ids"] = jnp.ones((8, 16), jnp.int32)
batch["loss_mask"] = jnp.asarray(rng.random((8, 16)) < 0.7, jnp.float32)
sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
spec = LoraSpec(rank=4, alpha=8.0, targets=("gate_proj", "up_proj", "down_proj"))
moe = base.replace(model_type="qwen3_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16,
                   router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
for name, cfg in {"full": base, "lora (swiglu_lora)": base.replace(lora=spec),
                  "fp8-hybrid": base.replace(recipe=QuantRecipe("fp8-hybrid", fp8_impl="ref")),
                  # round-to-nearest: stochastic rounding draws other bits per shard (by design)
                  "nvfp4": base.replace(recipe=QuantRecipe("nvfp4", fp4_stochastic=False), hidden_size=64,
                                        intermediate_size=96, head_dim=16),
                  # each shard sorts its own tokens; the router statistics (and losses) are sums over all shards
                  "moe": moe,
                  "moe lora": moe.replace(lora=dataclasses.replace(spec, targets=("q_proj", *spec.targets)))}.items():
    model = Decoder(cfg)
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, jnp.zeros((1, 4), jnp.int32))
    params, trainable = (v["params"], v["lora"]) if cfg.lora else ({}, v["params"])
    quant = v.get("fp8", {})

    def loss(model, trainable, quant, batch):
        l, (n, _, _) = T.train_loss(model, params, trainable, batch, None, quant, router_weight=3.0)
        return l / n

    grad = jax.value_and_grad(loss, argnums=(1, 2))
    want_l, want_g = grad(model, trainable, quant, batch)
    split = Decoder(cfg.replace(mesh=mesh))
    jaxpr = str(jax.make_jaxpr(lambda *a: grad(split, *a))(trainable, quant, sharded))
    with jax.set_mesh(mesh):  # the ambient mesh alone splits nothing
        whole = str(jax.make_jaxpr(lambda *a: grad(model, *a))(trainable, quant, sharded))
    n = jaxpr.count("shard_map")
    assert n >= 5, (name, n)  # rms_norm, rope_qk, add_rms_norm, swiglu(_lora), lm_head_ce (+ recipe GEMMs)
    assert "shard_map" not in whole, name
    got_l, got_g = jax.jit(lambda *a: grad(split, *a))(trainable, quant, sharded)
    # the shards only reorder sums: fp32 rounding. Loss rtol 1e-5; gradients conftest's fp32 rule (rtol eps^(2/3),
    # atol that times the reference's RMS), capped at the absolute 1e-6 this test always had
    tol = float(np.finfo(np.float32).eps) ** (2 / 3)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        b = np.asarray(b, np.float64)
        atol = min(1e-6, tol * max(float(np.sqrt(np.mean(b * b))), 1e-30))
        np.testing.assert_allclose(a, b, rtol=tol, atol=atol, err_msg=name)
    print("ok", name, n)
# the step builders attach the layout's mesh to the model they trace
state = T.TrainState(step=jnp.zeros((), jnp.int32), params=params, trainable=trainable, opt_state=(),
                     rng=jax.random.key_data(jax.random.key(0)), quant=quant)
ev = str(jax.make_jaxpr(T.make_eval_step(model, Layout(mesh)))(state, sharded))
assert "shard_map" in ev and "shard_map" not in str(jax.make_jaxpr(T.make_eval_step(model))(state, sharded))
assert T.with_mesh(model, mesh).config.mesh == mesh and T.with_mesh(model, None) is model
print("ok")
'''


def test_model_ops_split_over_the_config_mesh():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


EP_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from surogate_jax import train as T
from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.parallel import Layout
from surogate_jax.qlora.base import QloraSpec
cfg = DecoderConfig(model_type="qwen3_moe", vocab_size=67, hidden_size=32, intermediate_size=48, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, initializer_range=0.2, num_experts=8,
                    num_experts_per_tok=3, moe_intermediate_size=16, mlp_only_layers=(1,), router_aux_loss_coef=0.1)
rng = np.random.default_rng(0)
batch = {k: jnp.asarray(rng.integers(1, 67, (8, 16)), jnp.int32) for k in ("input_ids", "targets")}
batch["positions"] = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (8, 16))
batch["segment_ids"] = jnp.asarray(np.repeat([[1] * 12 + [0] * 4], 8, axis=0), jnp.int32)
batch["loss_mask"] = jnp.asarray(rng.random((8, 16)) < 0.7, jnp.float32)
spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "gate_proj", "up_proj", "down_proj"), train_router=True)
cases = {"full": cfg, "lora": cfg.replace(lora=spec),
         # the experts' quantized parts split by expert: NF4 blocks of 64 without double quantization, NVFP4 tiles
         "qlora nf4": cfg.replace(lora=spec, qlora=QloraSpec("nf4", 64, False)),
         "qlora fp4": cfg.replace(lora=spec, qlora=QloraSpec("fp4", 16))}
for name, c in cases.items():
    model = Decoder(c)
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, jnp.zeros((1, 4), jnp.int32))
    params, trainable = (v["params"], v["lora"]) if c.lora else ({}, v["params"])
    trainable = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), trainable)

    def loss(model, params, trainable, batch):
        l, (n, _, router) = T.train_loss(model, params, trainable, batch, None, router_weight=3.0)
        return l / n, router

    grad = jax.value_and_grad(loss, argnums=2, has_aux=True)
    (want_l, want_r), want_g = grad(model, params, trainable, batch)
    for ep in (2, 4):
        mesh = T.make_mesh(ep_size=ep)
        layout = Layout(mesh)
        assert dict(mesh.shape) == {"data": 4 // ep, "expert": ep}
        split = Decoder(c.replace(mesh=mesh))
        on = jax.device_put(trainable, layout.shardings(trainable, False))
        base = jax.device_put(params, layout.shardings(params, False))
        if c.qlora is not None:
            down = base["layers_2"]["mlp"]["experts"]["down_proj"]
            assert all(down[k].sharding.spec == P(None, "expert") for k in down if down[k].ndim > 1), name
        experts = on["layers_2"]["mlp"]["experts"]["up_proj"]
        experts = experts["lora_a"] if c.lora else experts
        assert experts.sharding.spec == P(None, "expert"), experts.sharding
        assert experts.addressable_shards[0].data.shape[1] == 8 // ep  # each device: its experts only
        sharded = jax.device_put(batch, T.batch_sharding(mesh, False))
        jaxpr = str(jax.make_jaxpr(lambda *a: grad(split, *a))(base, on, sharded))
        assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr, name
        (got_l, got_r), got_g = jax.jit(lambda *a: grad(split, *a))(base, on, sharded)
        tol = float(np.finfo(np.float32).eps) ** (2 / 3)
        np.testing.assert_allclose(got_l, want_l, rtol=1e-5, err_msg=name)
        for k in want_r:
            np.testing.assert_allclose(got_r[k], want_r[k], rtol=1e-5, err_msg=k)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_g)[0], jax.tree.leaves(want_g), strict=True):
            b = np.asarray(b, np.float64)
            atol = min(1e-6, tol * max(float(np.sqrt(np.mean(b * b))), 1e-30))
            np.testing.assert_allclose(a, b, rtol=tol, atol=atol, err_msg=f"{name} ep{ep} {jax.tree_util.keystr(path)}")
        print("ok", name, ep)
print("ok")
'''


def test_expert_parallel_matches_one_device():
    """ep_size 2 and 4 on 4 CPU devices: each device holds its experts (and their adapters); tokens gather within
    the expert group and the partial outputs reduce-scatter back; the loss, router losses and every gradient equal
    the unsplit model's (dense layers among the MoE ones, padding rows, full fine-tuning, LoRA with the router, and
    LoRA over NF4 and NVFP4 quantized experts, each device holding its experts' quantized parts)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", EP_SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


BRANCH_SCRIPT = r'''
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from models import moe
ep, E, k, T, D, I, r = 4, 8, 3, 16, 16, 24, 4  # T tokens per device
rng = np.random.default_rng(0)
f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
x, gate, up, down = f(ep * T, D), f(E, D, I), f(E, D, I), f(E, I, D)
lora = {"gate_proj": (f(E, D, r), f(E, r, I)), "down_proj": (f(E, I, r), f(E, r, D))}
mesh = Mesh(np.array(jax.devices()), ("expert",))
local = E // ep

def loss(x, router, gate, up, down, lora, ep_axis=None, capacity=moe.EP_CAPACITY):
    y, _ = moe.moe_mlp(x, router, gate, up, down, k=k, norm_topk_prob=True, lora=lora, lora_scale=0.5,
                       ep_axis=ep_axis, ep_experts=local if ep_axis else None, ep_capacity=capacity)
    return jnp.sum(jnp.sin(y)), y

def split(capacity):
    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"), P("expert"))

    def per_device(*a):
        (l, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(
            *a, ep_axis="expert", capacity=capacity)
        # the loss and the router's gradient: each device's share of the tokens
        return (jax.lax.psum(l, "expert"), y), (g[0], jax.lax.psum(g[1], "expert"), *g[2:])

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=((P(), P("expert")), specs),
                                 check_vma=False))

def own_pairs(router):  # (token, expert) pairs of the whole group each device's experts receive
    idx = moe.route(x @ router.T, k, True)[1]
    return np.bincount(np.asarray(idx).reshape(-1) // local, minlength=ep)

rows = int(np.ceil(moe.EP_CAPACITY * T * k))
balanced = f(E, D)
skewed = balanced.at[:local].add(5.0 * jnp.sign(x.mean(0)))  # device 0's experts win most tokens
assert own_pairs(balanced).max() <= rows < own_pairs(skewed).max(), (own_pairs(balanced), own_pairs(skewed), rows)
for name, router in (("fast path", balanced), ("fallback", skewed)):
    (want_l, want_y), want_g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(
        x, router, gate, up, down, lora)
    for capacity in (moe.EP_CAPACITY, float(ep)):  # float(ep): the whole buffer, no branch
        (got_l, got_y), got_g = split(capacity)(x, router, gate, up, down, lora)
        np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got_l, want_l, rtol=1e-5, err_msg=name)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_g)[0], jax.tree.leaves(want_g), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"{name} {capacity} {path}")
    print("ok", name)

# the branch's outputs are its result and the fast path's activations ([rows, ...]), never a copy of the experts'
# weights or adapters (what differentiating a plain lax.cond gives on jax 0.11)
def conds(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "cond":
            yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                yield from conds(getattr(sub, "jaxpr", sub)) if hasattr(getattr(sub, "jaxpr", sub), "eqns") else ()

jaxpr = jax.make_jaxpr(split(moe.EP_CAPACITY))(x, balanced, gate, up, down, lora).jaxpr
weights = {(E // ep, *a.shape[1:]) for a in jax.tree.leaves((gate, up, down, lora))}
out = [tuple(v.aval.shape) for e in conds(jaxpr) for v in e.outvars]
# the backward's cotangents, one per weight and adapter, and nothing else of their shapes
assert sum(s in weights for s in out) == len(jax.tree.leaves((gate, up, down, lora))), out
print("ok")
'''


def test_expert_parallel_fast_path_and_its_fallback():
    """Each device computes the first EP_CAPACITY x T x K of the group's sorted pairs when its experts' pairs fit
    there, else the whole buffer: balanced routing (every device within capacity) and a router skewed to one
    device's experts (beyond it) give the single-device output and gradients, as does a capacity holding it all;
    the forward keeps only the fast path's activations (the weights pass by reference)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", BRANCH_SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
