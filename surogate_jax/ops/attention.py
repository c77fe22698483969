"""Causal self-attention over packed rows: each token attends to the earlier tokens of its own segment (document).

Shapes: q [B, T, N, H], k and v [B, T, NKV, H] (grouped-query: N % NKV == 0); the row's segments: None (the
whole row is one causal sequence), segment_ids [B, T] int32, or `Segments` (the ids plus each segment's start and
length, made once per forward by `segments`, so every layer reuses them). Segments are CONTIGUOUS runs of equal ids
(the loader's 1, 2, ... per document and 0 for the padding at a row's end are; a padding run is a segment of its
own).

Implementations:
  "xla"    `jax.nn.dot_product_attention` with a dense [B, 1, T, T] mask (same id & causal): every T x T block is
           computed (the reference; any backend).
  "cudnn"  on a GPU, without segments: cuDNN flash attention, causal. With `Segments`: cuDNN's packed (ragged)
           layout, one causal sequence per segment, given per row its segments' start offsets and lengths:
           blocks outside a token's own document are never computed. Needs SM90+ (Hopper) and 16-bit inputs;
           elsewhere, or with plain segment ids, the dense mask goes to cuDNN.
The packed path reaches cuDNN through JAX's own fused-attention module (jax._src.cudnn.fused_attention_stablehlo,
the function `jax.nn.dot_product_attention(implementation="cudnn")` calls, with its q/kv offsets arguments, which
the public wrapper does not expose). It runs per shard of the batch (ops/_sharding.py) so its offsets never cross
devices.

`segments(ids, max_segments)`: M = max_segments is a static bound on the segments of any row; a row with more
would lose its last ones, so the caller must guarantee it (surogate_jax.data.BatchLoader caps documents per row and
says its M; `segment_offsets` documents the layout). Forward and gradients of "cudnn" equal the masked reference up
to accumulation order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from surogate_jax.ops._sharding import on_shards

IMPLS = ("auto", "cudnn", "xla")
# cuDNN's packed layout launches work (and keeps softmax statistics) for every one of the M segment slots of a
# row, used or not: on an H100 at Qwen3-0.6B, seq 2048, its step took 227 ms at M = 9, 246 ms at M = 32 and the
# dense mask 308 ms (crossover near M = 100); the trainer takes the dense mask for bounds above this.
MAX_PACKED_SEGMENTS = 64


class Segments(NamedTuple):
    """A batch's segments: ids [B, T], lengths [B, M] and offsets [B, M + 1] (`segment_offsets`)."""

    ids: jax.Array
    lengths: jax.Array
    offsets: jax.Array


def segment_offsets(segment_ids_BT: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """(lengths [B, M] int32, offsets [B, M + 1] int32) of each row's segments, M = max_segments: segment m of row b
    starts at token offsets[b, m] and has lengths[b, m] tokens; entries past the row's segment count are -1 (so is
    offsets[b, M]), the layout JAX's cuDNN packed attention takes. A segment starts wherever the id changes (and at
    t = 0); segments past the M-th are dropped."""
    B, T = segment_ids_BT.shape
    seg = jnp.asarray(segment_ids_BT)
    start = jnp.concatenate([jnp.ones((B, 1), jnp.bool_), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = jnp.minimum(jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1, max_segments)  # M: beyond the bound
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = jnp.zeros((B, max_segments + 1), jnp.int32).at[rows, idx].add(1)[:, :max_segments]
    first = jnp.full((B, max_segments + 1), T, jnp.int32).at[rows, idx].min(t)[:, :max_segments]
    used = lengths > 0
    lengths = jnp.where(used, lengths, -1)
    offsets = jnp.concatenate([jnp.where(used, first, -1), jnp.full((B, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets


def attention_ref(q, k, v, segment_ids_BT=None, *, implementation: str | None = "xla"):
    """Reference: causal attention with the dense same-segment mask (implementation: jax.nn's)."""
    if segment_ids_BT is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    T = q.shape[1]
    causal_TT = jnp.tril(jnp.ones((T, T), jnp.bool_))
    same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=(same_BTT & causal_TT)[:, None], implementation=implementation)


def segments(segment_ids_BT: jax.Array, max_segments: int) -> Segments:
    """The ids with their segments' lengths and offsets (`segment_offsets`), for the packed path; max_segments: a
    static bound on any row's segments (positive int)."""
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
        raise ValueError(f"attention: max_segments must be a positive int, got {max_segments!r}")
    return Segments(segment_ids_BT, *segment_offsets(segment_ids_BT, max_segments))


def _packed_cudnn(q, k, v, lengths, offsets):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    return cudnn_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                           scale=1.0 / math.sqrt(q.shape[-1]), mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def attention_impl(impl: str, dtype) -> str:
    """"auto": cuDNN on a GPU for 16-bit inputs, XLA elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r}: use one of {IMPLS}")
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "xla"


def _packed_supported() -> bool:
    """cuDNN's packed layout needs SM90+ (JAX refuses it below)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is not None and float(cc) >= 9.0
    except ValueError:
        return False


def attention(q, k, v, segs: jax.Array | Segments | None = None, *, impl: str = "auto",
              mesh: Mesh | AbstractMesh | None = None) -> jax.Array:
    """o [B, T, N, H]: causal attention of each token over its own segment (module docstring). segs: None, segment
    ids [B, T], or `Segments` (enables cuDNN's packed layout); impl "auto" | "cudnn" | "xla"; mesh: the devices whose
    data axes split the rows for the packed path (None: one call)."""
    impl = attention_impl(impl, q.dtype)
    ids = segs.ids if isinstance(segs, Segments) else segs
    if not isinstance(segs, Segments) or impl == "xla" or not _packed_supported():
        return attention_ref(q, k, v, ids, implementation=impl)
    (o,) = on_shards(lambda *a: (_packed_cudnn(*a),), q, k, v, segs.lengths, segs.offsets, mesh=mesh,
                     batched=(True,) * 5, out_batched=(True,))
    return o
