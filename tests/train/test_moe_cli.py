"""A Qwen3-MoE checkpoint through `python -m surogate_jax.sft`: full fine-tuning, LoRA (on attention and every
expert) and QLoRA (experts quantized while loading, or as an FP8 / NF4 checkpoint stores them) train, the loss falls
and metrics.jsonl carries the router metrics; the exports load (the full model in transformers, the adapter with one
tensor pair per expert, the merged model); dense layers among the MoE ones; expert parallelism against ep_size 1 on
4 CPU devices; recipes, bad ep_size values, negative or misplaced router loss weights are refused
with one error line before output_dir is touched."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from sft_cli import cli_env, losses, sft, write_config

from surogate_jax import builtin_models

sys.path.insert(0, str(Path(__file__).parents[1] / "qlora"))
from qlora_checkpoints import FP8_CONFIG, fp8_parts, write_prequantized  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cli_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, env):
    """A random Qwen3-MoE (5 experts, top 2) with builtin:tiny-qwen3's tokenizer."""
    return _tiny_moe(tmp_path_factory.mktemp("tiny_moe"), env, num_hidden_layers=2)


@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory, env):
    """Layers 0 and 2 dense, 1 and 3 MoE of 8 experts (top 3): ep_size 2 and 4 divide the experts."""
    return _tiny_moe(tmp_path_factory.mktemp("tiny_ep"), env, num_hidden_layers=4, decoder_sparse_step=2,
                     num_experts=8, num_experts_per_tok=3)


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory, env):
    """32 experts, top 2: a row of 8 tokens reaches at most 16 of them, so every MoE layer has experts without rows."""
    return _tiny_moe(tmp_path_factory.mktemp("tiny_sparse"), env, num_hidden_layers=2, num_experts=32)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory, env):
    """Like moe_dir with dense layers among the sparse ones: layers 0 and 2 dense, 1 and 3 MoE."""
    return _tiny_moe(tmp_path_factory.mktemp("tiny_mixed"), env, num_hidden_layers=4, decoder_sparse_step=2)


