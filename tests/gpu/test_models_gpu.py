"""On the GPU: cuDNN flash attention and our kernels inside the decoder (all of MODEL_KERNELS, opted
in through DecoderConfig.kernels) agree with the reference paths, for plain and packed
(segment_ids) rows, forward and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig
from surogate_jax.models.llamalike import MODEL_KERNELS

pytestmark = pytest.mark.gpu

CFG = DecoderConfig(
    model_type="qwen3", vocab_size=1001, hidden_size=256, intermediate_size=704, num_layers=3,
    num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, initializer_range=0.05,
    dtype=jnp.bfloat16, param_dtype=jnp.float32,
)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _setup(seed, B=2, T=384):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    import flax.linen as nn

    params = nn.meta.unbox(Decoder(CFG).init(jax.random.key(seed), ids[:, :4])["params"])
    return ids, params


def _loss(params, cfg, ids, **kw):
    logits = Decoder(cfg).apply({"params": params}, ids, **kw).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0])


@pytest.mark.slow
def test_cudnn_matches_xla_forward_and_grads():
    ids, params = _setup(0)
    fp32 = CFG.replace(dtype=jnp.float32, attention_impl="xla")
    want = Decoder(fp32).apply({"params": params}, ids)
    got = Decoder(CFG.replace(attention_impl="cudnn")).apply({"params": params}, ids)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert _rel(got.astype(jnp.float32), want) < 2e-2  # bf16 activations vs fp32
    g_ref = jax.grad(_loss)(params, fp32, ids)
    g = jax.grad(_loss)(params, CFG.replace(attention_impl="cudnn"), ids)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref), strict=True):
        assert _rel(a, b) < 5e-2, path  # bf16 backward through 3 layers vs fp32


@pytest.mark.parametrize("max_segments", [None, 4, 9])  # None: the dense mask; else cuDNN's packed layout
def test_packed_rows_with_cudnn(max_segments):
    lengths = (100, 37, 250, 125)
    T = sum(lengths)
    ids, params = _setup(1, B=1, T=T)
    seg = jnp.asarray(np.concatenate([np.full(n, k + 1) for k, n in enumerate(lengths)])[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    cfg = CFG.replace(attention_impl="cudnn", max_segments=max_segments)
    packed = Decoder(cfg).apply({"params": params}, ids, positions=pos, segment_ids=seg).astype(jnp.float32)
    start = 0
    for n in lengths:
        alone = Decoder(cfg).apply({"params": params}, ids[:, start : start + n]).astype(jnp.float32)
        assert _rel(packed[:, start : start + n], alone) < 2e-2
        start += n


@pytest.mark.slow
def test_kernels_inside_model_match_reference(force_ref):
    ids, params = _setup(2)
    cfg = CFG.replace(attention_impl="xla", dtype=jnp.float32, kernels=MODEL_KERNELS)
    fwd = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, ids))
    text = fwd.lower(params).as_text()
    for op in set(MODEL_KERNELS) - {"swiglu_lora"}:  # needs LoRA: test_swiglu_lora_gpu.py
        target = "rope_qk" if op == "rope" else op  # the attention calls q and k as one pair
        assert f"surogate_{target}_fwd" in text, op
    grad = jax.jit(jax.grad(lambda p: _loss(p, cfg, ids)))
    # Full fp32 matmuls: TF32 (the GPU default) turns 1-ulp norm differences into ~1e-3 ones.
    with jax.default_matmul_precision("highest"):
        ffi, g_ffi = fwd(params), grad(params)
        force_ref("ref")
        ref = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, ids))(params)
        g_ref = jax.jit(jax.grad(lambda p: _loss(p, cfg, ids)))(params)
    assert _rel(ffi, ref) < 1e-5
    for a, b in zip(jax.tree.leaves(g_ffi), jax.tree.leaves(g_ref), strict=True):
        assert _rel(a, b) < 1e-4


def test_moe_decoder_grouped_kernels_match_the_reference(force_ref):
    """A bf16 Qwen3-MoE decoder with the grouped GEMMs on our kernels against the same model with the grouped GEMMs'
    reference (ragged_dot, fp32 accumulation): loss and every gradient. Same dtype on both sides, so the routing is
    the same; against an fp32 model bf16 flips near-tied top-k choices, and a flipped token moves whole rows between
    experts' weight gradients."""
    cfg = CFG.replace(model_type="qwen3_moe", num_experts=12, num_experts_per_tok=3, moe_intermediate_size=136,
                      norm_topk_prob=False, attention_impl="xla")
    ids, _ = _setup(3, B=2, T=200)
    import flax.linen as nn  # noqa: PLC0415

    params = nn.meta.unbox(Decoder(cfg).init(jax.random.key(3), ids[:, :4])["params"])
    text = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, ids)).lower(params).as_text()
    assert "surogate_grouped_matmul" in text
    l, g = jax.value_and_grad(_loss)(params, cfg, ids)
    force_ref("ref:grouped_matmul")
    l_ref, g_ref = jax.value_and_grad(_loss)(params, cfg, ids)
    assert abs(float(l) - float(l_ref)) < 1e-2 * abs(float(l_ref))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref), strict=True):
        assert _rel(a, b) < 2e-2, path  # one bf16 rounding per GEMM, propagated through 3 layers


