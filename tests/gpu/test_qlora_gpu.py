"""QLoRA on the GPU against the CPU: NF4 quantization bit for bit (the module avoids float division, which XLA:GPU
rounds to within an ulp), every format's dequantization bit for bit from the same parameters, and a tiny QLoRA
model's loss and LoRA gradients (fp32 dots at full precision on both backends)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.qlora import base as qlora_base
from surogate_jax.qlora.base import QloraSpec

pytestmark = pytest.mark.gpu

SPECS = [QloraSpec("nf4", 64, True), QloraSpec("nf4", 256, False), QloraSpec("fp8", 128), QloraSpec("fp4", 16)]
SHAPES = [(96, 160), (1000, 1504), (7, 48)]


def _cpu():
    return jax.devices("cpu")[0]


def _weight(shape, seed):
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.02
    return w.at[0, :3].multiply(100.0).astype(jnp.bfloat16)  # a few outliers, as real checkpoints have


def _bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: f"{s.block_size}-{int(s.double_quant)}")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_quantize_on_gpu_equals_cpu(spec, shape):
    w = _weight(shape, 1)
    quantize = jax.jit(lambda w: qlora_base.quantize(spec, w))
    gpu = quantize(w)
    cpu = quantize(jax.device_put(w, _cpu()))  # a jitted call runs where its inputs are
    for k in cpu:
        np.testing.assert_array_equal(_bits(gpu[k]), _bits(cpu[k]), err_msg=k)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.format)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_dequantize_on_gpu_equals_cpu(spec, shape):
    """From the same parameters (quantized on the CPU), the GPU's dequantized weight is the CPU's, bit for bit."""
    params = jax.jit(lambda w: qlora_base.quantize(spec, w))(jax.device_put(_weight(shape, 2), _cpu()))
    dequantize = jax.jit(lambda p: qlora_base.dequantize(spec, p, shape, jnp.float32))
    cpu = dequantize(params)
    gpu = dequantize(jax.device_put(params, jax.devices()[0]))
    np.testing.assert_array_equal(np.asarray(gpu), np.asarray(cpu))


CFG = DecoderConfig(model_type="qwen3", vocab_size=67, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, initializer_range=0.2,
                    lora=LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj")))


@pytest.mark.parametrize("spec", SPECS[::2], ids=lambda s: s.format)
def test_qlora_step_on_gpu_matches_cpu(spec, assert_close):
    model = Decoder(CFG.replace(qlora=spec, attention_impl="xla"))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)

    def init():
        v = model.init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids)
        lora = jax.tree.map(lambda a: a + 0.05, nn.meta.unbox(v["lora"]))  # non-zero B: gradients reach A
        return nn.meta.unbox(v["params"]), lora

    with jax.default_device(_cpu()):
        params, lora = jax.jit(init)()

    def loss(lora, params, ids):
        logits = model.apply({"params": params, "lora": lora}, ids)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0] ** 2)

    grad = jax.value_and_grad(loss)
    with jax.default_matmul_precision("float32"):  # the GPU's default fp32 dots are TF32
        want = jax.jit(grad)(*jax.device_put((lora, params, ids), _cpu()))
        got = jax.jit(grad)(*jax.device_put((lora, params, ids), jax.devices()[0]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, jnp.float32)