def _tiny_moe(d, env, **layout):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUROGATE_JAX_CACHE", env["SUROGATE_JAX_CACHE"])
        tiny = builtin_models.resolve("builtin:tiny-qwen3")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    cfg = transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False), **layout})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, d / f.name)
    return d


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_moe_full_fine_tuning_trains_and_exports(tmp_path, env, moe_dir):
    cfg = write_config(tmp_path, model=str(moe_dir), lora=False, max_steps=8, save_steps=8, eval_steps=0,
                       learning_rate=3e-3, router_z_loss_coef=0.001)
    r = sft(cfg, env)
    assert "model: qwen3_moe" in r.stderr and "(full)" in r.stderr
    loss = losses(tmp_path / "out")
    assert max(loss) == 8 and loss[8] < loss[1]
    rows = [x for x in _records(tmp_path / "out") if "loss" in x]
    for x in rows:  # top-2 of 5 experts: balanced routing gives aux 2, all on two experts 5
        assert 1.0 <= x["aux_loss"] <= 5.0 and x["router_z_loss"] > 0 and 1.0 <= x["expert_load"] <= 2.5
    exported = tmp_path / "out" / "model"
    hf = json.loads((exported / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["router_aux_loss_coef"] == 0.001  # the model's, kept
    transformers.AutoModelForCausalLM.from_pretrained(exported)


def test_moe_lora_adapts_attention_and_every_expert(tmp_path, env, moe_dir):
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = write_config(tmp_path, model=str(moe_dir), max_steps=8, save_steps=8, eval_steps=0, learning_rate=3e-3,
                       merge_adapter=True, router_aux_loss_coef=0.01)
    r = sft(cfg, env)
    assert "model: qwen3_moe" in r.stderr
    loss = losses(tmp_path / "out")
    assert loss[8] < loss[1]
    assert all("aux_loss" in x for x in _records(tmp_path / "out") if "loss" in x)
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    stem = "base_model.model.model.layers.1.mlp.experts.4"
    assert adapter[f"{stem}.gate_proj.lora_A.weight"].shape == (8, 64)  # [r, hidden]
    assert adapter[f"{stem}.gate_proj.lora_B.weight"].shape == (64, 8)  # [moe_intermediate, r]
    assert adapter[f"{stem}.down_proj.lora_A.weight"].shape == (8, 64)
    assert adapter[f"{stem}.down_proj.lora_B.weight"].shape == (64, 8)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter
    assert not any(".mlp.gate." in n for n in adapter)  # the router stays frozen
    assert len(adapter) == 2 * 2 * (4 + 3 * 5)  # A and B, 2 layers, 4 attention + 3 x 5 expert projections
    # every expert's B moved off zero: each got tokens and gradients
    assert all(np.abs(adapter[f"base_model.model.model.layers.{i}.mlp.experts.{e}.up_proj.lora_B.weight"]).max() > 0
               for i in range(2) for e in range(5))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    assert merged.config.model_type == "qwen3_moe"


def test_train_router_trains_the_router_and_exports_it(tmp_path, env, moe_dir):
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = write_config(tmp_path, model=str(moe_dir), max_steps=4, save_steps=4, eval_steps=0, learning_rate=3e-3,
                       train_router=True, merge_adapter=True)
    sft(cfg, env)
    out = tmp_path / "out"
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["gate"]  # PEFT's layout for a whole trained module
    base = {}
    for f in moe_dir.glob("*.safetensors"):
        base.update(load_file(f))
    merged = {}
    for f in (out / "merged").glob("*.safetensors"):
        merged.update(load_file(f))
    for i in range(2):
        name = f"model.layers.{i}.mlp.gate.weight"
        trained = adapter[f"base_model.model.{name}"]
        assert trained.shape == (5, 64) and np.abs(trained - base[name].astype(np.float32)).max() > 1e-4
        np.testing.assert_allclose(merged[name].astype(np.float32), trained, rtol=1e-2, atol=1e-4)  # bf16 rounding


def test_moe_qlora_trains_over_quantized_experts(tmp_path, env, moe_dir):
    cfg = write_config(tmp_path, model=str(moe_dir), max_steps=6, save_steps=6, eval_steps=0, learning_rate=3e-3,
                       qlora_bnb=True, qlora_bnb_block_size=64, train_router=True, merge_adapter=True)
    r = sft(cfg, env)
    assert "qlora: NF4 base" in r.stderr and "experts/gate_proj" in r.stderr  # the experts quantized while loading
    loss = losses(tmp_path / "out")
    assert loss[6] < loss[1]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")  # the bf16 base re-read, merged


@pytest.mark.parametrize("mode", ["lora", "qlora", "full"])
def test_fp8_hybrid_runs_the_expert_gemms_in_fp8(tmp_path, env, mixed_dir, mode):
    """recipe fp8-hybrid on an MoE model (dense layers among the sparse ones): LoRA over the experts cached in E4M3,
    QLoRA with the NF4 experts going to E4M3 per layer, full fine-tuning quantizing the trained experts per call. The
    losses follow the bf16 run's within FP8's error and are not the bf16 losses (the experts' GEMMs did change)."""
    over = {"lora": {}, "qlora": {"qlora_bnb": True}, "full": {"lora": False}}[mode]
    runs = {}
    for recipe in ("bf16", "fp8-hybrid"):
        d = tmp_path / recipe
        d.mkdir()
        cfg = write_config(d, model=str(mixed_dir), max_steps=4, save_steps=4, eval_steps=0, learning_rate=3e-3,
                           recipe=recipe, **over)
        r = sft(cfg, env)
        assert ("precision: fp8-hybrid" in r.stderr) == (recipe == "fp8-hybrid"), r.stderr[-2000:]
        runs[recipe] = losses(d / "out")
    bf16, fp8 = (np.array([runs[r][s] for s in range(1, 5)]) for r in ("bf16", "fp8-hybrid"))
    np.testing.assert_allclose(fp8, bf16, rtol=0.05)
    assert np.abs(fp8 - bf16).max() > 1e-5, (fp8, bf16)
    assert fp8[-1] < fp8[0]


def test_offloaded_experts_train_the_same_losses(tmp_path, env, mixed_dir):
    """qlora_offload_experts: the quantized experts live in pinned host memory and each MoE layer copies its own in
    (forward and the backward's recomputation): the same losses as keeping them on the device, also across a resume,
    the layers in a loop with full recomputation (what `recompute: auto` is left to pick), and the layout says where
    the experts are."""
    runs = {}
    for off in (False, True):
        d = tmp_path / str(off)
        d.mkdir()
        # offloaded: 2 steps, then resumed to 4 (the experts placed in host memory again at the restore)
        for steps in (2, 4) if off else (4,):
            cfg = write_config(d, model=str(mixed_dir), max_steps=steps, save_steps=2, eval_steps=2,
                               learning_rate=3e-3, qlora_bnb=True, qlora_offload_experts=off)
            r = sft(cfg, env)
            assert ("offload to pinned_host: experts" in r.stderr) == off, r.stderr[-2000:]
            assert ("resumed from" in r.stderr) == (off and steps == 4), r.stderr[-2000:]
            if off:
                assert "recompute auto: loop full" in r.stderr, r.stderr[-2000:]
        runs[off] = losses(d / "out")
        assert (d / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(runs[True]) == [1, 2, 3, 4]
    np.testing.assert_allclose([runs[True][s] for s in sorted(runs[True])],
                               [runs[False][s] for s in sorted(runs[False])], rtol=1e-6)


@pytest.mark.parametrize(("over", "message"), [
    ({}, "the base is not quantized"),
    ({"qlora_bnb": True, "recompute": False}, "recompute: true or auto, got recompute: False"),
    ({"qlora_bnb": True, "unroll_layers": True}, "the layers must run in a loop"),
])
def test_offloaded_experts_refused_where_they_cannot_stream(tmp_path, env, moe_dir, over, message):
    cfg = write_config(tmp_path, model=str(moe_dir), qlora_offload_experts=True, **over)
    r = sft(cfg, env, check=False)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def _short_rows(tmp_path, **over) -> dict:
    """Rows of 8 text tokens, one a micro-batch: top-2 routing reaches at most 16 experts a layer."""
    text = tmp_path / "words.txt"
    words = np.random.default_rng(0).choice(["red", "green", "blue", "one", "two", "three", "cat", "dog"], (200, 12))
    text.write_text("\n".join(" ".join(w) for w in words) + "\n")
    return dict(datasets=[{"path": str(text), "type": "text"}], validation_split_ratio=0.0, sequence_len=8,
                per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3, save_steps=3,
                eval_steps=0, learning_rate=3e-3, qlora_bnb=True, **over)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-hybrid"])
def test_selective_expert_dequant_trains_the_same_losses(tmp_path, env, sparse_dir, recipe):
    """qlora_selective_expert_dequant: each MoE layer dequantizes only the experts that got tokens (here at most 16
    of 32), forward and backward (under fp8-hybrid straight to E4M3): the same losses as dequantizing all of them."""
    runs = {}
    for on in (False, True):
        d = tmp_path / str(on)
        d.mkdir()
        over = _short_rows(d, qlora_selective_expert_dequant=on, recipe=recipe)
        r = sft(write_config(d, model=str(sparse_dir), **over), env)
        assert ("dequantizes only the experts that got tokens" in r.stderr) == on, r.stderr[-2000:]
        runs[on] = losses(d / "out")
        assert sorted(runs[on]) == [1, 2, 3], r.stderr[-2000:]
    np.testing.assert_allclose([runs[True][s] for s in (1, 2, 3)], [runs[False][s] for s in (1, 2, 3)], rtol=1e-6)


def test_selective_expert_dequant_with_expert_parallelism_and_offloaded_experts(tmp_path, env, sparse_dir):
    """4 CPU devices, ep_size 2 (each device its 16 experts and their token counts) with the experts in host memory:
    the same losses as ep_size 1 dequantizing every expert."""
    four = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    runs = {}
    for ep, on in ((1, False), (2, True)):
        d = tmp_path / f"ep{ep}"
        d.mkdir()
        over = _short_rows(d, qlora_bnb_double_quant=False, gpus=0, ep_size=ep, qlora_selective_expert_dequant=on,
                           qlora_offload_experts=on)
        r = sft(write_config(d, model=str(sparse_dir), **over), four)
        assert ("expert parallel: 2 group(s) of 2" in r.stderr) == on, r.stderr[-2000:]
        runs[ep] = losses(d / "out")
        assert sorted(runs[ep]) == [1, 2, 3], r.stderr[-2000:]
    np.testing.assert_allclose([runs[2][s] for s in (1, 2, 3)], [runs[1][s] for s in (1, 2, 3)], rtol=2e-5)


@pytest.mark.parametrize(("dense", "over", "message"), [
    (True, {"qlora_bnb": True}, "model=builtin:tiny-qwen3 is dense"),
    (False, {}, "the base is not quantized"),
])
def test_selective_expert_dequant_refused_without_quantized_experts(tmp_path, env, moe_dir, dense, over, message):
    cfg = write_config(tmp_path, **({} if dense else {"model": str(moe_dir)}), qlora_selective_expert_dequant=True,
                       **over)
    r = sft(cfg, env, check=False)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert "qlora_selective_expert_dequant:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["fp8", "nf4"])
def test_prequantized_checkpoint_trains_lora_over_its_experts(tmp_path, env, moe_dir, fmt):
    """A pre-quantized MoE checkpoint (fine-grained FP8 with 64-wide tiles, or bitsandbytes NF4 with double
    quantization; one set of parts per expert) trains LoRA over its experts as they are stored and merges into a
    model transformers loads."""
    from surogate_jax.qlora import nf4  # noqa: PLC0415

    if fmt == "fp8":
        q = write_prequantized(moe_dir, tmp_path / fmt, lambda w: fp8_parts(w, 64),
                               {**FP8_CONFIG, "weight_block_size": [64, 64]})
    else:
        q = write_prequantized(moe_dir, tmp_path / fmt, lambda w: nf4.quantize_nf4(w, block_size=64),
                               {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})
    cfg = write_config(tmp_path, model=str(q), max_steps=6, save_steps=6, eval_steps=0, learning_rate=3e-3,
                       merge_adapter=True)
    r = sft(cfg, env)
    want = {"fp8": "qlora: FP8", "nf4": "qlora: NF4 base, blocks of 64, double quantization on (off for the experts)"}
    want = want[fmt]
    assert want in r.stderr and "in the checkpoint" in r.stderr, r.stderr[-2000:]
    loss = losses(tmp_path / "out")
    assert loss[6] < loss[1]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")


def test_dense_and_moe_layers_train_under_qlora_with_a_trained_router(tmp_path, env, mixed_dir):
    """The dense layers' MLP and the experts quantized, LoRA (with dropout) on both, the two MoE layers' routers
    trained: the adapter
    holds a router for the MoE layers only, under HF's layer numbers, and the merged model loads in transformers."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = write_config(tmp_path, model=str(mixed_dir), max_steps=6, save_steps=6, eval_steps=0, learning_rate=3e-3,
                       qlora_bnb=True, qlora_bnb_block_size=64, train_router=True, merge_adapter=True,
                       lora_dropout=0.1)
    sft(cfg, env)
    loss = losses(tmp_path / "out")
    assert loss[6] < loss[1]
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    routers = sorted(n for n in adapter if n.endswith("mlp.gate.weight"))
    assert routers == [f"base_model.model.model.layers.{i}.mlp.gate.weight" for i in (1, 3)]
    assert "base_model.model.model.layers.2.mlp.up_proj.lora_A.weight" in adapter
    assert "base_model.model.model.layers.3.mlp.experts.4.up_proj.lora_A.weight" in adapter
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")


def test_dense_and_moe_layers_full_fine_tuning_with_normuon(tmp_path, env, mixed_dir):
    cfg = write_config(tmp_path, model=str(mixed_dir), lora=False, max_steps=6, save_steps=6, eval_steps=0,
                       learning_rate=3e-3, optimizer="normuon")
    sft(cfg, env)
    loss = losses(tmp_path / "out")
    assert loss[6] < loss[1]
    rows = [x for x in _records(tmp_path / "out") if "loss" in x]
    assert all(1.0 <= x["aux_loss"] <= 5.0 for x in rows)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert back.config.decoder_sparse_step == 2


def test_expert_parallel_needs_experts_it_divides_and_no_qlora(tmp_path, env, moe_dir, ep_dir):
    """2 CPU devices: ep_size 2 divides them but not moe_dir's 5 experts; over an NF4 base with double quantization
    the second-level blocks (256 absmax each) straddle ep_dir's experts (64 blocks each), which cannot be split."""
    two = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for model, over, message in ((moe_dir, {}, "ep_size=2: must divide the 5 experts"),
                                 (ep_dir, {"qlora_bnb": True}, "its blocks straddle two of")):
        cfg = write_config(tmp_path, model=str(model), gpus=0, ep_size=2, **over)
        r = sft(cfg, two, check=False)
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("error:") == 1, r.stderr[-2000:]
        assert not (tmp_path / "out").exists()


def test_expert_parallel_losses_equal_ep_size_1_on_four_devices(tmp_path, env, ep_dir):
    """4 CPU devices: ep_size 2 (2 data x 2 expert) and 4 train the same losses as plain data parallelism, for LoRA
    on attention and every expert (and a trained router), for full fine-tuning and for LoRA over NF4 experts (also
    with the experts offloaded to host memory); the experts' tensors are split over the expert axis (each device
    holds E / ep of them)."""
    four = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    runs = {}
    qlora = dict(qlora_bnb=True, qlora_bnb_double_quant=False)
    for name, over in {"lora": dict(train_router=True), "full": dict(lora=False), "qlora": qlora,
                       "qlora offloaded": dict(qlora, qlora_offload_experts=True)}.items():
        for ep in {"lora": (1, 2, 4), "qlora offloaded": (2,)}.get(name, (1, 2)):
            d = tmp_path / f"{name}{ep}"
            d.mkdir()
            cfg = write_config(d, model=str(ep_dir), max_steps=4, save_steps=4, eval_steps=0, learning_rate=3e-3,
                               gpus=0, ep_size=ep, per_device_train_batch_size=1, **over)
            r = sft(cfg, four)
            assert (f"expert parallel: {4 // ep} group(s) of {ep}" in r.stderr) == (ep > 1), r.stderr[-2000:]
            runs[name, ep] = losses(d / "out")
            assert max(runs[name, ep]) == 4, r.stderr[-2000:]
    for (name, ep), got in runs.items():
        want = runs[name.split()[0], 1]  # offloaded experts: against the same base kept on the device
        np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=2e-5,
                                   err_msg=f"{name} ep_size={ep}")


def test_fp8_hybrid_under_expert_parallelism_follows_ep_size_1(tmp_path, env, ep_dir):
    """fp8-hybrid with ep_size 2 on 4 CPU devices: each device holds its experts' E4M3 cache (LoRA) or quantizes its
    own trained experts (full fine-tuning) and trains the losses of ep_size 1 within the activations' scales (a
    device quantizes its group's gathered tokens with one scale, ep_size 1 its own shard's)."""
    four = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    for name, over in {"lora": {}, "full": dict(lora=False)}.items():
        runs = {}
        for ep in (1, 2):
            d = tmp_path / f"{name}{ep}"
            d.mkdir()
            cfg = write_config(d, model=str(ep_dir), max_steps=3, save_steps=3, eval_steps=0, learning_rate=3e-3,
                               gpus=0, ep_size=ep, per_device_train_batch_size=1, recipe="fp8-hybrid", **over)
            r = sft(cfg, four)
            assert "precision: fp8-hybrid" in r.stderr, r.stderr[-2000:]
            runs[ep] = losses(d / "out")
        np.testing.assert_allclose([runs[2][s] for s in (1, 2, 3)], [runs[1][s] for s in (1, 2, 3)], rtol=1e-2,
                                   err_msg=name)


def test_expert_parallel_run_resumes_exactly_and_under_another_ep_size(tmp_path, env, ep_dir):
    """4 CPU devices, ep_size 2: a run resumed from its step-2 checkpoint continues bit for bit; resumed under
    ep_size 1 instead (the experts' shards gathered back by the restore) it continues with the same losses."""
    four = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    cfg = write_config(tmp_path, model=str(ep_dir), max_steps=4, save_steps=2, eval_steps=0, learning_rate=3e-3,
                       gpus=0, ep_size=2, per_device_train_batch_size=1, train_router=True)
    sft(cfg, four)
    out = tmp_path / "out"
    first = losses(out)
    for ep in (2, 1):
        shutil.rmtree(out / "checkpoints" / "4")
        for d in ("adapter", "model"):
            shutil.rmtree(out / d, ignore_errors=True)
        (out / "metrics.jsonl").write_text("")
        sft(cfg, four, f"ep_size={ep}")
        again = losses(out)
        assert sorted(again) == [3, 4]
        if ep == 2:
            assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]
        else:
            np.testing.assert_allclose([again[s] for s in (3, 4)], [first[s] for s in (3, 4)], rtol=2e-5)


@pytest.mark.parametrize(("over", "message"), [
    ({"recipe": "nvfp4"}, "recipe nvfp4 on a mixture-of-experts model: only fp8-hybrid"),
    ({"recipe": "fp8-hybrid", "skip_quant_first_layers": 1}, "skip_quant_first_layers / skip_quant_last_layers on a "
                                                             "mixture-of-experts model"),
    ({"matmul_dtype": "bf16"}, "matmul_dtype / gradient_dtype on a mixture-of-experts model"),
    ({"router_aux_loss_coef": -0.5}, "router_aux_loss_coef=-0.5: must be a number >= 0"),
    ({"router_z_loss_coef": -1}, "router_z_loss_coef=-1.0: must be a number >= 0"),
    ({"ep_size": 2}, "ep_size=2: must divide the run's 1 device(s)"),
    ({"ep_size": 5, "gpus": 0}, "ep_size=5: must divide the run's 1 device(s)"),
    ({"ep_size": 0}, "ep_size=0: must be an integer >= 1"),
    ({"ep_size": 1.5}, "ep_size: expected int, got 1.5"),
    ({"ep_size": 2, "offload_optimizer": True}, "ep_size=2 with offload_optimizer"),
])
def test_moe_bad_input_is_refused_before_any_work(tmp_path, env, moe_dir, over, message):
    cfg = write_config(tmp_path, model=str(moe_dir), **over)
    r = sft(cfg, env, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_an_moe_variant_we_do_not_compute_is_refused_before_any_work(tmp_path, env, moe_dir):
    """Shared experts (Qwen2-MoE's shared_expert_intermediate_size) in a Qwen3-MoE config.json: one error line, exit
    code 2, no output_dir."""
    d = tmp_path / "shared"
    shutil.copytree(moe_dir, d)
    cfg_json = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg_json, "shared_expert_intermediate_size": 128}))
    r = sft(write_config(tmp_path, model=str(d)), env, check=False)
    assert r.returncode == 2 and "shared experts are not implemented" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("over", "message"), [
    ({"router_z_loss_coef": 0.01}, "router_z_loss_coef: applies to mixture-of-experts models"),
    ({"train_router": True}, "train_router: applies to mixture-of-experts models"),
    ({"train_router": True, "lora": False}, "train_router: unfreezes an MoE router under LoRA"),
    ({"ep_size": 2, "gpus": 0}, "ep_size=2: applies to mixture-of-experts models"),
])
def test_moe_keys_on_a_dense_model_or_without_lora_are_refused(tmp_path, env, over, message):
    cfg = write_config(tmp_path, **over)
    r = sft(cfg, env if "ep_size" not in over else {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
            check=False)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()
