"""Bad model directories raise ModelLoadError (or its UnsupportedConfigError) saying what and where."""

from __future__ import annotations

import json
import os

import pytest
from hf_tiny import build_hf

import surogate_jax
from surogate_jax import ModelLoadError, UnsupportedConfigError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    build_hf("qwen3_qknorm_head_dim").save_pretrained(d)
    return d


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        surogate_jax.load_pretrained(tmp_path / "nope")


def test_file_is_not_a_model_dir(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("hi")
    with pytest.raises(ModelLoadError, match="not a model directory"):
        surogate_jax.load_pretrained(f)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        surogate_jax.load_pretrained(tmp_path)


def test_config_not_json(saved, tmp_path):
    d = _copy(saved, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        surogate_jax.load_pretrained(d)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6)), "rope_parameters.rope_type"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_scaling.rope_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_config_names_the_field(saved, tmp_path, changes, field):
    d = _copy(saved, tmp_path / "m")
    _edit_config(d, **changes)
    with pytest.raises(UnsupportedConfigError, match=field):
        surogate_jax.load_pretrained(d)


def test_truncated_weights(saved, tmp_path):
    d = _copy(saved, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        surogate_jax.load_pretrained(d)


def test_corrupt_header(saved, tmp_path):
    d = _copy(saved, tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        surogate_jax.load_pretrained(d)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"42"])
def test_header_that_is_not_an_object(saved, tmp_path, header):
    d = _copy(saved, tmp_path / "m")
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ModelLoadError, match="not an object"):
        surogate_jax.load_pretrained(d)


@pytest.mark.parametrize("index", ['{"weight_map": ["a"]}', "[]", '{"weight_map": 3}'])
def test_index_of_the_wrong_shape(saved, tmp_path, index):
    d = _copy(saved, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match="corrupt index file"):
        surogate_jax.load_pretrained(d)


def test_missing_shard(tmp_path):
    d = tmp_path / "m"
    build_hf("llama3_tied").save_pretrained(d, max_shard_size="40KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    os.remove(shards[-1])
    with pytest.raises(ModelLoadError, match="missing shard"):
        surogate_jax.load_pretrained(d)


def test_missing_tensor(saved, tmp_path):
    """An untied config whose file lacks lm_head.weight."""
    d = _copy(saved, tmp_path / "m")
    from surogate_jax.safetensors_io import CheckpointReader, write_file

    r = CheckpointReader(d)
    keep = [n for n in r.names() if n != "lm_head.weight"]
    arrays = [r.get(n).copy() for n in keep]
    os.remove(d / "model.safetensors")
    write_file(d / "model.safetensors", [(n, a.dtype, a.shape) for n, a in zip(keep, arrays)], arrays)
    with pytest.raises(ModelLoadError, match="'lm_head.weight' is missing"):
        surogate_jax.load_pretrained(d)


def test_shape_mismatch(saved, tmp_path):
    d = _copy(saved, tmp_path / "m")
    _edit_config(d, intermediate_size=100)
    with pytest.raises(ModelLoadError, match="has shape"):
        surogate_jax.load_pretrained(d)


def test_pytorch_bin_only(saved, tmp_path):
    d = _copy(saved, tmp_path / "m")
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"pickled torch weights")
    with pytest.raises(ModelLoadError, match="convert to safetensors"):
        surogate_jax.load_pretrained(d)


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="downloading it from the Hugging Face hub failed"):
        surogate_jax.load_pretrained("surogate-test-org/does-not-exist-xyz")


def test_kernels_option_is_validated():
    import pytest as _pytest

    from surogate_jax.models import DecoderConfig
    from surogate_jax.models.llamalike import MODEL_KERNELS

    base = dict(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=8)
    cfg = DecoderConfig(**base, kernels=("swiglu",))
    assert cfg.impl("swiglu") is None and cfg.impl("rope") == "ref"
    default = DecoderConfig(**base)  # the measured default: norms, rope, swiglu_lora on; plain swiglu on XLA's fusion
    assert default.impl("rms_norm") is None and default.impl("rope") is None
    assert default.impl("add_rms_norm") is None and default.impl("swiglu") == "ref"
    assert default.impl("swiglu_lora") is None
    assert DecoderConfig(**base, kernels=()).impl("rms_norm") == "ref"
    assert set(MODEL_KERNELS) == {"rope", "rms_norm", "add_rms_norm", "swiglu", "swiglu_lora"}
    with _pytest.raises(ValueError, match="kernels"):
        DecoderConfig(**base, kernels=("flash",))
