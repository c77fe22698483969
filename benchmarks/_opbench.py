"""Shared timing and reporting for the per-op benchmarks (bench_<op>.py).

Timing: one jitted program applies a step in a dependent chain with an optimization barrier
between steps (so XLA can neither fuse nor overlap steps). Chains of `steps` and `2 * steps`
steps are timed alternately (median over `repeats` calls each, after warm-up); the time per step
is their difference over `steps`. Each call pays a fixed dispatch + synchronize cost (about 0.1 ms,
estimated from the same shapes at 10 and 40 steps) that a single chain spreads over its steps: at
10 steps it inflated 20-60 us kernels (ours and XLA's alike; H100, 2026-11-23: rms_norm fwd+bwd at
61-84% of 3000 GB/s with 10 steps, 75-89% with 40); the difference cancels it. (Older figures in
docs/benchmark_history.md are single 40-step chains over one carry.)

Chains cycle through independent copies of their inputs, enough that one round reads L2_MULTIPLE
times the L2 (`rotation`): without it, a chain over an 8 MB tensor re-read from L2 what its
previous step had written, and small-shape figures above 100% of 3000 GB/s or swinging 1.5x
between runs came from that. `profile/calibrate_opbench.py` checks the method on a plain copy. Its
run (H100, 2026-11-23, commit 5c3e53e) showed the chained timing cannot be trusted below ~100 MB
moved a step, whatever the rotation: a copy of 100 MB read 2842-3021 GB/s at 2-16x the L2
(difference method; the single 40-step chain 2228-2406), but copies of 34 MB read 4648-6918 GB/s
and of 8 MB 5674-46046 GB/s, above the HBM3's 3350 GB/s (the per-call cost, which grows with the
number of input copies, swamps a few-us kernel and does not cancel in the difference). Rows whose
ours, XLA or copy figure is above the DRAM peak are marked "(!)"; for those shapes use Nsight
Compute's kernel-only durations (profile/profile_*.py; benchmarks/RESULTS.md, "Ops").

Bandwidth: "% of 3000" is the useful bytes per second over the H100's measured copy bandwidth;
"% of copy" is the same over what a plain copy of the same number of bytes achieves on this GPU
(an element-wise uint32 add over bytes/2 in and bytes/2 out, timed the same way): small tensors
cannot reach 3000 GB/s (launch and tail effects), so this says how close an op is to the device's
own limit at that size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

PEAK_GBS = 3000.0  # H100 measured device copy bandwidth (read + write)
DRAM_PEAK_GBS = 3350.0  # H100 SXM HBM3 data-sheet peak: no step that moves its bytes through DRAM is faster


L2_BYTES = 50 * 2**20  # H100 L2 (50 MB; /work/.library/device/KINDS.md)
L2_MULTIPLE = 8
MAX_ROTATE = 64


def rotation(carry, l2_bytes: int = L2_BYTES, cap: int = MAX_ROTATE, multiple: int = L2_MULTIPLE) -> int:
    """Independent copies of `carry` a timed chain cycles through so that one round over them reads
    at least `multiple` times the L2: a chain over one small carry (the 8 MB k tensors) re-reads
    what the previous step just wrote, from L2, and its time swung 1.5x between runs; at 2x the L2
    a copy still measured above the DRAM's peak (profile/calibrate_opbench.py)."""
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(carry))
    return max(1, min(cap, -(-multiple * l2_bytes // max(nbytes, 1))))


def chain(step, steps: int, r: int):
    """(carry_0, ..., carry_{r-1}) -> the same after `steps` steps, step i applied to carry i % r."""

    def run(cs):
        cs = list(cs)
        for i in range(steps):
            cs[i % r] = jax.lax.optimization_barrier(tuple(step(*cs[i % r])))
        return tuple(cs)

    return run


def time_chain(step, carry, steps: int, repeats: int, rotate: int | None = None) -> float:
    """Seconds per step of `carry = step(*carry)` chained in one jitted program, cycling through
    `rotate` independent copies of the carry (default: `rotation(carry)`).

    Two programs, of `steps` and `2 * steps` steps, are called alternately `repeats` times each;
    the time per step is the difference of their medians over `steps`, so the fixed cost of a call
    (dispatch and synchronize, ~0.1 ms: 2.5 us a step at 40 steps, a quarter of a 10 us kernel)
    cancels. Launch gaps between the kernels of a step stay in, as in a training step."""
    r = rotation(carry) if rotate is None else rotate
    carries = tuple([tuple(carry)] + [tuple(jax.tree.map(jnp.copy, tuple(carry))) for _ in range(r - 1)])
    fns = [jax.jit(chain(step, n, r)) for n in (steps, 2 * steps)]
    for fn in fns:
        for _ in range(3):
            jax.block_until_ready(fn(carries))
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(carries))
            ts.append(time.perf_counter() - t0)
    one, two = (statistics.median(ts) for ts in times)
    if two <= one:  # noise larger than `steps` steps: no difference to take
        print(f"warning: {2 * steps} steps timed no slower than {steps}; per-step time from the longer chain",
              file=sys.stderr)
        return two / (2 * steps)
    return (two - one) / steps


_COPY_S: dict[tuple[int, int, int], float] = {}



def chain_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every chained op benchmark takes: --out, --steps, --repeats (each adds its own after)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="append one JSON line per measurement to this file")
    ap.add_argument("--steps", type=int, default=40,
                    help="chained steps per timed call (fewer lets the per-call overhead inflate both times)")
    ap.add_argument("--repeats", type=int, default=20)
    return ap

def copy_seconds(nbytes: int, steps: int, repeats: int) -> float:
    """Seconds per step of an element-wise pass reading nbytes/2 and writing nbytes/2 (memoized)."""
    key = (nbytes, steps, repeats)
    if key not in _COPY_S:
        x = jnp.zeros(max(1, nbytes // 8), jnp.uint32)
        _COPY_S[key] = time_chain(lambda a: (a + jnp.uint32(1),), (x,), steps, repeats)
    return _COPY_S[key]


def commit() -> str:
    """The checkout's commit: $SUROGATE_COMMIT when set (the GPU machine's copy of the working tree carries a .git
    that may lag the tree: a run there once recorded an older commit), else a COMMIT file, else git."""
    if os.environ.get("SUROGATE_COMMIT"):
        return os.environ["SUROGATE_COMMIT"]
    f = pathlib.Path(__file__).resolve().parent.parent / "COMMIT"
    if f.is_file():
        return f.read_text().strip()
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def require_gpu(ffi_available) -> None:
    if jax.default_backend() != "gpu" or not ffi_available():
        print("error: needs a CUDA GPU and the built extension surogate_jax._ffi", file=sys.stderr)
        raise SystemExit(2)



def _cudart():
    """libcudart through ctypes (for cudaProfilerStart/Stop), or None: the pip CUDA packages first."""
    import ctypes
    import glob
    import os
    import site

    roots = [*site.getsitepackages(), os.path.dirname(os.path.dirname(jax.__file__))]
    pattern = os.path.join("nvidia", "**", "libcudart.so*")
    cands = [f for r in roots for f in sorted(glob.glob(os.path.join(r, pattern), recursive=True))]
    cands += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


def profile_calls(call, calls: int) -> None:
    """Runs call() once to compile and warm up, then `calls` times inside a cudaProfilerStart/Stop
    range, so `ncu --profile-from-start off` sees only the measured kernels (profile_*.py)."""
    jax.block_until_ready(call())
    rt = _cudart()
    if rt is None:
        print("warning: libcudart not found, so no profiler range: run ncu without --profile-from-start off "
              "(it then also profiles the setup's kernels)")
    else:
        rt.cudaProfilerStart()
    for _ in range(calls):
        jax.block_until_ready(call())
    if rt is not None:
        rt.cudaProfilerStop()


def time_calls(fn, inputs, k: int, repeats: int) -> float:
    """Seconds per call of fn over the first k, then 2k, of `inputs` (a list of argument tuples) in one program:
    for ops whose inputs never change between calls (a chain on one carry is no fair timing for them), K independent
    calls and 2K, the difference of the medians over K, so the fixed cost of a call cancels."""
    progs = [jax.jit(lambda ins: [fn(*i) for i in ins]) for _ in (0, 1)]
    sets = (inputs[:k], inputs[: 2 * k])
    for prog, ins in zip(progs, sets, strict=True):
        for _ in range(3):
            jax.block_until_ready(prog(ins))
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for prog, ins, ts in zip(progs, sets, times, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(prog(ins))
            ts.append(time.perf_counter() - t0)
    one, two = (statistics.median(ts) for ts in times)
    return (two - one) / k


class Table:
    """Prints the compact markdown table and collects JSON records."""

    def __init__(self, op: str, steps: int, repeats: int, variant: str = ""):
        self.meta = {
            "op": op,
            "variant": variant,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "commit": commit(),
            "steps": steps,
            "repeats": repeats,
        }
        self.records: list[dict] = []
        self._flagged = False  # the "(!)" legend is printed once
        m = self.meta
        print(f"# {op}{' (' + variant + ')' if variant else ''} on {m['device']}, jax {m['jax']}, "
              f"commit {m['commit']}, {m['date']}")
        print("| shape | dtype | pass | ours us | xla us | xla/ours | ours GB/s | % of 3000 | % of copy |")
        print("|---|---|---|---|---|---|---|---|---|")

    def add(self, shape: str, dtype: str, pass_: str, ours_s: float, xla_s: float, nbytes: int,
            copy_s: float | None = None):
        """copy_s: a same-size copy's seconds (measured here when None)."""
        if copy_s is None:
            copy_s = copy_seconds(nbytes, self.meta["steps"], self.meta["repeats"])
        gbs = nbytes / ours_s / 1e9
        rec = {**self.meta, "shape": shape, "dtype": dtype, "pass": pass_, "ours_us": ours_s * 1e6,
               "xla_us": xla_s * 1e6, "speedup_vs_xla": xla_s / ours_s, "bytes": nbytes,
               "ours_gbs": gbs, "xla_gbs": nbytes / xla_s / 1e9, "pct_peak": 100 * gbs / PEAK_GBS,
               "copy_us": copy_s * 1e6, "pct_copy": 100 * copy_s / ours_s}
        # A copy or op "faster" than the DRAM allows was timed with L2 hits or a biased difference of
        # chains (profile/calibrate_opbench.py: copies of <= 34 MB a step read 4.6-46 TB/s): say so in the row.
        rec["above_dram_peak"] = max(gbs, nbytes / copy_s / 1e9, rec["xla_gbs"]) > DRAM_PEAK_GBS
        self.records.append(rec)
        flag = " (!)" if rec["above_dram_peak"] else ""
        if flag and not self._flagged:
            self._flagged = True
            print(f"(!): ours, XLA's or the copy's bytes/s above the DRAM peak ({DRAM_PEAK_GBS:.0f} GB/s): "
                  "not a DRAM-bound timing; see benchmarks/profile/calibrate_opbench.py", file=sys.stderr)
        print(f"| {shape} | {dtype} | {pass_} | {rec['ours_us']:.1f} | {rec['xla_us']:.1f} | "
              f"{rec['speedup_vs_xla']:.2f}x | {gbs:.0f} | {rec['pct_peak']:.0f}% | {rec['pct_copy']:.0f}%{flag} |",
              flush=True)

    def add_passes(self, shape: str, dtype: str, times: dict, nbytes: dict):
        """times[pass] = (ours_s, xla_s) for "fwd" and "bwd"; adds those and their sum."""
        m = self.meta
        copy = {p: copy_seconds(nbytes[p], m["steps"], m["repeats"]) for p in ("fwd", "bwd")}
        for p in ("fwd", "bwd"):
            self.add(shape, dtype, p, *times[p], nbytes[p], copy[p])
        self.add(shape, dtype, "fwd+bwd", times["fwd"][0] + times["bwd"][0],
                 times["fwd"][1] + times["bwd"][1], nbytes["fwd"] + nbytes["bwd"],
                 copy["fwd"] + copy["bwd"])

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "a") as f:
                for rec in self.records:
                    f.write(json.dumps(rec) + "\n")


def append_jsonl(path: str | None, records: list[dict]) -> None:
    """Append one json line per record to `path` (--out); nothing when path is None."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)
