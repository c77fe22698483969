"""CPU tests of surogate_jax.ops.rms_norm: the public custom_vjp op (impl="ref") against
`rms_norm_ref` under jax.grad, the env override, and the reference against float64 numpy math."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.ops import resolve_impl, rms_norm, rms_norm_ref

SHAPES = [(1, 7), (13, 128), (127, 1000), (31, 1001), (2, 3, 1001), (4, 5, 128)]
DTYPES = [jnp.float32, jnp.bfloat16]
EPS = 1e-5


def _inputs(key, shape, dtype):
    kx, kw, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    proj = jax.random.normal(kp, shape, jnp.float32)
    return x, w, proj


def _loss_and_grads(fn, x, w, proj):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * proj)

    return fn(x, w), jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_op_matches_reference(shape, dtype, assert_close):
    x, w, proj = _inputs(jax.random.key(sum(shape)), shape, dtype)
    y, (dx, dw) = _loss_and_grads(lambda x, w: rms_norm(x, w, EPS, impl="ref"), x, w, proj)
    y_ref, (dx_ref, dw_ref) = _loss_and_grads(lambda x, w: rms_norm_ref(x, w, EPS), x, w, proj)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close(y, y_ref, dtype, "y")
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dw")


def test_jit_and_default_impl(assert_close):
    x, w, proj = _inputs(jax.random.key(1), (3, 17, 128), jnp.float32)
    fn = jax.jit(lambda x, w: rms_norm(x, w, EPS))  # impl=None: "auto" or "ref" on CPU
    y, (dx, dw) = jax.jit(lambda x, w: _loss_and_grads(fn, x, w, proj))(x, w)
    y_ref, (dx_ref, dw_ref) = _loss_and_grads(lambda x, w: rms_norm_ref(x, w, EPS), x, w, proj)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert_close(got, want, jnp.float32)


def test_vmap_matches_reference(assert_close):
    x, w, proj = _inputs(jax.random.key(2), (4, 9, 128), jnp.float32)
    ws = w * jnp.arange(1, 5, dtype=jnp.float32)[:, None]  # per-example weights
    got = jax.vmap(lambda x, w: rms_norm(x, w, EPS, impl="ref"))(x, ws)
    want = jax.vmap(lambda x, w: rms_norm_ref(x, w, EPS))(x, ws)
    assert_close(got, want, jnp.float32)


def test_weight_dtype_differs_from_x(assert_close):
    # fp32 weights with bf16 activations: the op casts w to bf16; dw comes back in fp32.
    x, w, proj = _inputs(jax.random.key(3), (8, 256), jnp.bfloat16)
    w32 = w.astype(jnp.float32) + 1e-3
    _, (_, dw) = _loss_and_grads(lambda x, w: rms_norm(x, w, EPS, impl="ref"), x, w32, proj)
    _, (_, dw_ref) = _loss_and_grads(
        lambda x, w: rms_norm_ref(x, w.astype(jnp.bfloat16), EPS), x, w32, proj
    )
    assert dw.dtype == jnp.float32
    assert_close(dw, dw_ref, jnp.bfloat16)


def test_env_forces_reference(force_ref):
    force_ref("ref")
    assert resolve_impl(None) == "ref"
    assert resolve_impl("ffi") == "ref"
    jaxpr = jax.make_jaxpr(lambda x, w: rms_norm(x, w, impl="ffi"))(jnp.ones((2, 8)), jnp.ones(8))
    assert "surogate_rms_norm" not in str(jaxpr)
    force_ref("ref:rope, rms_norm")
    assert resolve_impl("ffi", "rms_norm") == "ref"
    assert resolve_impl("ref", "swiglu") == "ref"
    jaxpr = jax.make_jaxpr(lambda x, w: rms_norm(x, w, impl="ffi"))(jnp.ones((2, 8)), jnp.ones(8))
    assert "surogate_rms_norm" not in str(jaxpr)
    with pytest.raises(ValueError, match="SUROGATE_JAX_OPS"):
        force_ref("bogus")
    assert resolve_impl("ffi", "rms_norm") == "ref"  # a malformed spec changed nothing


def test_env_read_once(monkeypatch, force_ref):
    """SUROGATE_JAX_OPS is read at the first use (a malformed value raises there) and cached: a
    later change of the variable takes effect only through force_ref(None)."""
    import surogate_jax.ops._loader as loader
    monkeypatch.setattr(loader, "ffi_available", lambda: True)
    monkeypatch.setattr(loader, "_forced", loader._UNREAD)  # as in a fresh process
    monkeypatch.setenv("SUROGATE_JAX_OPS", "bogus")
    with pytest.raises(ValueError, match="SUROGATE_JAX_OPS"):
        resolve_impl(None)
    monkeypatch.setenv("SUROGATE_JAX_OPS", "ref:rms_norm")
    assert resolve_impl("ffi", "rms_norm") == "ref"  # first successful read
    monkeypatch.setenv("SUROGATE_JAX_OPS", "")
    assert resolve_impl("ffi", "rms_norm") == "ref"  # cached: the change is not seen
    force_ref(None)
    assert resolve_impl("ffi", "rms_norm") == "ffi"  # re-read


def test_env_forces_reference_per_op(monkeypatch, force_ref):
    """ref:<ops> forces only the named ops; the others resolve as usual."""
    import surogate_jax.ops._loader as loader
    monkeypatch.setattr(loader, "ffi_available", lambda: True)
    force_ref("ref:rope,swiglu")
    assert loader.resolve_impl("ffi", "rope") == "ref"
    assert loader.resolve_impl(None, "swiglu") == "ref"
    assert loader.resolve_impl("ffi", "rms_norm") == "ffi"
    assert loader.resolve_impl(None, "rms_norm") == "auto"


@pytest.mark.parametrize("forced, fwd_kernel, bwd_kernel", [
    ("", True, True), ("ref:rms_norm.bwd", True, False), ("ref:rms_norm.fwd", False, True),
    ("ref:rope.bwd", True, True), ("ref:rms_norm", False, False)])
def test_env_forces_reference_per_pass(monkeypatch, force_ref, forced, fwd_kernel, bwd_kernel):
    """ref:<op>.fwd / .bwd swaps the reference in for one pass; the traced program shows which
    custom calls remain (impl="ffi" traces the kernels without running them, so this runs on CPU)."""
    import surogate_jax.ops._loader as loader
    monkeypatch.setattr(loader, "ffi_available", lambda: True)
    force_ref(forced)
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones(8, jnp.bfloat16)
    fwd = str(jax.make_jaxpr(lambda x, w: rms_norm(x, w, impl="ffi"))(x, w))
    both = str(jax.make_jaxpr(jax.grad(lambda x, w: rms_norm(x, w, impl="ffi").astype(jnp.float32).sum(),
                                       argnums=(0, 1)))(x, w))
    assert ("surogate_rms_norm_fwd" in fwd) == fwd_kernel
    assert ("surogate_rms_norm_fwd" in both) == fwd_kernel
    assert ("surogate_rms_norm_bwd" in both) == bwd_kernel


def test_bad_arguments():
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda")
    with pytest.raises(ValueError, match="shape"):
        rms_norm(jnp.ones((2, 8)), jnp.ones(4))


def test_checkpoint_name_tag():
    jaxpr = jax.make_jaxpr(lambda x, w: rms_norm(x, w, impl="ref"))(jnp.ones((2, 8)), jnp.ones(8))
    assert "rms_norm" in str(jaxpr) and "name" in str(jaxpr)


@pytest.mark.parametrize("shape", [(1, 7), (37, 1001), (3, 4, 128)], ids=str)
def test_reference_against_float64_numpy(shape, assert_close):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    w = 1.0 + 0.5 * rng.standard_normal(shape[-1])
    dy = rng.standard_normal(shape)

    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    y = x * rstd * w
    xhat, g = x * rstd, dy * w
    dx = rstd * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    dw = np.sum((dy * xhat).reshape(-1, shape[-1]), axis=0)

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    y_ref, vjp = jax.vjp(lambda x, w: rms_norm_ref(x, w, EPS), f32(x), f32(w))
    dx_ref, dw_ref = vjp(f32(dy))
    assert_close(y_ref, y, jnp.float32, "y")
    assert_close(dx_ref, dx, jnp.float32, "dx")
    assert_close(dw_ref, dw, jnp.float32, "dw")


def test_kernel_calls_carry_the_handlers_attributes():
    """The custom calls pass exactly the attributes ffi/rms_norm.cc binds: eps (forward), none
    (backward). Lowering only: the CUDA target is not needed."""
    import importlib

    mod = importlib.import_module("surogate_jax.ops.rms_norm")  # the package exports a function of that name

    x, w, rstd = jnp.zeros((4, 8), jnp.bfloat16), jnp.ones((8,), jnp.bfloat16), jnp.ones((4,), jnp.float32)
    fwd = jax.jit(lambda x, w: mod._fwd_ffi(x, w, EPS)).lower(x, w).as_text()
    bwd = jax.jit(mod._bwd_ffi).lower(x, x, w, rstd).as_text()
    assert re.search(r"custom_call @surogate_rms_norm_fwd\(.*backend_config = \{eps = [^,}]* : f32\}", fwd)
    assert re.search(r"custom_call @surogate_rms_norm_bwd\(.*backend_config = \{\}", bwd)
