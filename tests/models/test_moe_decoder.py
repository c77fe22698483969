"""Qwen3-MoE checkpoints through load_pretrained / save_pretrained, against transformers' Qwen3MoeForCausalLM: fp32
logits within 1e-4 on tiny random configs (uneven expert counts, top-k with and without renormalisation); the
per-expert tensors stacked on load and split back on save (transformers loads what we write); dense layers among
sparse ones (mlp_only_layers, decoder_sparse_step 2) as their own layer stacks; shared experts refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import hf_logits, rel_err

import surogate_jax
from surogate_jax.errors import ModelLoadError, UnsupportedConfigError
from surogate_jax.models import config_from_hf
from surogate_jax.safetensors_io import CheckpointReader

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
           decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def _hf_moe(E, k, norm, seed, **layout):
    cfg = transformers.Qwen3MoeConfig(**{**MOE, **layout}, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _ids(E):
    return np.random.default_rng(E).integers(0, 101, size=(2, 13), dtype=np.int32)


@pytest.mark.parametrize(("E", "k", "norm"), [(6, 2, True), (5, 3, False), (7, 1, True)])
def test_moe_checkpoint_logits_match_transformers(E, k, norm, tmp_path):
    hf = _hf_moe(E, k, norm, seed=E + k)
    hf.save_pretrained(tmp_path)  # one tensor per expert, as on the Hub
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in CheckpointReader(tmp_path).names()
    model, params = surogate_jax.load_pretrained(tmp_path, dtype=jnp.float32)
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen3_moe", E, k, norm)
    assert params["layers"]["mlp"]["experts"]["gate_proj"].shape == (2, E, 64, 40)
    ours = model.apply({"params": params}, jnp.asarray(_ids(E)))
    assert rel_err(ours, hf_logits(hf, _ids(E))) < 1e-4


# (HF layout keys, our stacks: (name, first layer, layers, sparse))
LAYOUTS = [
    (dict(num_hidden_layers=4, decoder_sparse_step=2),
     (("layers", 0, 1, False), ("layers_1", 1, 1, True), ("layers_2", 2, 1, False), ("layers_3", 3, 1, True))),
    (dict(num_hidden_layers=5, mlp_only_layers=[0, 3]),
     (("layers", 0, 1, False), ("layers_1", 1, 2, True), ("layers_3", 3, 1, False), ("layers_4", 4, 1, True))),
    (dict(num_hidden_layers=3, decoder_sparse_step=3, mlp_only_layers=[1]),
     (("layers", 0, 2, False), ("layers_2", 2, 1, True))),
]


@pytest.mark.parametrize(("layout", "stacks"), LAYOUTS)
def test_dense_layers_among_sparse_ones_match_transformers(layout, stacks, tmp_path):
    """Each run of dense or MoE layers is one layer stack; the logits, the per-layer tensors written back and the
    config's layout keys equal transformers'."""
    hf = _hf_moe(5, 2, False, seed=7, **layout)
    hf.save_pretrained(tmp_path / "hf")
    model, params = surogate_jax.load_pretrained(tmp_path / "hf", dtype=jnp.float32)
    assert model.config.layer_stacks() == stacks
    assert set(params) == {"embedding", "lm_head", "norm", *(s[0] for s in stacks)}
    for name, _, n, sparse in stacks:
        assert params[name]["mlp"]["experts" if sparse else "up_proj"] is not None
        assert jax.tree.leaves(params[name])[0].shape[0] == n
    ours = model.apply({"params": params}, jnp.asarray(_ids(5)))
    assert rel_err(ours, hf_logits(hf, _ids(5))) < 1e-4
    surogate_jax.save_pretrained(tmp_path / "ours", model, params)
    assert set(CheckpointReader(tmp_path / "ours").names()) == set(CheckpointReader(tmp_path / "hf").names())
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    for key in ("decoder_sparse_step", "mlp_only_layers"):
        assert written[key] == getattr(hf.config, key)


def test_saved_moe_loads_in_transformers(tmp_path):
    hf = _hf_moe(5, 2, True, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model, params = surogate_jax.load_pretrained(tmp_path / "hf", dtype=jnp.float32)
    surogate_jax.save_pretrained(tmp_path / "ours", model, params)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (written["model_type"], written["num_experts"], written["architectures"]) == (
        "qwen3_moe", 5, ["Qwen3MoeForCausalLM"])
    names = set(CheckpointReader(tmp_path / "ours").names())
    assert names == set(CheckpointReader(tmp_path / "hf").names())  # per-expert tensors, as we read them
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").float()
    ours = model.apply({"params": params}, jnp.asarray(_ids(5)))
    assert rel_err(ours, hf_logits(back.eval(), _ids(5))) < 1e-4


def _cfg(**kw):
    d = {**MOE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, **kw}
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"mlp_only_layers": [2]}, ModelLoadError, "mlp_only_layers=\\[2\\] must be a list of layer indices in \\[0, "
                                                "num_hidden_layers=2\\)"),
    ({"mlp_only_layers": 1}, ModelLoadError, "mlp_only_layers=1 must be a list"),
    ({"decoder_sparse_step": 0}, ModelLoadError, "decoder_sparse_step=0 must be an integer >= 1"),
    ({"shared_expert_intermediate_size": 32}, UnsupportedConfigError, "shared experts are not implemented"),
    ({"num_experts_per_tok": 5}, ModelLoadError, "num_experts_per_tok=5 exceeds num_experts=4"),
    ({"num_experts": None}, ModelLoadError, "the required field 'num_experts' \\(or 'num_local_experts'\\) is missing"),
    ({"num_experts": 2.5}, ModelLoadError, "num_experts=2.5 must be a positive integer"),
    ({"moe_intermediate_size": 0}, ModelLoadError, "moe_intermediate_size=0 must be a positive integer"),
])
def test_unsupported_or_broken_moe_configs_are_refused(change, error, message):
    with pytest.raises(error, match=message):
        config_from_hf(_cfg(**change))


def test_transformers_5_expert_count_name_is_read():
    d = _cfg(num_experts=None, num_local_experts=6)
    assert config_from_hf(d).num_experts == 6


def test_moe_config_is_checked():
    cfg = config_from_hf(_cfg())
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        cfg.replace(num_experts_per_tok=5)
    from surogate_jax.precision.recipe import QuantRecipe

    with pytest.raises(ValueError, match="recipe nvfp4 on a mixture-of-experts model: only fp8-hybrid"):
        cfg.replace(recipe=QuantRecipe("nvfp4"))
    with pytest.raises(ValueError, match="skip_quant_first_layers / skip_quant_last_layers on a mixture-of-experts"):
        cfg.replace(recipe=QuantRecipe("fp8-hybrid", skip_first=1))
    assert cfg.replace(recipe=QuantRecipe("fp8-hybrid")).recipe.name == "fp8-hybrid"
    with pytest.raises(ValueError, match="decoder_sparse_step=0 must be >= 1"):
        cfg.replace(decoder_sparse_step=0)
    with pytest.raises(ValueError, match="mlp_only_layers=\\[2\\] layer indices in \\[0, 2\\)"):
        cfg.replace(mlp_only_layers=(2,))


@pytest.mark.parametrize("layout", [{}, {"decoder_sparse_step": 2, "num_hidden_layers": 4}], ids=["moe", "mixed"])
def test_fp8_hybrid_expert_cache_equals_quantizing_every_call(layout):
    """LoRA under fp8-hybrid: the frozen experts cached once in E4M3 (recipe.cache_experts, [L, E, out, in] with a
    scale per layer and expert, in every layer stack) give the very forward and LoRA gradients of quantizing the bf16
    experts at each call; the cache dequantizes back to each stack's [L, E, in, out] within E4M3's half step; and the
    experts' GEMMs did change against the bf16 recipe."""
    from surogate_jax.models import Decoder, LoraSpec  # noqa: PLC0415
    from surogate_jax.precision import recipe as R  # noqa: PLC0415

    r = R.QuantRecipe("fp8-hybrid", fp8_impl="ref")
    cfg = config_from_hf(_cfg(**layout)).replace(lora=LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "up_proj")),
                                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)  # a bf16 base
    model = Decoder(cfg.replace(recipe=r))
    ids = jnp.asarray(_ids(4)[:, :16])
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids)
    params, quant = v["params"], R.init_quant_state(model, ids)
    lora = jax.tree.map(lambda a: a + 0.05, v["lora"])
    cached = R.cache_frozen_weights(params, r, cfg.num_layers)
    stacks = [name for name, _, _, sparse in cfg.layer_stacks() if sparse]
    for name in stacks:
        c = cached[name]["mlp"]["experts"]["up_proj"]
        n = params[name]["mlp"]["experts"]["up_proj"].shape[0]
        assert c[R.KERNEL_NK].dtype == jnp.float8_e4m3fn
        assert c[R.KERNEL_NK].shape == (n, 4, 40, 64) and c[R.KERNEL_SCALE].shape == (n, 4)

    def loss(p, a):
        out = model.apply({"params": p, "lora": a, "fp8": quant}, ids)
        return jnp.sum(jnp.square(out.astype(jnp.float32))), out

    # the dense projections cached in both (their uncached form scales by the delayed state), the experts not here
    per_call = {k: jax.tree.map(lambda a: a, v) for k, v in cached.items()}
    for name in stacks:
        per_call[name] = {**cached[name], "mlp": {**cached[name]["mlp"], "experts": params[name]["mlp"]["experts"]}}
    (_, y1), g1 = jax.value_and_grad(loss, argnums=1, has_aux=True)(cached, lora)
    (_, y2), g2 = jax.value_and_grad(loss, argnums=1, has_aux=True)(per_call, lora)
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    plain = Decoder(cfg).apply({"params": params, "lora": lora}, ids)
    assert float(jnp.abs(plain.astype(jnp.float32) - y2.astype(jnp.float32)).max()) > 1e-3
    back = R.dequantize_cache(cached, r, cfg.num_layers, params)
    for name in stacks:
        for p in ("gate_proj", "up_proj", "down_proj"):
            w = np.asarray(params[name]["mlp"]["experts"][p], np.float32)
            got = np.asarray(back[name]["mlp"]["experts"][p], np.float32)
            assert got.shape == w.shape
            np.testing.assert_allclose(got, w, rtol=2**-4, atol=np.abs(w).max() * 2**-9)


