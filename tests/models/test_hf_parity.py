"""Our Flax decoder vs transformers' PyTorch models, fp32, on tiny random configs of every family."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import transformers
from hf_tiny import build_hf, hf_logits, rel_err

import surogate_jax
from surogate_jax.models import Decoder
from surogate_jax.models.llamalike import rope_inv_freq

TOL = 1e-4  # the bar: max |ours - HF| / max |HF| in fp32


def _ids(rng, b, t, vocab=101):
    return rng.integers(0, vocab, size=(b, t), dtype=np.int32)


def test_logits_match_transformers(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, params = surogate_jax.load_pretrained(tmp_path, dtype=jnp.float32)
    assert isinstance(model, Decoder)
    ids = _ids(np.random.default_rng(1), 2, 13)
    ours = model.apply({"params": params}, jnp.asarray(ids))
    assert ours.shape == (2, 13, 101) and ours.dtype == jnp.float32
    assert rel_err(ours, hf_logits(hf, ids)) < TOL


def test_explicit_positions_match_transformers(case, tmp_path):
    """Positions beyond original_max_position_embeddings exercise the llama3 scaled frequencies."""
    hf = build_hf(case, seed=3)
    hf.save_pretrained(tmp_path)
    model, params = surogate_jax.load_pretrained(tmp_path)
    rng = np.random.default_rng(2)
    ids = _ids(rng, 2, 9)
    pos = np.sort(rng.integers(0, 200, size=(2, 9)), axis=1).astype(np.int32)
    ours = model.apply({"params": params}, jnp.asarray(ids), positions=jnp.asarray(pos))
    assert rel_err(ours, hf_logits(hf, ids, pos)) < TOL


def test_rope_inverse_frequencies_match_transformers(case, tmp_path):
    hf = build_hf(case)
    hf.save_pretrained(tmp_path)
    model, _ = surogate_jax.load_pretrained(tmp_path)
    ref = hf.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(rope_inv_freq(model.config), ref, rtol=1e-6)


def test_sharded_checkpoint_loads(tmp_path):
    hf = build_hf("qwen3_qknorm_head_dim")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, params = surogate_jax.load_pretrained(str(tmp_path))
    ids = _ids(np.random.default_rng(4), 1, 7)
    assert rel_err(model.apply({"params": params}, jnp.asarray(ids)), hf_logits(hf, ids)) < TOL


def test_bf16_load_is_close(tmp_path):
    hf = build_hf("llama3_untied_scaled_rope")
    hf.save_pretrained(tmp_path)
    model, params = surogate_jax.load_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert all(p.dtype == jnp.bfloat16 for p in __import__("jax").tree.leaves(params))
    ids = _ids(np.random.default_rng(5), 2, 11)
    ours = model.apply({"params": params}, jnp.asarray(ids))
    assert ours.dtype == jnp.bfloat16
    assert rel_err(ours.astype(jnp.float32), hf_logits(hf, ids)) < 5e-2  # bf16 weights + activations


def test_save_pretrained_roundtrip_through_transformers(case, tmp_path):
    hf = build_hf(case, seed=7)
    hf.save_pretrained(tmp_path / "src")
    model, params = surogate_jax.load_pretrained(tmp_path / "src")
    out = surogate_jax.save_pretrained(tmp_path / "out", model, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ids = _ids(np.random.default_rng(6), 2, 10)
    ref = hf_logits(hf, ids)
    assert rel_err(hf_logits(back, ids), ref) < 1e-6  # same fp32 weights, same torch code
    again, params2 = surogate_jax.load_pretrained(out)
    assert again.config == model.config
    assert rel_err(again.apply({"params": params2}, jnp.asarray(ids)), ref) < TOL


def test_save_pretrained_sharded_bf16(tmp_path):
    hf = build_hf("qwen2_bias_tied")
    hf.save_pretrained(tmp_path / "src")
    model, params = surogate_jax.load_pretrained(tmp_path / "src")
    out = surogate_jax.save_pretrained(tmp_path / "out", model, params, dtype=jnp.bfloat16, max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype.__str__() == "torch.bfloat16"
    ids = _ids(np.random.default_rng(8), 1, 6)
    assert rel_err(hf_logits(back.float(), ids), hf_logits(hf, ids)) < 5e-2


def test_save_refuses_to_overwrite(tmp_path):
    hf = build_hf("qwen3_tied")
    hf.save_pretrained(tmp_path / "src")
    model, params = surogate_jax.load_pretrained(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    import pytest

    with pytest.raises(FileExistsError):
        surogate_jax.save_pretrained(tmp_path / "out", model, params)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
