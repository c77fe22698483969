"""QLoRA inside the model: loading (online and pre-quantized), the frozen GEMM, gradients, dequantized bases."""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.errors import ModelLoadError
from surogate_jax.hf import dequantize_base, load_pretrained, save_pretrained
from surogate_jax.models import Decoder, projection_shape
from surogate_jax.models import hf_names as names
from surogate_jax.qlora import base as qlora_base
from surogate_jax.qlora.base import QloraSpec
from surogate_jax.safetensors_io import CheckpointReader

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from qlora_checkpoints import FP8_CONFIG, fp8_parts, write_prequantized  # noqa: E402
from tiny import CFG, SPEC, base_params  # noqa: E402

SPECS = [QloraSpec("nf4", 64, True), QloraSpec("nf4", 128, False), QloraSpec("fp8", 64), QloraSpec("fp4", 16)]


@pytest.fixture(scope="module", name="model_dir")
def _model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "model"
    save_pretrained(d, Decoder(CFG), base_params(3))
    return d


def _lora_params(model, seed=5):
    """Adapters with non-zero B, so gradients flow through both LoRA factors and the frozen base."""
    v = model.init({"params": jax.random.key(0), "lora": jax.random.key(seed)}, jnp.zeros((1, 4), jnp.int32))
    lora = nn.meta.unbox(v["lora"])
    return jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(seed + 1), a.shape, a.dtype), lora)


def _loss_and_grads(model, params, lora, ids):
    def loss(lora):
        logits = model.apply({"params": params, "lora": lora}, ids)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0] ** 2)

    return jax.jit(jax.value_and_grad(loss))(lora)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.block_size}-{int(s.double_quant)}")
def test_lora_grads_equal_those_over_the_dequantized_base(model_dir, spec, assert_close):
    """The QLoRA step is the LoRA step over dequantize(base): the dequantized kernels are the same bits, and loss and
    LoRA gradients agree to fp32 accumulation order (XLA compiles the two graphs differently, e.g. it may merge the
    plain model's q/k/v GEMMs, which sums in another order)."""
    model_q, params_q = load_pretrained(model_dir, qlora=spec)
    model_p, params_p = dequantize_base(model_q, params_q)
    assert model_p.config.qlora is None
    q_proj = params_q["layers"]["self_attn"]["q_proj"]
    assert "kernel" not in q_proj and set(q_proj) == set(qlora_base.param_names(spec))
    assert params_q["embedding"].dtype == jnp.float32 and "kernel" in params_p["layers"]["self_attn"]["q_proj"]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)
    mq, mp = Decoder(model_q.config.replace(lora=SPEC)), Decoder(model_p.config.replace(lora=SPEC))
    lora = _lora_params(mp)
    (lq, gq), (lp, gp) = _loss_and_grads(mq, params_q, lora, ids), _loss_and_grads(mp, params_p, lora, ids)
    assert_close(lq, lp, jnp.float32)
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gp), strict=True):
        assert_close(a, b, jnp.float32)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(gq))


@pytest.mark.parametrize("spec", SPECS[::2], ids=lambda s: s.format)
def test_online_quantization_is_the_format_of_each_layer_weight(model_dir, spec):
    """Each stacked slot holds quantize(the checkpoint's [out, in] weight of that layer)."""
    _, params_q = load_pretrained(model_dir, qlora=spec)
    reader = CheckpointReader(model_dir)
    for proj in ("o_proj", "down_proj"):
        parent = ("layers", "self_attn" if proj == "o_proj" else "mlp", proj)
        for layer in range(CFG.num_layers):
            w = reader.get(names.hf_name((*parent, "kernel"), layer))
            assert w.shape == projection_shape(CFG, proj)
            want = qlora_base.quantize(spec, jnp.asarray(w))
            got = params_q[parent[0]][parent[1]][proj]
            for k, v in want.items():
                bits = [np.atleast_1d(np.asarray(a)).view(np.uint8) for a in (got[k][layer], v)]
                np.testing.assert_array_equal(*bits, err_msg=f"{proj} {layer} {k}")


def _dequantized_logits_match(model_dir_q, plain_kernels, ids, assert_close):
    """load_pretrained of a pre-quantized checkpoint gives the dequantized model's logits (to fp32 rounding)."""
    model, params = load_pretrained(model_dir_q)
    reader = CheckpointReader(model_dir_q)
    plain = nn.meta.unbox(params)
    shapes = jax.eval_shape(Decoder(CFG).init, jax.random.key(0), ids)["params"]["layers"]
    for group, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                         ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for proj in projs:
            path = ("layers", group, proj, "kernel")
            per_layer = []
            for layer in range(CFG.num_layers):
                w = plain_kernels(reader, names.hf_name(path, layer))  # float32 [out, in]
                per_layer.append(w.T.reshape(shapes[group][proj]["kernel"].shape[1:]))
            plain["layers"][group][proj] = {"kernel": jnp.asarray(np.stack(per_layer))}
    got = jax.jit(model.apply)({"params": params}, ids)
    want = jax.jit(Decoder(model.config.replace(qlora=None)).apply)({"params": plain}, ids)
    assert_close(got, want, jnp.float32)
    return model


