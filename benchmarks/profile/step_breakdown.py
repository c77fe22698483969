"""Where a train step's GPU time goes: the kernels of a jax.profiler trace (sft_throughput.py --trace DIR, two
steps) summed by class, per step, with the share of the step and the idle time between kernels.

    python3 benchmarks/profile/step_breakdown.py DIR [--steps 2] [--top 12] [--json out.json]

Classes by kernel name (first match): GEMM (cuBLAS/cuBLASLt/CUTLASS: nvjet, gemm, xmma, cutlass), attention
(cuDNN SDPA / flash), cross-entropy + LM head (our lm_head_ce), norm/RoPE/SwiGLU (our rms_norm, add_rms_norm, rope,
swiglu kernels), optimizer (adamw / normuon), FP8/NVFP4 quantization, other XLA fusions (element-wise, reductions,
transposes), copies. Idle = the steps' span minus the union of kernel intervals (launch gaps and host waits).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

CLASSES = [
    ("attention", r"sdpa|fmha|flash|attention|fprop|dgrad.*sdpa|cudnn"),
    ("cross-entropy + LM head", r"lm_head|cross_entropy|\bce_"),
    ("norm / RoPE / SwiGLU (ours)", r"rms_norm|rope|swiglu"),
    ("optimizer", r"adamw|normuon|8bit"),
    ("FP8 / NVFP4 quantization", r"amax|quantiz|e4m3|fp8|nvfp4|tile_dequant|nf4"),
    ("GEMM", r"nvjet|gemm|xmma|cutlass|cublas|wgmma|gemv"),
    ("copies", r"memcpy|memset|copy"),
    ("other XLA fusions", r"."),
]


def classify(name: str) -> str:
    low = name.lower()
    return next(c for c, pat in CLASSES if re.search(pat, low))


def load_events(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"{trace_dir}: no *.trace.json.gz (run sft_throughput.py --trace {trace_dir})")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and re.search(r"GPU|/device:", str(e.get("args", {}).get("name", "")))}
    # a GPU's threads: "Stream #N" (kernels and copies) beside "XLA Modules" / "XLA Ops" (HLO-level spans over them)
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in gpu_pids and str(e.get("args", {}).get("name", "")).startswith("Stream")}
    return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and "dur" in e]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args()
    kernels = load_events(a.trace_dir)
    if not kernels:
        raise SystemExit("no GPU kernel events in the trace")
    by_class, by_name = defaultdict(float), defaultdict(float)
    for e in kernels:
        by_class[classify(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    idle = span - busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    per_step = lambda us: us / a.steps / 1e3  # noqa: E731  (ms per step)
    print(f"{len(kernels)} kernel events; span {per_step(span):.1f} ms/step, idle {per_step(idle):.1f} ms/step")
    print("| class | ms/step | share of span |\n|---|---|---|")
    rows = sorted(by_class.items(), key=lambda kv: -kv[1])
    for c, us in rows:
        print(f"| {c} | {per_step(us):.1f} | {100 * us / span:.1f}% |")
    print(f"| idle (no kernel running) | {per_step(idle):.1f} | {100 * idle / span:.1f}% |")
    print(f"\ntop {a.top} kernels:")
    for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {per_step(us):7.2f} ms  [{classify(n)}] {n[:110]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"span_ms": per_step(span), "idle_ms": per_step(idle),
                                            "classes_ms": {c: per_step(us) for c, us in rows},
                                            "top": [(n, per_step(us)) for n, us in
                                                    sorted(by_name.items(), key=lambda kv: -kv[1])[:50]]}))


if __name__ == "__main__":
    main()