def test_an_moe_config_whose_layers_are_all_dense_trains_without_router_terms():
    """Every layer in mlp_only_layers: no router, no router statistics; the loss is the CE alone."""
    from surogate_jax import train as T  # noqa: PLC0415
    from surogate_jax.models import Decoder  # noqa: PLC0415

    cfg = config_from_hf(_cfg(mlp_only_layers=[0, 1]))
    assert cfg.moe_layers == 0 and cfg.layer_stacks() == (("layers", 0, 2, False),)
    model = Decoder(cfg)
    ids = jnp.asarray(_ids(4))
    params = model.init(jax.random.key(0), ids)["params"]
    assert "gate" not in params["layers"]["mlp"]
    batch = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones(ids.shape, jnp.float32),
             "positions": jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape),
             "segment_ids": jnp.ones(ids.shape, jnp.int32)}
    total, (count, ce, router) = T.train_loss(model, {}, params, batch, None, router_weight=1.0)
    assert router == {} and float(total) == float(ce)


def test_lora_dropout_on_the_experts():
    """The experts' adapters see dropout(x) when moe_mlp gets (rate, key) (each row and projection its own mask, the
    kept values scaled by 1 / (1 - rate)): one key gives one output, another key another; the block is multilinear in
    the masks, so the mean over keys tends to the no-dropout output, much closer than one draw. Through the model
    the experts take the layer's "dropout" rng, and without one the forward is the no-dropout forward exactly."""
    from surogate_jax.models import Decoder, LoraSpec, moe  # noqa: PLC0415

    rng = np.random.default_rng(0)
    T, D, I, E, r = 24, 16, 8, 4, 3
    x, router, gate, up, down = (jnp.asarray(rng.standard_normal(s) * 0.5, jnp.float32)
                                 for s in ((T, D), (E, D), (E, D, I), (E, D, I), (E, I, D)))
    lora = {p: (jnp.asarray(rng.standard_normal((E, a, r)), jnp.float32),
                jnp.asarray(rng.standard_normal((E, r, b)), jnp.float32))
            for p, a, b in (("up_proj", D, I), ("down_proj", I, D))}
    run = jax.jit(lambda key: moe.moe_mlp(x, router, gate, up, down, k=2, norm_topk_prob=True, lora=lora,
                                          lora_scale=0.5, lora_dropout=(0.5, key))[0])
    want = moe.moe_mlp(x, router, gate, up, down, k=2, norm_topk_prob=True, lora=lora, lora_scale=0.5)[0]
    one = run(jax.random.key(3))
    np.testing.assert_array_equal(run(jax.random.key(3)), one)
    assert float(jnp.abs(run(jax.random.key(4)) - one).max()) > 1e-3
    err_one = float(jnp.sqrt(jnp.mean((one - want) ** 2)))
    mean = sum(run(jax.random.key(10 + i)) for i in range(256)) / 256
    assert float(jnp.sqrt(jnp.mean((mean - want) ** 2))) < 0.15 * err_one

    cfg = config_from_hf(_cfg()).replace(lora=LoraSpec(rank=4, alpha=8.0, targets=("up_proj",), dropout=0.5))
    model = Decoder(cfg)
    ids = jnp.asarray(_ids(4)[:, :8])
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids)
    variables = {"params": v["params"],
                 "lora": jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(2), a.shape), v["lora"])}
    plain = Decoder(cfg.replace(lora=LoraSpec(rank=4, alpha=8.0, targets=("up_proj",)))).apply(variables, ids)
    np.testing.assert_array_equal(model.apply(variables, ids), plain)
    assert float(jnp.abs(model.apply(variables, ids, rngs={"dropout": jax.random.key(5)}) - plain).max()) > 1e-4


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_qlora_experts_load_quantized_and_dequantize_to_the_checkpoint(fmt, tmp_path, assert_close):
    """A QLoRA base quantizes each layer's experts as one [E * out, in] weight while loading: the forward and the LoRA
    gradients through it equal the plain model's over its dequantized weights, which are the checkpoint's within the
    format's error."""
    from surogate_jax.hf import dequantize_base  # noqa: PLC0415
    from surogate_jax.qlora.base import QloraSpec, param_names  # noqa: PLC0415

    MOE_Q = {**MOE, "hidden_size": 128, "moe_intermediate_size": 128, "head_dim": 32}  # whole 64 / 128 blocks
    cfg = transformers.Qwen3MoeConfig(**MOE_Q, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    spec = QloraSpec("nf4", 64, True) if fmt == "nf4" else QloraSpec("fp8", 128)
    qmodel, qparams = surogate_jax.load_pretrained(tmp_path, dtype=jnp.float32, qlora=spec)
    assert set(qparams["layers"]["mlp"]["experts"]["up_proj"]) == set(param_names(spec))
    plain, dq = dequantize_base(qmodel, qparams)
    _, exact = surogate_jax.load_pretrained(tmp_path, dtype=jnp.float32)
    got, want = (np.asarray(p["layers"]["mlp"]["experts"]["down_proj"]) for p in (dq, exact))
    assert got.shape == want.shape == (2, 4, 128, 128)
    # at most half a code step of the block's / tile's largest value: NF4's widest gap is 0.7230 -> 1.0; E4M3's top
    # binade steps 32 of 448
    assert rel_err(got, want) < (0.2770 / 2 if fmt == "nf4" else 16 / 448)
    ids = jnp.asarray(_ids(4))
    np.testing.assert_allclose(np.asarray(qmodel.apply({"params": qparams}, ids)),
                               np.asarray(plain.apply({"params": dq}, ids)), rtol=2e-5, atol=2e-5)
    # LoRA gradients through the frozen grouped GEMM (dequantized again in its backward) equal those over the
    # dequantized experts

    from surogate_jax.models import Decoder, LoraSpec  # noqa: PLC0415

    spec_l = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "up_proj", "down_proj"))
    mq, mp = Decoder(qmodel.config.replace(lora=spec_l)), Decoder(plain.config.replace(lora=spec_l))
    lora = mp.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids[:, :4])["lora"]
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape, a.dtype), lora)

    def grads(model, params):
        loss = lambda lo: jnp.mean(model.apply({"params": params, "lora": lo}, ids) ** 2)  # noqa: E731
        return jax.value_and_grad(loss)(lora)

    (lq, gq), (lp, gp) = grads(mq, qparams), grads(mp, dq)
    assert_close(lq, lp, jnp.float32)
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gp), strict=True):
        assert_close(a, b, jnp.float32)
    assert float(jnp.abs(gq["layers"]["mlp"]["experts"]["up_proj"]["lora_a"]).max()) > 0


