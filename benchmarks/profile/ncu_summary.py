"""Per-call kernel-only sums from Nsight Compute CSV logs of the profile_*.py scripts.

    python3 benchmarks/profile/ncu_summary.py [--calls 3] LOG [LOG ...]

A LOG holds blocks that start with a line "=== <label>" followed by the output of
`ncu --csv --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
[,launch__grid_size,launch__block_size,launch__registers_per_thread] python3 benchmarks/profile/profile_X.py ...
--calls N` (benchmarks/gpu_session.sh ncu_ops writes such logs). Each block's kernels split evenly
into N calls (every call launches the same kernels); printed per block: each call's summed duration,
the last call's DRAM bytes, and its kernels' launch shapes.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def summarize(text: str, calls: int) -> list[dict]:
    """One dict per "=== label" block: label, us (per call), read_mb, write_mb, kernels (launch shapes)."""
    out = []
    for block in re.split(r"^=== ", text, flags=re.M)[1:]:
        label, _, rest = block.partition("\n")
        rows = [ln for ln in rest.splitlines() if ln.startswith('"')]
        kernels: dict[tuple[str, str], dict[str, str]] = {}
        for r in csv.DictReader(io.StringIO("\n".join(rows))):
            kernels.setdefault((r["ID"], r["Kernel Name"]), {})[r["Metric Name"]] = r["Metric Value"]
        items = list(kernels.items())
        if not items or len(items) % calls:
            out.append({"label": label.strip(), "error": f"{len(items)} kernels do not split into {calls} calls"})
            continue
        per = len(items) // calls
        chunks = [items[c * per:(c + 1) * per] for c in range(calls)]
        last = chunks[-1]
        out.append({
            "label": label.strip(),
            "us": [sum(_num(m["gpu__time_duration.sum"]) for _, m in ch) / 1e3 for ch in chunks],
            "read_mb": sum(_num(m.get("dram__bytes_read.sum", "0")) for _, m in last) / 1e6,
            "write_mb": sum(_num(m.get("dram__bytes_write.sum", "0")) for _, m in last) / 1e6,
            "kernels": [f"{name[:40]} grid {m.get('launch__grid_size', '?')} block {m.get('launch__block_size', '?')} "
                        f"regs {m.get('launch__registers_per_thread', '?')}" for (_, name), m in last],
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--calls", type=int, default=3, help="--calls the profile script ran with")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    for path in args.logs:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
        for s in summarize(text, args.calls):
            if "error" in s:
                print(f"{s['label']:44s} error: {s['error']}")
                continue
            us = " / ".join(f"{t:.1f}" for t in s["us"])
            print(f"{s['label']:44s} {us} us  read {s['read_mb']:.1f} MB  write {s['write_mb']:.1f} MB  | "
                  + "; ".join(s["kernels"]))

if __name__ == "__main__":
    main()
