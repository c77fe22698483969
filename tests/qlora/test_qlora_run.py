"""QLoRA end to end through `python -m surogate_jax.sft` on the builtin tiny model: each base format trains and
exports, resume is exact, and every refused combination is one error line that leaves output_dir untouched."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from qlora_checkpoints import FP8_CONFIG, fp8_parts, write_prequantized  # noqa: E402
from sft_cli import cli_env, losses, sft, write_config  # noqa: E402

from surogate_jax.builtin_models import resolve  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("key", ["qlora_bnb", "qlora_fp8", "qlora_fp4"])
def test_each_format_trains_and_exports(tmp_path, env, key):
    cfg = write_config(tmp_path, **{key: True}, merge_adapter=True, max_steps=8, save_steps=8, eval_steps=0)
    r = sft(cfg, env)
    out = tmp_path / "out"
    for f in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "merged/model.safetensors"):
        assert (out / f).exists(), f
    assert "qlora:" in r.stderr + r.stdout
    loss = losses(out)
    assert np.mean([loss[s] for s in (7, 8)]) < np.mean([loss[s] for s in (1, 2)]) - 0.05, loss


@pytest.mark.parametrize(("key", "recipe"), [("qlora_bnb", "fp8-hybrid"), ("qlora_fp4", "nvfp4")])
def test_quantized_base_under_a_quantizing_recipe_trains(tmp_path, env, key, recipe):
    cfg = write_config(tmp_path, **{key: True}, recipe=recipe, max_steps=8, save_steps=8, eval_steps=0)
    sft(cfg, env)
    loss = losses(tmp_path / "out")
    assert np.mean([loss[s] for s in (7, 8)]) < np.mean([loss[s] for s in (1, 2)]) - 0.05, loss
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_is_exact(tmp_path, env):
    cfg = write_config(tmp_path, qlora_bnb=True)
    sft(cfg, env)
    out = tmp_path / "out"
    first = losses(out)
    shutil.rmtree(out / "checkpoints" / "6")
    shutil.rmtree(out / "adapter")
    (out / "metrics.jsonl").write_text("")
    sft(cfg, env)
    again = losses(out)
    assert sorted(again) == [4, 5, 6] and all(again[s] == first[s] for s in (4, 5, 6)), (again, first)


def _prequantized_tiny(dst: Path, env, monkeypatch) -> Path:
    """The builtin tiny model as a fine-grained FP8 checkpoint (HF layout), tokenizer files copied."""
    monkeypatch.setenv("SUROGATE_JAX_CACHE", env["SUROGATE_JAX_CACHE"])
    return write_prequantized(resolve("builtin:tiny-qwen3"), dst, fp8_parts, FP8_CONFIG)


def test_prequantized_checkpoint_trains_in_its_own_format(tmp_path, env, monkeypatch):
    model = _prequantized_tiny(tmp_path / "fp8model", env, monkeypatch)
    r = sft(write_config(tmp_path, model=str(model), max_steps=2, save_steps=2, eval_steps=0,
                         merge_adapter=True), env)
    assert "FP8 E4M3 base" in r.stderr + r.stdout
    assert (tmp_path / "out" / "merged" / "model.safetensors").is_file()


@pytest.mark.parametrize(("over", "message"), [
    ({"qlora_bnb": True, "qlora_fp8": True}, "qlora_bnb and qlora_fp8: pick one"),
    ({"qlora_fp4": True, "lora": False}, "it needs lora: true"),
    ({"qlora_bnb": True, "qlora_bnb_block_size": 32}, "qlora_bnb_block_size=32"),
    ({"qlora_fp8": True, "qlora_block_size": 96}, "qlora_block_size=96"),
    ({"qlora_fp8": True, "recipe": "fp8-hybrid", "skip_quant_first_layers": 1}, "leave them at 0"),
    ({"qlora_bnb": True, "from_scratch": True}, "QLoRA needs a pretrained base"),
])
def test_refused_combinations_are_one_error_line(tmp_path, env, over, message):
    r = sft(write_config(tmp_path, **over), env, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("over", "message"), [
    ({"lora": False}, "set lora: true"),
    ({"qlora_bnb": True}, "remove qlora_bnb"),
])
def test_prequantized_checkpoint_refusals(tmp_path, env, over, message, monkeypatch):
    model = _prequantized_tiny(tmp_path / "fp8model", env, monkeypatch)
    r = sft(write_config(tmp_path, model=str(model), **over), env, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_zero3_on_four_devices_matches_one(tmp_path, env):
    """The quantized base shards like any frozen weight: ZeRO-3 on 4 CPU devices gives one device's losses."""
    runs = {}
    for name, n, extra in (("one", 1, ()), ("z3", 4, ("zero_level=3", "gpus=0", "per_device_train_batch_size=1"))):
        d = tmp_path / name
        d.mkdir()
        env_n = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        cfg = write_config(d, qlora_fp8=True, qlora_block_size=64, max_steps=3, save_steps=3, eval_steps=0)
        r = sft(cfg, env_n, *extra)
        if n == 4:
            assert "zero: optimizer,gradients,weights" in r.stderr and "4 device(s)" in r.stderr, r.stderr[-2000:]
        runs[name] = losses(d / "out")
    np.testing.assert_allclose([runs["z3"][s] for s in (1, 2, 3)], [runs["one"][s] for s in (1, 2, 3)], rtol=1e-4)


def test_offload_gives_the_plain_runs_losses(tmp_path, env):
    """Residual and optimizer offload over a quantized base: the same losses as without them."""
    runs = {}
    for name, over in (("plain", {}), ("offload", {"offload_residual": True, "zero_level": 3,
                                                   "offload_optimizer": True})):
        d = tmp_path / name
        d.mkdir()
        sft(write_config(d, qlora_bnb=True, max_steps=3, save_steps=3, eval_steps=0, **over), env)
        runs[name] = losses(d / "out")
    np.testing.assert_allclose([runs["offload"][s] for s in (1, 2, 3)], [runs["plain"][s] for s in (1, 2, 3)],
                               rtol=1e-5)


def test_an_fp8_base_below_sm89_is_refused_naming_the_gpu_and_what_works():
    """qlora_fp8 on an A100 (SM80): one message naming the GPU and the 4-bit formats; NF4 / NVFP4 bases pass."""
    import types

    from surogate_jax.precision.fp8 import Fp8UnsupportedError
    from surogate_jax.qlora.base import QloraSpec
    from surogate_jax.run import check_qlora_device

    a100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB", id=0)
    with pytest.raises(Fp8UnsupportedError, match=r"FP8 QLoRA base.*A100.*8\.0.*qlora_bnb \(NF4\) or qlora_fp4"):
        check_qlora_device(QloraSpec("fp8", 128), a100)
    check_qlora_device(QloraSpec("nf4"), a100)
    check_qlora_device(QloraSpec("fp4", 16), a100)
    check_qlora_device(None, a100)
    h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100", id=0)
    check_qlora_device(QloraSpec("fp8", 128), h100)