@pytest.mark.parametrize("cached", [False, True], ids=["per-call", "lora-cache"])
def test_moe_decoder_fp8_experts_match_the_reference(cached, force_ref):
    """fp8-hybrid on a bf16 Qwen3-MoE decoder: the experts' FP8 grouped GEMMs on our kernel (their custom call is in
    the program) against the same model with only those GEMMs forced to their reference (the quantized values
    through ragged_dot in fp32; the dense projections' FP8 GEMMs the same cuBLASLt ones on both sides, so the routing
    is the same): loss and gradients, with the experts quantized per call (full fine-tuning) or cached in E4M3
    (LoRA's frozen base, gradients of the adapters)."""
    from surogate_jax.models import LoraSpec  # noqa: PLC0415
    from surogate_jax.precision import recipe as R  # noqa: PLC0415

    base = CFG.replace(model_type="qwen3_moe", num_experts=12, num_experts_per_tok=3, moe_intermediate_size=144,
                       norm_topk_prob=False, attention_impl="xla", param_dtype=jnp.bfloat16)
    if cached:
        base = base.replace(lora=LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "up_proj", "down_proj")))
    ids, _ = _setup(5, B=2, T=200)
    import flax.linen as nn  # noqa: PLC0415

    def run(expert_ref):
        if expert_ref:
            force_ref("ref:grouped_matmul")
        r = R.QuantRecipe("fp8-hybrid")
        model = Decoder(base.replace(recipe=r))
        v = nn.meta.unbox(model.init({"params": jax.random.key(3), "lora": jax.random.key(4)}, ids[:, :4]))
        params, quant = v["params"], R.init_quant_state(model, ids[:, :4])
        lora = jax.tree.map(lambda a: a + 0.02, v.get("lora", {}))
        if cached:
            params = R.cache_frozen_weights(params, r, base.num_layers)

        def loss(p, a):
            out = model.apply({"params": params if cached else p, "lora": a, "fp8": quant}, ids)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        text = jax.jit(loss).lower(params, lora).as_text()
        assert ("surogate_grouped_matmul_fp8" in text) != expert_ref
        assert "__cublas$lt$matmul$f8" in text or "surogate_fp8_matmul" in text  # the dense FP8 GEMMs, both sides
        return jax.value_and_grad(loss, argnums=1 if cached else 0)(params, lora)

    (l, g), (l_ref, g_ref) = run(False), run(True)
    assert abs(float(l) - float(l_ref)) < 1e-2 * abs(float(l_ref))
    # Gradients only finite and of the reference's structure: under current scaling a one-ulp change of one value
    # can move a tensor's amax, hence its scale and every element's FP8 rounding, so whole-model gradients differ
    # at FP8's noise level between two summation orders (one embedding row times 1 + 2^-7, about one bf16 ulp,
    # moved the embedding gradient by 13% through the reference alone, 0.7% under bf16; CPU, 2026-11-28; 10-16%
    # kernel against reference here on the H200). The GEMMs are compared elementwise in test_grouped_matmul_gpu.py.
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), path
