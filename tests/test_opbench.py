"""benchmarks/_opbench.py's pure parts (the timing itself needs a GPU): how many input copies a
timed chain cycles through, and that the chain applies every step to the right copy; and
benchmarks/profile/ncu_summary.py's per-call sums of Nsight Compute CSV logs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture
def ob(benchmark_module):
    return benchmark_module("_opbench")


def test_rotation_reads_a_multiple_of_the_l2_per_round(ob):
    mb = 2**20
    assert ob.rotation((jnp.zeros(mb // 4, jnp.float32),), l2_bytes=10 * mb, cap=64, multiple=2) == 20
    # two leaves of 3 MB: 6 MB a copy, ceil(20 / 6) = 4 copies; ceil(80 / 6) = 14 at 8x
    two = (jnp.zeros(3 * mb // 2, jnp.bfloat16), jnp.zeros(3 * mb, jnp.int8))
    assert ob.rotation(two, l2_bytes=10 * mb, cap=64, multiple=2) == 4
    assert ob.rotation(two, l2_bytes=10 * mb, cap=64, multiple=8) == 14
    assert ob.rotation((jnp.zeros(mb // 4, jnp.float32),), l2_bytes=10 * mb, cap=8) == 8
    assert ob.rotation((jnp.zeros(8 * mb, jnp.float32),), l2_bytes=10 * mb, multiple=2) == 1
    assert ob.rotation((jnp.zeros(mb // 4, jnp.float32),), l2_bytes=mb) == ob.L2_MULTIPLE


@pytest.mark.parametrize("steps,r", [(10, 3), (40, 1), (7, 7), (5, 8)])
def test_chain_cycles_the_copies(ob, steps, r):
    run = jax.jit(ob.chain(lambda c, k: (c + k, k), steps, r))
    out = run(tuple((jnp.zeros(()), jnp.float32(j + 1)) for j in range(r)))
    for j, (c, k) in enumerate(out):  # copy j took every step i with i % r == j
        assert float(k) == j + 1
        assert float(c) == (j + 1) * len(range(j, steps, r))


def test_time_chain_runs_on_any_backend(ob):
    t = ob.time_chain(lambda x: (x * 2.0,), (jnp.ones((64,)),), steps=4, repeats=2, rotate=3)
    assert t > 0


def test_rows_faster_than_the_dram_are_marked(ob, capsys):
    t = ob.Table("x", steps=40, repeats=2)
    gb = 10**9
    t.add("ok", "bf16", "fwd", ours_s=1e-3, xla_s=2e-3, nbytes=gb, copy_s=0.5e-3)  # 1000 / 500 / 2000 GB/s
    t.add("l2", "bf16", "fwd", ours_s=1e-3, xla_s=2e-3, nbytes=gb, copy_s=0.25e-3)  # copy at 4000 GB/s
    assert [r["above_dram_peak"] for r in t.records] == [False, True]
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ok") or ln.startswith("| l2")]
    assert "(!)" not in rows[0] and "(!)" in rows[1]


NCU_LOG = '''# a header line
=== ours fwd
some script output
"ID","Kernel Name","Metric Name","Metric Value"
"0","k_a","gpu__time_duration.sum","1,500"
"0","k_a","dram__bytes_read.sum","2,000,000"
"0","k_a","dram__bytes_write.sum","1,000,000"
"1","k_b","gpu__time_duration.sum","500"
"1","k_b","dram__bytes_read.sum","0"
"1","k_b","dram__bytes_write.sum","0"
"2","k_a","gpu__time_duration.sum","1,400"
"2","k_a","dram__bytes_read.sum","3,000,000"
"2","k_a","dram__bytes_write.sum","1,000,000"
"3","k_b","gpu__time_duration.sum","600"
"3","k_b","dram__bytes_read.sum","1,000,000"
"3","k_b","dram__bytes_write.sum","0"
=== broken
"ID","Kernel Name","Metric Name","Metric Value"
"0","k_a","gpu__time_duration.sum","1,000"
'''


def test_ncu_summary_sums_each_call(benchmark_module):
    """Two calls of two kernels each: per-call sums of durations (us), the last call's DRAM MB; a
    block whose kernels do not split into the calls is reported, not mis-summed."""
    ncu = benchmark_module("profile/ncu_summary")
    ours, broken = ncu.summarize(NCU_LOG, calls=2)
    assert ours["label"] == "ours fwd"
    assert ours["us"] == [2.0, 2.0]
    assert ours["read_mb"] == 4.0 and ours["write_mb"] == 1.0
    assert len(ours["kernels"]) == 2
    assert broken["label"] == "broken" and "do not split" in broken["error"]
