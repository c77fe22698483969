"""Precision keys (seed 002 "Precision & Recipes"): parsed into PrecisionConfig, validated against
the mixed-precision tables, and turned into the model's QuantRecipe; fp8 on an old GPU says which
GPU and which recipe works there."""

from __future__ import annotations

import pytest

from surogate_jax.config import ConfigError, config_from_dict
from surogate_jax.precision import fp8
from surogate_jax.precision.recipe import QuantRecipe, check_device

BASE = {"model": "m", "datasets": [{"path": "d.jsonl"}]}


def cfg(**kw):
    return config_from_dict({**BASE, **kw})


def test_defaults_and_keys():
    p = cfg().precision
    assert (p.recipe, p.fp8_amax_history, p.skip_quant_first_layers, p.skip_quant_last_layers) == ("bf16", 1024, 0, 0)
    assert (p.fp4_backend, p.fp4_four_over_six, p.no_fp4_stochastic_rounding) == ("cutlass", True, False)
    assert p.matmul_dtype is None and p.gradient_dtype is None
    assert QuantRecipe.from_config(p) is None  # plain bf16: the model is unchanged
    p = cfg(recipe="fp8_hybrid", fp8_amax_history=16, skip_quant_first_layers=1, skip_quant_last_layers=2).precision
    assert p.recipe == "fp8-hybrid"  # the alias is normalized
    r = QuantRecipe.from_config(p)
    assert (r.name, r.amax_history, r.skip_first, r.skip_last, r.has_state, r.skips) == (
        "fp8-hybrid", 16, 1, 2, True, True)
    r = QuantRecipe.from_config(cfg(recipe="nvfp4", no_fp4_stochastic_rounding=True, fp4_four_over_six=False,
                                    fp4_backend="cudnn").precision)
    assert (r.name, r.fp4_stochastic, r.fp4_four_over_six, r.fp4_backend, r.has_state) == (
        "nvfp4", False, False, "cudnn", False)
    assert cfg(recipe="fp8-hybrid", matmul_dtype="e4m3", gradient_dtype="e5m2").precision.recipe == "fp8-hybrid"
    # bf16 recipe: matmul/gradient dtypes equal to the model dtype are no-ops; others give a mixed GEMM
    assert QuantRecipe.from_config(cfg(matmul_dtype="bf16", gradient_dtype="bf16").precision) is None
    r = QuantRecipe.from_config(cfg(matmul_dtype="fp32").precision)
    assert (r.name, r.matmul_dtype, r.gradient_dtype, r.quantizes) == ("bf16", "fp32", None, False)
    r = QuantRecipe.from_config(cfg(gradient_dtype="fp32").precision)
    assert (r.matmul_dtype, r.gradient_dtype) == (None, "fp32")


@pytest.mark.parametrize("raw,message", [
    ({"recipe": "fp8"}, "recipe='fp8': use bf16, fp8-hybrid (alias fp8_hybrid) or nvfp4"),
    ({"recipe": "fp8-hybrid", "matmul_dtype": "bf16"},
     "recipe fp8-hybrid forces its GEMM formats (e4m3 forward, e5m2 backward)"),
    ({"recipe": "fp8-hybrid", "gradient_dtype": "fp32"}, "leave them unset (or e4m3 / e5m2)"),
    ({"recipe": "nvfp4", "matmul_dtype": "e4m3"}, "recipe nvfp4 forces its GEMM formats (e2m1 forward, e2m1 backward)"),
    ({"matmul_dtype": "e4m3"},
     "the only FP8 dispatches (e4m3 x e4m3 forward, e4m3 x e5m2 backward) are the fp8-hybrid recipe"),
    ({"gradient_dtype": "e5m2"}, "set recipe: fp8-hybrid"),
    ({"matmul_dtype": "e5m2"}, "matmul_dtype='e5m2': use one of ('fp32', 'bf16', 'e4m3')"),
    ({"gradient_dtype": "e4m3"}, "gradient_dtype='e4m3': use one of ('fp32', 'bf16', 'e5m2')"),
    ({"fp8_amax_history": 0}, "fp8_amax_history=0: must be >= 1"),
    ({"skip_quant_last_layers": -1}, "skip_quant_last_layers=-1: must be >= 0"),
    ({"fp4_backend": "triton"}, "fp4_backend='triton': use cutlass or cudnn"),
    ({"fp4_four_over_six": "yes"}, "fp4_four_over_six: expected bool"),
])
def test_invalid_combinations_name_what_is_allowed(raw, message):
    with pytest.raises(ConfigError) as e:
        cfg(**raw)
    assert message in str(e.value), str(e.value)


class _Dev:
    platform = "gpu"
    id = 0

    def __init__(self, kind, cc):
        self.device_kind, self.compute_capability = kind, cc


def test_fp8_on_an_old_gpu_names_it_and_the_recipe_that_works():
    r = QuantRecipe("fp8-hybrid")
    with pytest.raises(fp8.Fp8UnsupportedError) as e:
        check_device(r, _Dev("NVIDIA A100-SXM4-80GB", "8.0"))
    msg = str(e.value)
    assert "A100" in msg and "8.0" in msg and "recipe: bf16" in msg
    check_device(r, _Dev("NVIDIA H100 80GB HBM3", "9.0"))  # fine
    check_device(None, _Dev("NVIDIA A100-SXM4-80GB", "8.0"))  # bf16: no check


def test_nvfp4_logs_one_emulation_line(caplog):
    from surogate_jax.ops import nvfp4_matmul

    nvfp4_matmul.log_emulation.cache_clear()
    with caplog.at_level("INFO", logger="surogate_jax"):
        check_device(QuantRecipe("nvfp4"))
        check_device(QuantRecipe("nvfp4"))
    lines = [r.getMessage() for r in caplog.records if "nvfp4" in r.getMessage()]
    assert len(lines) == 1 and "emulated" in lines[0] and "has not run on hardware" in lines[0], lines


def test_recipe_validates_the_model_dims():
    from surogate_jax.models import DecoderConfig

    with pytest.raises(ValueError, match="multiple of 16"):
        DecoderConfig(model_type="llama", vocab_size=10, hidden_size=40, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=20, recipe=QuantRecipe("nvfp4"))
    DecoderConfig(model_type="llama", vocab_size=10, hidden_size=40, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=20, recipe=QuantRecipe("fp8-hybrid"))  # XLA pads