def test_prequantized_bnb_checkpoint_loads_as_its_dequantized_model(model_dir, tmp_path, assert_close):
    from surogate_jax.qlora import nf4

    qdir = tmp_path / "bnb"
    write_prequantized(model_dir, qdir, lambda w: nf4.quantize_nf4(w, block_size=128, double_quant=True),
                        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                         "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"})

    def kernels(reader, name):
        module = name.removesuffix(".weight")
        parts = {p: reader.get(f"{module}.{p}") for p in ("weight", "weight.absmax", "weight.quant_map",
                 "weight.nested_absmax", "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4")}
        return nf4.dequantize_nf4(parts)

    ids = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
    model = _dequantized_logits_match(qdir, kernels, ids, assert_close)
    assert model.config.qlora == QloraSpec("nf4", 128, True)


def test_prequantized_fp8_checkpoint_loads_as_its_dequantized_model(model_dir, tmp_path, assert_close):
    from surogate_jax.qlora import fp8_block

    qdir = write_prequantized(model_dir, tmp_path / "fp8", fp8_parts, FP8_CONFIG)

    def kernels(reader, name):
        module = name.removesuffix(".weight")
        w = reader.get(name)
        p = fp8_block.from_hf({"weight": w, "weight_scale_inv": reader.get(f"{module}.weight_scale_inv")}, w.shape, 128)
        return np.asarray(fp8_block.dequantize({k: jnp.asarray(v) for k, v in p.items()}, w.shape, block_size=128,
                                               dtype=jnp.float32))

    ids = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
    model = _dequantized_logits_match(qdir, kernels, ids, assert_close)
    assert model.config.qlora == QloraSpec("fp8", 128)


def test_unknown_quantization_is_refused_naming_it(model_dir, tmp_path):
    qdir = tmp_path / "gptq"
    write_prequantized(model_dir, qdir, lambda w: {"weight": w}, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ModelLoadError, match="quant_method='gptq'"):
        load_pretrained(qdir)


def test_asking_another_format_than_the_checkpoints_is_refused(model_dir, tmp_path):
    qdir = write_prequantized(model_dir, tmp_path / "fp8b", fp8_parts, FP8_CONFIG)
    with pytest.raises(ModelLoadError, match="pre-quantized as FP8"):
        load_pretrained(qdir, qlora=QloraSpec("nf4"))


def test_save_pretrained_refuses_a_quantized_base(model_dir, tmp_path):
    model, params = load_pretrained(model_dir, qlora=QloraSpec("fp8", 64))
    with pytest.raises(ValueError, match="QLoRA-quantized"):
        save_pretrained(tmp_path / "out", model, params)
    plain, plain_params = dequantize_base(model, params)
    save_pretrained(tmp_path / "out", plain, plain_params)
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "nvfp4"])
def test_quantizing_recipe_over_a_qlora_base_equals_its_frozen_cache(model_dir, recipe, assert_close):
    """Under fp8-hybrid / nvfp4 the dequantized base goes through the recipe's frozen GEMM as the LoRA cache of the
    dequantized base does (train.prepare_frozen): same loss and LoRA gradients, to fp32 accumulation order."""
    from tiny import random_batch

    from surogate_jax import train as T
    from surogate_jax.precision import recipe as recipe_lib
    from surogate_jax.precision.recipe import QuantRecipe

    r = QuantRecipe(recipe)
    model_q, params_q = load_pretrained(model_dir, qlora=QloraSpec("nf4", 64, True))
    model_p, params_p = dequantize_base(model_q, params_q)
    mq, mp = (Decoder(m.config.replace(lora=SPEC, recipe=r)) for m in (model_q, model_p))
    params_c = recipe_lib.cache_frozen_weights(params_p, r, CFG.num_layers)
    lora = _lora_params(Decoder(model_p.config.replace(lora=SPEC)))
    quant = recipe_lib.init_quant_state(mq)
    assert jax.tree.structure(quant) == jax.tree.structure(recipe_lib.init_quant_state(mp))
    batch = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(3), 2, 12, CFG.vocab_size).items()}

    def run(model, params):
        def loss(lora):
            s, c = T.batch_loss(model, params, lora, batch, jax.random.key(9), quant)
            return s / c
        return jax.jit(jax.value_and_grad(loss))(lora)

    (lq, gq), (lc, gc) = run(mq, params_q), run(mp, params_c)
    assert_close(lq, lc, jnp.float32)
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gc), strict=True):
        assert_close(a, b, jnp.float32)
