"""NorMuon: Muon's orthogonalized momentum plus a neuron-wise second moment, as one optax transform.

`normuon(learning_rate, ...)` returns ONE `optax.GradientTransformation` for a whole parameter tree.
It partitions the tree (`matrix_dims`): hidden weight matrices get NorMuon, everything else
(embeddings, lm_head, norm scales, biases) gets the AdamW half (`_aux_adamw`: our blockwise 8-bit
AdamW, `surogate_jax.optim.adamw_8bit`, as in Surogate's NorMuon; weight decay only on
embedding/lm_head, as `decay_mask` does for plain AdamW).

Algorithm per hidden matrix W (torch layout (out, in); ours is the transpose, see "Layout"), with
gradient G, learning rate lr_t (schedule), decay wd. Sources: NorMuon paper (Li et al. 2025,
arXiv 2510.05491) and its official code (zichongli5/NorMuon `normuon.py`, built on KellerJordan/Muon),
as summarized in ../shared/reference/peers_and_algorithms.md 4b; defaults and the cautious decay from
Surogate (reference/surogate_inventory.md 7.2) and modded-nanogpt.
  1. Momentum (fp32): M <- b1 M + (1 - b1) G;  U = (1 - b1) G + b1 M (Nesterov, official default)
     or U = M (`nesterov=False`, what Surogate does).  b1 = normuon_momentum (0.95).
  2. O = NS5(U): X = U / (||U||_F + 1e-7), then 5 times X <- a X + (b A + c A^2) X with A = X X^T on
     the smaller side (the iteration commutes with transposition, so the orientation only sets the
     Gram size). GEMM inputs in `ns_dtype` (bf16, fp32 accumulation, fp32 linear combinations).
     Coefficients (`ns_coeffs`):
       "muon" (default): (3.4445, -4.7750, 2.0315) every step, Keller Jordan's quintic from
         KellerJordan/Muon, which the official NorMuon code copies. It maximizes the slope at zero
         (3.4445) so that small singular values reach the band in 5 steps, at the price of not
         converging to exactly 1: singular values land in about [0.68, 1.13] (measured in
         tests/optim/test_normuon.py) instead of at 1, which Muon's author found not to hurt training.
       "polar_express": the five per-step triples of Polar Express (Amsel et al. 2025,
         arXiv 2505.16932) as used in modded-nanogpt/nanochat and cited by Surogate, with its
         ||X||_F * 1.02 + 1e-6 normalization; a tighter band after 5 steps for the same cost.
     We keep the official NorMuon choice as the default so one step matches that reference.
  3. Neuron-wise second moment: r_j = mean_i O_ij^2 over the INPUT dimension (one value per output
     neuron), V <- b2 V + (1 - b2) r (no bias correction, as official), b2 = normuon_beta2 (0.95).
  4. O_hat = O / (sqrt(V) + 1e-10), then rescaled to ||O||_F (the official code's norm-preserving
     step: only the distribution across neurons changes, not Muon's step size; it also cancels any
     missing bias correction of V).
  5. Shape-dependent step scale (`lr_rule`):
       "adamw" (default): u = rms_scale * sqrt(m n) * O_hat / ||O_hat||_F, the NorMuon paper's rule
         (eta_hat = 0.2 eta sqrt(mn) / ||O_hat||_F), i.e. update RMS = 0.2 lr, the RMS AdamW updates
         typically have. This is the rule that makes ONE learning_rate serve both halves, which is
         how Surogate's config works (`learning_rate` is used for NorMuon's matrices too);
       "muon": u = O_hat * sqrt(max(1, fan_out / fan_in)), the official code's and Muon's scale,
         meant for Muon-sized learning rates (~0.02), not AdamW's.
  6. Decoupled, cautious weight decay (normuon_cautious_wd, default on; Surogate/modded-nanogpt):
     W <- W - lr_t (u + wd * mask * W), mask = (u * W >= 0), i.e. decay only where the update already
     pushes W toward zero; `cautious_wd=False` decays everywhere (the official code).
     The weight decay uses lr_t itself (not the shape-scaled step), as in the official code.

Layout. Our Flax `Linear` kernels are [in..., out...] (JAX), the transpose of torch's (out, in). A
kernel is viewed as the matrix (m, n) = (prod(in dims), prod(out dims)) after `lead` leading axes
(the `nn.scan` layer axis: a q_proj kernel is [L, D, H, K] -> L matrices of (D, H*K); o_proj is
[L, H, K, D] -> (H*K, D)). "Per output neuron" in the torch papers means reducing over the input
dimension: here axis -2 of the (m, n) view, so V has one entry per output column and is stored as
[lead..., out dims...] (q_proj: [L, H, K]), keeping the output axes (and their shardings) of W.
Each layer's matrix is orthogonalized on its own (NS runs batched over the leading axes).

Partition (`default_matrix_dims`): NorMuon for every `kernel` of a hidden Linear layer (q, k, v, o,
gate, up, down) and for LoRA adapters (`lora_a` [in..., r], `lora_b` [r, out...]): Surogate gives
each LoRA A/B matrix its own NorMuon state, and they are ordinary 2-D matrices. (At step 0 lora_a's
gradient is exactly zero because lora_b starts at zero; the update is then zero, no NaN.) AdamW for
`embedding`, `lm_head`, norm `scale`s, `bias`es and anything whose path mentions embed/lm_head/router.
Pass your own `matrix_dims(path, leaf) -> MatrixDims | None` for other models.

Why no fused CUDA kernel. The passes over memory are fixed by data dependencies, not by who
writes them: the Frobenius norm of U must be complete before NS starts, and the column statistics
of O before any element can be normalized. So any implementation, a fused kernel included, does
(per element, fp32 state) one pass before NS (read G, read+write M, write the bf16 NS input:
14 B) and two after it (read O for the column sums of O^2; read O again, read+write W: 4 + 12 B),
about 30 B/element. The code above is written so XLA needs exactly those passes: both norms
come from the column sums (no extra pass), and the last pass is a single elementwise product
O * c_j that XLA fuses with the cautious decay and the parameter write when the update runs in
the jitted train step. Against that, NS costs 5 (4 m^2 n + 2 m^3) FLOPs per (m <= n) matrix:
~24k FLOPs per element at m = 1024 (34 ps at ~700 TFLOP/s) against ~10 ps for 30 B at 3 TB/s;
at m = 4096, ~120k FLOPs (170 ps) per element. A kernel could only shave XLA's fusion overheads
off the ~10 ps; benchmarks/bench_normuon.py measures the split on an H100 ("no_ns" = everything
but the NS GEMMs) so this claim is checked, not assumed. The NS GEMMs themselves are bf16 dots
that XLA hands to cuBLAS.

State (per NorMuon leaf): `mu` (momentum, fp32, the parameter's shape) and `nu` (V, fp32,
[lead..., out dims...]): plain arrays in optax NamedTuples that Orbax saves and restores like any
optax state. `mu` has the parameter's shape and path, `nu` its output axes, so the trainer's
shape-based state shardings (parallel.py) apply to them as to the parameters, and a jitted update
keeps whatever shardings the state was placed with (tested on a 4-device CPU mesh). Newton-Schulz
needs whole matrices: with a sharded state XLA gathers each matrix for it (every device then
runs the same NS; distributing the matrices over devices, as the NorMuon paper's FSDP2 version
does, is not done here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..names import layer_stack_start
from .adamw_8bit import adamw_8bit

# ---------------------------------------------------------------------------------------------
# Newton-Schulz

MUON_COEFFS = ((3.4445, -4.7750, 2.0315),) * 5
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# coefficient set -> (per-step (a, b, c), norm multiplier, norm epsilon)
NS_COEFFS = {"muon": (MUON_COEFFS, 1.0, 1e-7), "polar_express": (POLAR_EXPRESS_COEFFS, 1.02, 1e-6)}


def ns_coefficients(coeffs: str, steps: int) -> tuple[tuple[tuple[float, float, float], ...], float, float]:
    if coeffs not in NS_COEFFS:
        raise ValueError(f"ns_coeffs={coeffs!r}: use one of {sorted(NS_COEFFS)}")
    table, mult, eps = NS_COEFFS[coeffs]
    # Beyond the table, repeat its last triple (Muon's is constant anyway).
    return tuple(table[min(i, len(table) - 1)] for i in range(steps)), mult, eps


def newton_schulz(x: jax.Array, steps: int = 5, coeffs: str = "muon", dtype=jnp.bfloat16) -> jax.Array:
    """Approximate polar factor of each matrix x[..., m, n] -> fp32 of the same shape.

    GEMM inputs are cast to `dtype` (bf16 by default) with fp32 accumulation and fp32 linear
    combinations; the Gram matrix is formed on the smaller side."""
    table, mult, eps = ns_coefficients(coeffs, steps)
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (norm * mult + eps)
    prec = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

    def mm(p, q):
        return jnp.matmul(p.astype(dtype), q.astype(dtype), precision=prec, preferred_element_type=jnp.float32)

    for a, b, c in table:
        gram = mm(x, jnp.swapaxes(x, -1, -2))
        poly = b * gram + c * mm(gram, gram)
        x = a * x + mm(poly, x)
    return jnp.swapaxes(x, -1, -2) if tall else x


# ---------------------------------------------------------------------------------------------
# Partition


class MatrixDims(NamedTuple):
    """How a parameter is a stack of matrices: `lead` leading (layer) axes, then `n_in` input
    axes, then the output axes."""

    lead: int
    n_in: int


AUX_NAMES = ("embed", "lm_head", "router")


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def default_matrix_dims(path, leaf) -> MatrixDims | None:
    """Our Decoder's hidden Linear kernels and LoRA adapters -> MatrixDims; others -> None (AdamW).

    `layers` (the nn.scan collection) adds one leading axis per occurrence in the path, and so does an MoE layer's
    `experts` (each expert's adapter is its own matrix); o_proj kernels contract two input axes (heads, head_dim);
    lora_a has one output axis (rank), lora_b one input axis (rank). The MoE router (`mlp/gate`) and the stacked
    experts' own weights go to AdamW, as Surogate splits them."""
    keys = _keys(path)
    name = keys[-1] if keys else ""
    if name not in ("kernel", "lora_a", "lora_b") or any(a in k for k in keys for a in AUX_NAMES) or "gate" in keys:
        return None
    lead = sum(layer_stack_start(k) is not None for k in keys) + ("experts" in keys)
    mat = len(leaf.shape) - lead
    if mat < 2:
        return None
    if name == "lora_a":
        n_in = mat - 1
    elif name == "lora_b":
        n_in = 1
    else:
        n_in = 2 if "o_proj" in keys and mat >= 3 else 1
    return MatrixDims(lead, n_in)


def _matrix_shape(shape, d: MatrixDims) -> tuple[tuple[int, ...], int, int]:
    lead = tuple(shape[: d.lead])
    m = math.prod(shape[d.lead : d.lead + d.n_in])
    n = math.prod(shape[d.lead + d.n_in :])
    return lead, m, n


def _nu_shape(shape, d: MatrixDims) -> tuple[int, ...]:
    return tuple(shape[: d.lead]) + tuple(shape[d.lead + d.n_in :])


def _is_aux_nodecay(path) -> bool:
    return _keys(path)[-1:] in (["scale"], ["bias"])


def normuon_labels(params, matrix_dims: Callable = default_matrix_dims):
    """The partition as a tree of labels: "normuon", "adamw" (decayed) or "adamw_nodecay"."""
    def label(path, leaf):
        if matrix_dims(path, leaf) is not None:
            return "normuon"
        return "adamw_nodecay" if _is_aux_nodecay(path) else "adamw"
    return jax.tree_util.tree_map_with_path(label, params)


# ---------------------------------------------------------------------------------------------
# The NorMuon direction (no learning rate, no weight decay)


class ScaleByNorMuonState(NamedTuple):
    mu: Any  # momentum, fp32, parameter shapes
    nu: Any  # neuron-wise second moment, fp32, [lead..., out...]


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def scale_by_normuon(
    momentum: float = 0.95,
    beta2: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: str = "muon",
    ns_dtype=jnp.bfloat16,
    eps: float = 1e-10,
    lr_rule: str = "adamw",
    rms_scale: float = 0.2,
    matrix_dims: Callable = default_matrix_dims,
) -> optax.GradientTransformation:
    """Steps 1-5 of the module docstring: gradients -> NorMuon direction u (same tree, param dtypes).

    Every non-masked leaf must be a matrix stack according to `matrix_dims`."""
    if lr_rule not in ("adamw", "muon"):
        raise ValueError(f"lr_rule={lr_rule!r}: use 'adamw' (update RMS = rms_scale * lr) or 'muon'")
    ns_coefficients(ns_coeffs, ns_steps)  # validate early

    def dims(path, leaf) -> MatrixDims:
        d = matrix_dims(path, leaf)
        if d is None:
            raise ValueError(f"scale_by_normuon: {jax.tree_util.keystr(path)} {jnp.shape(leaf)} is not a matrix")
        return d

    def init_fn(params):
        mu = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        nu = jax.tree_util.tree_map_with_path(
            lambda path, p: jnp.zeros(_nu_shape(jnp.shape(p), dims(path, p)), jnp.float32), params)
        return ScaleByNorMuonState(mu=mu, nu=nu)

    def leaf_update(path, g, mu, nu):
        d = dims(path, g)
        shape = jnp.shape(g)
        lead, m, n = _matrix_shape(shape, d)
        g32 = g.astype(jnp.float32)
        mu = momentum * mu + (1.0 - momentum) * g32
        u = (1.0 - momentum) * g32 + momentum * mu if nesterov else mu
        o = newton_schulz(u.reshape(*lead, m, n), ns_steps, ns_coeffs, ns_dtype)
        # Everything after NS is one per-column factor: O_hat = O * c_j. Both Frobenius norms
        # follow from the column sums of O^2 (||O||^2 = sum_j s_j, ||O / d||^2 = sum_j s_j / d_j^2),
        # so O is read twice in all: once for s, once for the final scale (fused by XLA with the
        # cautious decay and the parameter write).
        col = jnp.sum(jnp.square(o), axis=-2)  # [lead..., n]: one per output neuron
        nu = beta2 * nu + (1.0 - beta2) * (col / m).reshape(nu.shape)
        inv = 1.0 / (jnp.sqrt(nu.reshape(col.shape)) + eps)
        o_norm = jnp.sqrt(jnp.sum(col, axis=-1, keepdims=True))
        hat_norm = jnp.sqrt(jnp.sum(col * jnp.square(inv), axis=-1, keepdims=True))
        rescale = o_norm / (hat_norm + eps)  # O_hat = O * inv * rescale has ||O_hat|| = ||O||
        if lr_rule == "muon":
            factor = inv * rescale * math.sqrt(max(1.0, n / m))
        else:  # RMS rms_scale; eps keeps an all-zero gradient (lora_a at step 0) at zero
            factor = inv * rescale * (rms_scale * math.sqrt(m * n) / (rescale * hat_norm + eps))
        return (o * factor[..., None, :]).reshape(shape).astype(g.dtype), mu, nu

    def update_fn(updates, state, params=None):
        del params
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_masked)
        mus = treedef.flatten_up_to(state.mu)
        nus = treedef.flatten_up_to(state.nu)
        outs = [(g, m, v) if _is_masked(g) else leaf_update(path, g, m, v)
                for (path, g), m, v in zip(flat, mus, nus)]
        u, mu, nu = (treedef.unflatten([o[i] for o in outs]) for i in range(3))
        return u, ScaleByNorMuonState(mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def add_cautious_decayed_weights(weight_decay: float, cautious: bool = True) -> optax.GradientTransformation:
    """u -> u + wd * mask * p with mask = (u * p >= 0) (cautious) or 1; runs before the lr scale."""

    def update_fn(updates, state, params):
        if params is None:
            raise ValueError("add_cautious_decayed_weights needs params (pass them to tx.update)")
        if weight_decay == 0.0:
            return updates, state

        def f(u, p):
            if _is_masked(u):
                return u
            p32, u32 = p.astype(jnp.float32), u.astype(jnp.float32)
            decay = weight_decay * p32
            if cautious:
                decay = jnp.where(u32 * p32 >= 0, decay, 0.0)
            return (u32 + decay).astype(u.dtype)

        return jax.tree.map(f, updates, params, is_leaf=_is_masked), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ---------------------------------------------------------------------------------------------
# The whole optimizer


def _aux_adamw(learning_rate, b1: float, b2: float, eps: float, weight_decay: float,
               fp32: bool, mesh: jax.sharding.Mesh | None = None) -> optax.GradientTransformation:
    """The AdamW half (embeddings, lm_head, norms, biases): 8-bit AdamW as in Surogate; norm scales
    and biases (`fp32`) keep fp32 moments, as `optimizer: adamw_8bit` does. Swap this one line for
    optax.adamw to get fp32 states everywhere."""
    return adamw_8bit(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, fp32_mask=fp32, mesh=mesh)


def normuon(
    learning_rate: float | optax.Schedule,
    momentum: float = 0.95,
    beta2: float = 0.95,
    weight_decay: float = 0.0,
    cautious_wd: bool = True,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: str = "muon",
    ns_dtype=jnp.bfloat16,
    eps: float = 1e-10,
    lr_rule: str = "adamw",
    rms_scale: float = 0.2,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float | None = None,
    matrix_dims: Callable = default_matrix_dims,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformation:
    """NorMuon for the hidden matrices + AdamW for the rest, as one transform (see module docstring).

    learning_rate: float or optax schedule, shared by both halves (Surogate's convention; with
    lr_rule="adamw" NorMuon's update RMS is rms_scale * lr). momentum/beta2/cautious_wd are
    Surogate's normuon_momentum/normuon_beta2/normuon_cautious_wd; weight_decay applies to the
    NorMuon matrices and (unless adam_weight_decay is given) to embeddings/lm_head, never to norm
    scales or biases. mesh: passed to the AdamW half (adamw_8bit's per-ZeRO-shard update)."""
    adam_wd = weight_decay if adam_weight_decay is None else adam_weight_decay
    matrices = optax.chain(
        scale_by_normuon(momentum, beta2, nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs,
                         ns_dtype=ns_dtype, eps=eps, lr_rule=lr_rule, rms_scale=rms_scale, matrix_dims=matrix_dims),
        add_cautious_decayed_weights(weight_decay, cautious_wd),
        optax.scale_by_learning_rate(learning_rate),
    )
    transforms = {
        "normuon": matrices,
        "adamw": _aux_adamw(learning_rate, adam_b1, adam_b2, adam_eps, adam_wd, fp32=False, mesh=mesh),
        "adamw_nodecay": _aux_adamw(learning_rate, adam_b1, adam_b2, adam_eps, 0.0, fp32=True, mesh=mesh),
    }
    return optax.multi_transform(transforms, lambda params: normuon_labels(params, matrix_dims))


__all__ = [
    "MUON_COEFFS", "POLAR_EXPRESS_COEFFS", "MatrixDims", "ScaleByNorMuonState", "add_cautious_decayed_weights",
    "default_matrix_dims", "newton_schulz", "normuon", "normuon_labels", "scale_by_normuon",
]