@pytest.mark.parametrize(("aux", "padded", "layout"), [(0.01, False, {}), (0.3, True, {}),
                                                     (0.3, True, LAYOUTS[1][0])])
def test_train_loss_equals_transformers_loss_with_router_logits(aux, padded, layout, tmp_path):
    """train.train_loss on one micro-batch (CE + router_aux_loss_coef x the load-balancing loss) against
    transformers' Qwen3MoeForCausalLM(labels=..., output_router_logits=True), whose loss is the same sum; with
    padding the aux loss skips padded rows as transformers' attention mask does."""
    from surogate_jax import train as T  # noqa: PLC0415

    hf = _hf_moe(6, 2, True, seed=11, **layout)
    hf.config.router_aux_loss_coef = hf.router_aux_loss_coef = aux  # the model copies it at construction
    hf.save_pretrained(tmp_path)
    model, params = surogate_jax.load_pretrained(tmp_path, dtype=jnp.float32)
    assert model.config.router_aux_loss_coef == aux
    ids = _ids(6)
    mask = np.ones_like(ids)
    if padded:
        mask[1, 9:] = 0  # the second row's last 4 tokens are padding
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                 labels=torch.from_numpy(np.where(mask == 1, ids, -100)).long(), output_router_logits=True)
    B, L = ids.shape
    loss_mask = np.zeros((B, L), np.float32)
    loss_mask[:, :-1] = mask[:, 1:]  # predicting token t+1 from t, where t+1 is real
    batch = {"input_ids": jnp.asarray(ids), "targets": jnp.asarray(np.roll(ids, -1, axis=1)),
             "loss_mask": jnp.asarray(loss_mask), "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             "segment_ids": jnp.asarray(mask, jnp.int32)}  # 0 = padding
    n = float(loss_mask.sum())
    total, (count, ce, router) = T.train_loss(model, {}, params, batch, None, router_weight=n)
    assert float(count) == n and float(ce) < float(total)
    np.testing.assert_allclose(float(router["aux_loss"]), float(out.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(total) / n, float(out.loss), rtol=1e-5)


@pytest.mark.parametrize("layout", [{}, LAYOUTS[1][0]])
def test_peft_round_trip_with_expert_adapters_and_a_trained_router(layout, tmp_path):
    """save_peft writes one lora_A / lora_B pair per expert and, under train_router, the router as PEFT's
    modules_to_save; load_peft reads back the same tree, and merge folds every expert and the router in (with
    dense layers among the sparse ones: their plain adapters, HF's layer numbers)."""
    from surogate_jax import lora as lora_lib  # noqa: PLC0415
    from surogate_jax.models import Decoder, LoraSpec  # noqa: PLC0415

    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "up_proj", "down_proj"), train_router=True)
    cfg = config_from_hf(_cfg(**layout)).replace(lora=spec)
    model = Decoder(cfg)
    adapters = lora_lib.init_adapters(model, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), adapters)
    lora_lib.save_peft(tmp_path, model, adapters, base_model="tiny")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"] == ["gate"]
    back = lora_lib.load_peft(tmp_path, model)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(adapters)[0], jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    plain = Decoder(cfg.replace(lora=None))
    base = jax.eval_shape(lambda: plain.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    base = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), base)
    merged = lora_lib.merge(base, adapters, cfg.lora)
    sparse = [name for name, _, _, is_sparse in cfg.layer_stacks() if is_sparse]
    assert lora_lib.router_paths(adapters) == [(name, "mlp", "gate", "kernel") for name in sparse]
    for name in sparse:
        router = adapters[name]["mlp"]["gate"]["kernel"]
        np.testing.assert_array_equal(merged[name]["mlp"]["gate"]["kernel"], router)
        up = adapters[name]["mlp"]["experts"]["up_proj"]
        want = 2.0 * np.einsum("leir,lero->leio", np.asarray(up["lora_a"]), np.asarray(up["lora_b"]))  # alpha / r
        np.testing.assert_allclose(merged[name]["mlp"]["experts"]["up_proj"], want, rtol=1e-5, atol=1e-7)
    written = set(CheckpointReader(tmp_path).names())
    for i in range(cfg.num_layers):
        mod = f"base_model.model.model.layers.{i}.mlp."
        assert (mod + "gate.weight" in written) == cfg.sparse_layer(i)
        assert (mod + "experts.1.up_proj.lora_A.weight" in written) == cfg.sparse_layer(i)
        assert (mod + "up_proj.lora_A.weight" in written) == (not cfg.sparse_layer(i))
