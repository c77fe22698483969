"""CPU tests of selective MoE expert dequantization (qlora_selective_expert_dequant), on the reference paths: with
group sizes the dequantization ops and `qlora.base.expert_weights` give zeros for exactly the experts without rows
and the full dequantization's bits elsewhere (NF4 with and without double quantization, FP8 tiles, NVFP4, odd
shapes); the frozen grouped GEMM and an MoE decoder give the same outputs and gradients with it on and off; it
falls back to dequantizing every expert where the reference GEMM would meet the kernel's unwritten rows; the ops
check the sizes' shape and dtype."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from surogate_jax.models import Decoder, DecoderConfig, LoraSpec
from surogate_jax.ops import nf4_dequantize, tile_dequantize
from surogate_jax.qlora import base, nf4
from surogate_jax.qlora.base import QloraSpec

SPECS = [QloraSpec("nf4", 64, double_quant=False), QloraSpec("nf4", 64, double_quant=True), QloraSpec("fp8", 64),
         QloraSpec("fp4", 16)]
SIZES = {  # experts without rows: some, the first and last, none, all
    "some": [3, 0, 1, 0, 7],
    "ends": [0, 2, 5, 1, 0],
    "none": [1, 1, 1, 1, 1],
    "all": [0, 0, 0, 0, 0],
}


def _active(sizes, rows_per_expert):
    """Row mask [E * rows_per_expert] of the experts with rows."""
    return np.repeat(np.asarray(sizes) > 0, rows_per_expert)


def _check_selected(sel, full, sizes, rows_per_expert, assert_bits):
    act = _active(sizes, rows_per_expert)
    sel, full = np.asarray(sel), np.asarray(full)
    assert_bits(sel[act], full[act], "experts with rows")
    assert_bits(sel[~act], np.zeros_like(sel[~act]), "experts without rows")


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_expert_weights_zero_exactly_the_empty_experts(spec, sizes, assert_bits):
    E, out, inp = 5, 64, 128
    w = jax.random.normal(jax.random.key(0), (E * out, inp), jnp.float32) * 0.05
    params = base.quantize(spec, w)
    full = base.expert_weights(spec, params, (E, out, inp), jnp.bfloat16)
    sel = base.expert_weights(spec, params, (E, out, inp), jnp.bfloat16, group_sizes=jnp.asarray(sizes, jnp.int32))
    _check_selected(sel.reshape(E * out, inp), full.reshape(E * out, inp), sizes, out, assert_bits)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(("experts", "rows", "cols"), [(5, 7, 49), (3, 1, 5), (4, 33, 100)], ids=str)
def test_nf4_op_odd_shapes(experts, rows, cols, out_dtype, assert_bits):
    shape = (experts * rows, cols)
    w = jax.random.normal(jax.random.key(1), shape, jnp.float32) * 0.05
    p = nf4.quantize(w, block_size=64, double_quant=False)
    sizes = np.arange(experts) % 2  # every other expert empty, the first among them
    kw = dict(shape=shape, block_size=64, out_dtype=out_dtype, impl="ref")
    full = nf4_dequantize(p["nf4_codes"], p["nf4_absmax"], nf4.NF4_CODE, 1.5, **kw)
    sel = nf4_dequantize(p["nf4_codes"], p["nf4_absmax"], nf4.NF4_CODE, 1.5, group_sizes=jnp.asarray(sizes), **kw)
    _check_selected(sel, full, sizes, rows, assert_bits)


@pytest.mark.parametrize(("fmt", "tile", "experts", "rows", "cols"),
                         [("fp8", 16, 5, 7, 49), ("fp8", 64, 3, 40, 130), ("nvfp4", 16, 3, 17, 48),
                          ("nvfp4", 16, 4, 1, 16)], ids=str)
def test_tile_op_odd_shapes(fmt, tile, experts, rows, cols, assert_bits):
    shape = (experts * rows, cols)
    rng = np.random.default_rng(2)
    grid = (-(-shape[0] // tile), -(-cols // tile))
    if fmt == "fp8":
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        args = (jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(rng.uniform(0.5, 2, grid).astype(np.float32)),
                None)
    else:
        args = (jnp.asarray(rng.integers(0, 256, (shape[0], cols // 2), dtype=np.uint8)),
                jnp.asarray(rng.integers(0x30, 0x50, grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)),
                jnp.float32(0.37))
    sizes = (np.arange(experts) + 1) % 2  # every other expert empty, the last among them when E is even
    kw = dict(fmt=fmt, shape=shape, tile=tile, out_dtype=jnp.bfloat16, impl="ref")
    full = tile_dequantize(*args, **kw)
    sel = tile_dequantize(*args, group_sizes=jnp.asarray(sizes, jnp.int32), **kw)
    _check_selected(sel, full, sizes, rows, assert_bits)


def test_ops_check_group_sizes():
    shape = (6, 64)
    p = nf4.quantize(jnp.ones(shape), block_size=64, double_quant=False)
    call = lambda g: nf4_dequantize(p["nf4_codes"], p["nf4_absmax"], nf4.NF4_CODE, shape=shape,  # noqa: E731
                                    block_size=64, group_sizes=g)
    with pytest.raises(ValueError, match="E dividing the 6 rows"):
        call(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="must have shape"):
        call(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(TypeError, match="integer array"):
        call(jnp.ones((3,), jnp.float32))
    codes = jnp.zeros(shape, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="E dividing the 6 rows"):
        tile_dequantize(codes, jnp.ones((1, 1), jnp.float32), fmt="fp8", shape=shape, tile=64,
                        group_sizes=jnp.ones((5,), jnp.int32))


def _grouped_case(spec, seed=3):
    """A frozen grouped GEMM with experts that get no rows: (params, x [N, in], sizes [E], dy [N, out], shape)."""
    E, out, inp = 6, 64, 128
    k = jax.random.split(jax.random.key(seed), 3)
    params = base.quantize(spec, jax.random.normal(k[0], (E * out, inp), jnp.float32) * 0.05)
    sizes = jnp.asarray([2, 0, 0, 3, 0, 1], jnp.int32)
    x = jax.random.normal(k[1], (7, inp), jnp.bfloat16)  # one row past the groups: no expert's, zero output
    dy = jax.random.normal(k[2], (7, out), jnp.bfloat16)
    return params, x, sizes, dy, (E, out, inp)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_frozen_grouped_same_forward_and_backward(spec, assert_bits):
    params, x, sizes, dy, shape = _grouped_case(spec)

    def run(selective):
        f = base.frozen_grouped(spec, params, shape=shape, dtype=jnp.bfloat16, selective=selective)
        y, vjp = jax.vjp(lambda x: f(x, sizes), x)
        return y, vjp(dy)[0]

    assert base.selective_applies(spec, x.shape, shape, jnp.bfloat16)  # CPU: reference GEMM and dequantization
    (y1, dx1), (y0, dx0) = jax.jit(lambda: run(True))(), jax.jit(lambda: run(False))()
    assert_bits(y1, y0, "y")
    assert_bits(dx1, dx0, "dx")


def test_falls_back_to_every_expert_where_the_reference_gemm_meets_the_kernel(monkeypatch):
    """The reference grouped GEMM (ragged_dot) may read every expert, so after the dequantization kernel (rows of
    empty experts unwritten) the selective path dequantizes them all; with the reference dequantization (zeros) or
    our GEMM kernel it passes the sizes."""
    spec = SPECS[0]
    params, x, sizes, _, shape = _grouped_case(spec)
    seen = []
    real = base.expert_weights
    monkeypatch.setattr(base, "expert_weights", lambda *a, group_sizes=None, **k: (
        seen.append(group_sizes is not None), real(*a, group_sizes=group_sizes, **k))[1])
    for gemm, deq, want in (("ref", "auto", False), ("ref", "ref", True), ("auto", "auto", True)):
        monkeypatch.setattr(base, "forward_impl", lambda *a, gemm=gemm: gemm)
        monkeypatch.setattr(base, "traced_impl", lambda *a, deq=deq: deq)
        assert base.selective_applies(spec, x.shape, shape, jnp.bfloat16) == want
        seen.clear()
        base.frozen_grouped_matmul(spec, x, params, sizes, shape=shape, dtype=jnp.bfloat16, selective=True)
        assert seen == [want], (gemm, deq)
    seen.clear()
    base.frozen_grouped_matmul(spec, x, params, sizes, shape=shape, dtype=jnp.bfloat16, selective=False)
    assert seen == [False]


def test_moe_decoder_same_logits_and_adapter_gradients(assert_bits):
    """A QLoRA (NF4) MoE decoder on 3 tokens (top-2 of 16 experts: at least 10 get none) gives the same logits and
    LoRA gradients with selective dequantization on and off."""
    spec = SPECS[1]
    cfg = DecoderConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=16,
                        num_experts_per_tok=2, moe_intermediate_size=64, dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16, attention_impl="xla", qlora=spec,
                        lora=LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "gate_proj", "up_proj", "down_proj")))
    ids = jnp.asarray([[5, 17, 40]], jnp.int32)
    v = Decoder(cfg).init({"params": jax.random.key(0), "lora": jax.random.key(1)}, ids)
    params = nn.meta.unbox(v["params"])
    lora = jax.tree.map(lambda a: a + 0.05, nn.meta.unbox(v["lora"]))  # non-zero B: gradients reach A

    def loss(lora, selective):
        logits = Decoder(cfg.replace(selective_expert_dequant=selective)).apply({"params": params, "lora": lora}, ids)
        return jnp.sum(logits.astype(jnp.float32) ** 2), logits

    (_, y1), g1 = jax.jit(jax.value_and_grad(lambda a: loss(a, True), has_aux=True))(lora)
    (_, y0), g0 = jax.jit(jax.value_and_grad(lambda a: loss(a, False), has_aux=True))(lora)
    assert_bits(y1, y0, "logits")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0), strict=True):
        assert_bits(a, b, jax.tree_util.keystr(path))
