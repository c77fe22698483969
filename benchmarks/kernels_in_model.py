"""Our model kernels inside the jitted train step: step time per kernel set, and the compiled HLO.

Seed config (Qwen3 random init, LoRA r16 on all projections, batch 2 x accum 4 x 2048, full
recompute), one process, several kernel sets (comma lists of DecoderConfig.kernels, or `none`):

    python benchmarks/kernels_in_model.py 0.6b none swiglu rope,rms_norm,add_rms_norm,swiglu
    python benchmarks/kernels_in_model.py 0.6b rope,rms_norm@rope.bwd,rms_norm.bwd

`--no-recompute` runs the same config without rematerialization (activations kept).
`--pack-max-bytes=N` sets models.llamalike.PACK_GATE_UP_MAX_BYTES (swiglu_lora's gate/up as one
GEMM over the concatenated kernels up to N bytes, two GEMMs above): 0 forces two everywhere.
A set may end in `@<op>.<pass>,...`: those passes run XLA's fusion of the reference
(SUROGATE_JAX_OPS=ref:<op>.<pass>, set per set through ops._loader.force_ref), e.g. the rope kernel
forward with the XLA-fused backward.

Prints one JSON line per set (step ms, tokens/s, counts of custom calls / fusions / copies in the
compiled HLO) and writes the HLO text to $OUT/hlo_<size>_<set>.txt (or /tmp) to read what XLA fused.
"""

import json
import os
import re
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sft_throughput as S  # noqa: E402

from surogate_jax import train as T  # noqa: E402
from surogate_jax.lora import init_adapters  # noqa: E402
from surogate_jax.models import Decoder, llamalike  # noqa: E402
from surogate_jax.ops import _loader  # noqa: E402

out = os.environ.get("OUT", "/tmp")


def _usage_error(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


for a in sys.argv[1:]:
    if a.startswith("--pack-max-bytes="):
        try:
            llamalike.PACK_GATE_UP_MAX_BYTES = int(a.split("=", 1)[1])
        except ValueError:
            _usage_error(f"{a}: expected --pack-max-bytes=<integer>")
    elif a.startswith("--") and a != "--no-recompute":
        _usage_error(f"unknown option {a} (known: --no-recompute, --pack-max-bytes=N)")
args = [a for a in sys.argv[1:] if not a.startswith("--")]
if not args:
    _usage_error("usage: kernels_in_model.py SIZE [KERNEL_SET ...] [--no-recompute] [--pack-max-bytes=N]")
recompute = "--no-recompute" not in sys.argv  # default: the seed config's full recompute
size = args[0]
sets = args[1:]
res = []
for ks in sets:
    ks_kernels, _, forced = ks.partition("@")
    # the set's passes on the reference; a set without "@" keeps the environment's SUROGATE_JAX_OPS
    _loader.force_ref("ref:" + forced if forced else None)
    kernels = tuple(k for k in ks_kernels.split(",") if k and k != "none")
    cfg = S.qwen3(size, recompute).replace(kernels=kernels)
    model = Decoder(cfg)
    mesh = T.make_mesh(jax.devices()[:1])
    params = nn.meta.unbox(
        jax.jit(Decoder(cfg.replace(lora=None)).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    adapters = init_adapters(model, jax.random.key(1), jnp.zeros((1, 1), jnp.int32))
    tx = optax.adamw(2e-4, weight_decay=0.0)
    state = T.init_state(model, tx, params, adapters, 0, mesh)
    del params, adapters
    step = T.jit_train_step(model, tx, lambda s: 2e-4, mesh, state)
    batches = [T.global_batch(mesh, b, True)
               for b in S.packed_batches(np.random.default_rng(0), 2, 4, 2, 2048, cfg.vocab_size)]
    comp = step.lower(state, batches[0]).compile()
    txt = comp.as_text()
    name = ks.replace(",", "-").replace("@", "_ref_").replace(".", "")
    if any(a.startswith("--pack-max-bytes=") for a in sys.argv):
        name += f"_pack{llamalike.PACK_GATE_UP_MAX_BYTES}"
    open(f"{out}/hlo_{size}_{name}.txt", "w").write(txt)
    stats = {k: len(re.findall(p, txt)) for k, p in {
        "custom_call": r"custom-call\(", "fusion": r"= \S+ fusion\(", "copy": r"= \S+ copy\(",
        "transpose_fusion": r"kind=kInput.*transpose|transpose\(", "gemm": r"__cublas\$gemm|cublas.*gemm"}.items()}
    for _ in range(2):
        state, m = comp(state, batches[0])
        jax.block_until_ready(m)
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        state, m = comp(state, batches[i % 2])
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    r = dict(size=size, kernels=ks, recompute=recompute, pack_max_bytes=llamalike.PACK_GATE_UP_MAX_BYTES,
             step_ms=sec * 1e3, tps=2 * 4 * 2048 / sec, loss=float(m["loss"]), **stats)
    print(json.dumps(r), flush=True)
    res.append(r)
    del state, comp, step
