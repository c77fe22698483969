#!/usr/bin/env bash
# One device-machine call: build the CUDA extension, run a GPU test suite, then the benchmarks; full
# logs land in $OUT (at most 8 files come back).
#   run: [SUITE=quick|full|none] bash benchmarks/gpu_session.sh [bench ...]
#   SUITE=quick (default): the first cases of every GPU test (each kernel's forward and gradients against its
#     reference; pytest --quick), <= 5 min on one H100.  SUITE=full: tests/gpu and tests/models on the GPU,
#     every case, over 10 min (tests/ops are the ops' CPU-reference tests, which CI runs); a device call is capped
#     at 10 min, so SUITE=full-1, full-2 and full-3 run its three disjoint parts (the element-wise and optimizer
#     kernels; the GEMM and quantizer kernels; the models, recipes, QLoRA and parallel tests with tests/models),
#     each timed: the full suite's time is their sum.  All run as $WORKERS
#     pytest-xdist workers sharing the GPU (default 8 for quick, 14 for full: the suites are bound by XLA
#     compilation, one core per worker, and the machine has 16).
#   benches (default: none; benchmarks/README.md says what each measures):
#     op benchmarks: rms_norm, add_rms_norm, rope, swiglu, swiglu_lora, lm_head_ce, fp8_matmul,
#       nvfp4_quantize, nvfp4_matmul, adamw_8bit, normuon, nf4_dequantize, tile_dequantize, grouped_matmul,
#       selective_dequant
#     model: forward, sft:<size>[,<size>...] (one fresh process per size; SFT_ARGS="--qlora bnb ..." adds flags;
#       SFT_VARIANTS="--max-segments 0|--max-segments -1" runs each size once per '|'-separated flag set: an A/B),
#       peer:<size>[,<size>...] (the HF transformers + PEFT peer, without then with gradient checkpointing),
#       cli:<size>[,<size>...] (the trainer's CLI, its logged tokens/s; CLI_ARGS="--recipe fp8-hybrid ..." adds flags)
#     profilers: calibrate (the op-bench timing checked on a copy), ncu_rope (Nsight Compute on the
#       RoPE kernels), ncu_ops (kernel-only ours / XLA / same-bytes copy for rope_qk, swiglu, the
#       norms), ncu_swiglu_lora (the same for swiglu_lora, both forms)
# The GPU image has jax + CUDA 13, nanobind, scikit-build-core, cmake, ninja, nvcc and pytest-xdist, and no
# network: we install with --no-deps --no-build-isolation into its python3 and build only sm_90a (Hopper).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
B=benchmarks; P=benchmarks/profile
SUITE="${SUITE:-quick}"; WORKERS="${WORKERS:-$([[ $SUITE == full* ]] && echo 14 || echo 8)}"
benches=("$@")
part1=(rope rope_qk rms_norm add_rms_norm swiglu swiglu_lora adamw_8bit normuon nf4_dequantize tile_dequantize
       selective_dequant)
part2=(fp8_matmul nvfp4_matmul nvfp4_quantize lm_head_ce grouped_matmul)
part3=(models parallel qlora recipe attention)
files() { for n in "$@"; do echo "tests/gpu/test_${n}_gpu.py"; done; }
for f in tests/gpu/test_*_gpu.py; do  # a new GPU test file must join a part, or SUITE=full-N would miss it
  grep -qx "$f" <(files "${part1[@]}" "${part2[@]}" "${part3[@]}") || { echo "$f is in no part of gpu_session.sh"; exit 2; }
done
case "$SUITE" in quick|full|full-1|full-2|full-3|none) ;;  # checked before any work
  *) echo "SUITE=$SUITE: use quick, full, full-1, full-2, full-3 or none"; exit 2 ;;
esac
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "commit ${SUROGATE_COMMIT:-unknown} (set SUROGATE_COMMIT=\$(git rev-parse HEAD) when calling)"; date -u
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/env.txt"

t0=$SECONDS
python3 -m pip install -v --no-deps --no-build-isolation -e . \
  -Ccmake.define.SUROGATE_JAX_REQUIRE_CUDA=ON -Ccmake.define.SUROGATE_JAX_CUDA_ARCHS=90a \
  > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
python3 -c 'import surogate_jax._ffi as m; print("extension:", m.__file__, sorted(m.registrations()))' \
  | tee -a "$OUT/env.txt"

tests_rc=0
case "$SUITE" in
  quick) suite_args=(--quick tests/gpu) ;;
  full) suite_args=(tests/gpu tests/models) ;;
  full-1) mapfile -t suite_args < <(files "${part1[@]}") ;;
  full-2) mapfile -t suite_args < <(files "${part2[@]}") ;;
  full-3) mapfile -t suite_args < <(files "${part3[@]}"); suite_args+=(tests/models) ;;
  none) suite_args=() ;;
  *) echo "SUITE=$SUITE: use quick, full, full-1, full-2, full-3 or none"; exit 2 ;;
esac
if (( ${#suite_args[@]} )); then
  t0=$SECONDS
  python3 -m pytest -v -rs -n "$WORKERS" --durations=25 -p no:cacheprovider "${suite_args[@]}" 2>&1 | tee "$OUT/tests.log" | tail -25
  tests_rc=${PIPESTATUS[0]}
  echo "suite $SUITE: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
fi

op_bench() {  # op_bench OP TAIL: bench_<op>.py's json and log in $OUT, the last TAIL lines shown
  python3 "$B/bench_$1.py" --out "$OUT/bench_$1.json" 2>&1 | tee "$OUT/bench_$1.log" | tail -"$2"
}
NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
NCU_METRICS+=,launch__grid_size,launch__block_size,launch__registers_per_thread
NCU="ncu --profile-from-start off --clock-control none --print-units base --csv --metrics $NCU_METRICS"

for b in "${benches[@]}"; do
  case "$b" in
    rms_norm) op_bench rms_norm 40 ;;
    add_rms_norm) op_bench add_rms_norm 32 ;;
    rope) op_bench rope 40 ;;
    swiglu) op_bench swiglu 20 ;;
    swiglu_lora) op_bench swiglu_lora 20 ;;
    lm_head_ce) op_bench lm_head_ce 80 ;;
    fp8_matmul) op_bench fp8_matmul 40 ;;
    nvfp4_quantize) op_bench nvfp4_quantize 16 ;;
    nvfp4_matmul) op_bench nvfp4_matmul 20 ;;
    adamw_8bit) op_bench adamw_8bit 48 ;;
    normuon) op_bench normuon 16 ;;
    nf4_dequantize) op_bench nf4_dequantize 20 ;;
    tile_dequantize) op_bench tile_dequantize 30 ;;
    grouped_matmul) op_bench grouped_matmul 24 ;;
    selective_dequant) op_bench selective_dequant 40 ;;
    ncu_rope) for c in "0.6b q|bwd|positions" "0.6b q|bwd|table" "0.6b k|bwd|positions" "8b k|bwd|table" \
                       "0.6b q|fwd|positions"; do
                IFS='|' read -r shp pas src <<< "$c"   # kernel-only durations, DRAM throughput, stall reasons
                ncu --clock-control none -k 'regex:rope|col_sum' --section SpeedOfLight \
                    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
                    --section SchedulerStats --section LaunchStats \
                    python3 "$P/profile_rope.py" --shape "$shp" --pass "$pas" --source "$src" --calls 2
              done > "$OUT/ncu_rope.log" 2>&1
              grep -E "profile_rope|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|^  [a-z_]+.*\(" \
                "$OUT/ncu_rope.log" | head -60 ;;
    ncu_ops) { for c in "0.6b qk" "8b qk"; do for p in fwd bwd; do for i in ffi xla copy; do  # ours / XLA / copy
                 echo "=== rope $c $p $i"
                 $NCU python3 "$P/profile_rope.py" --shape "$c" --pass $p --source table --impl $i --calls 3
               done; done; done
               for c in "16384x3072" "8192x17408"; do for p in fwd bwd; do for i in ffi xla; do
                 echo "=== swiglu $c $p $i"
                 $NCU python3 "$P/profile_swiglu.py" --shape $c --pass $p --impl $i --calls 3
               done; done; done
               for c in "rms_norm 16384x1024" "add_rms_norm 16384x1024" "rms_norm 262144x128"; do set -- $c
                 for p in fwd bwd; do for i in ffi xla copy; do
                   echo "=== $1 $2 $p $i"
                   $NCU python3 "$P/profile_norm.py" --op $1 --shape $2 --pass $p --impl $i --calls 3
                 done; done
               done; } > "$OUT/ncu_ops.log" 2>&1
             python3 "$P/ncu_summary.py" "$OUT/ncu_ops.log" | tee "$OUT/ncu_ops_summary.txt" ;;
    ncu_swiglu_lora) { for p in fwd bwd; do  # kernel-only at Qwen3-0.6B's shape, R = 16
                         for i in ffi xla copy; do
                           echo "=== swiglu_lora 4096x3072 $p $i packed"
                           $NCU python3 "$P/profile_swiglu_lora.py" --shape 4096x3072 --pass $p --impl $i --calls 3
                         done
                         echo "=== swiglu_lora 4096x3072 $p ffi sep"
                         $NCU python3 "$P/profile_swiglu_lora.py" --shape 4096x3072 --pass $p --impl ffi --form sep \
                           --calls 3
                       done; } > "$OUT/ncu_swiglu_lora.log" 2>&1
                     python3 "$P/ncu_summary.py" --calls 3 "$OUT/ncu_swiglu_lora.log" \
                       | tee "$OUT/ncu_swiglu_lora_summary.txt" ;;
    calibrate) python3 "$P/calibrate_opbench.py" 2>&1 | tee "$OUT/calibrate_opbench.log" | tail -16 ;;
    forward) for s in 0.6b 8b; do
               python3 "$B/bench_forward.py" --size $s --out "$OUT/forward_$s.json" 2>&1 | tail -30
             done ;;
    sft:*) sizes=${b#sft:}   # e.g. "sft:0.6b,1.7b": one fresh process per size (and per SFT_VARIANTS flag set)
           IFS='|' read -r -a variants <<< "${SFT_VARIANTS:-}"
           ((${#variants[@]})) || variants=("")
           for s in ${sizes//,/ }; do for v in "${variants[@]}"; do
             python3 "$B/sft_throughput.py" --size "$s" ${SFT_ARGS:-} $v --out "$OUT/sft_throughput.jsonl" 2>&1 | tail -2
           done; done ;;
    cli:*) sizes=${b#cli:}   # the trainer's CLI at the seed configuration (CLI_ARGS adds flags / key=value)
           for s in ${sizes//,/ }; do
             python3 "$B/cli_throughput.py" --size "$s" ${CLI_ARGS:-} --out "$OUT/cli_throughput.jsonl" 2>&1 | tail -1
           done ;;
    peer:*) sizes=${b#peer:}   # the HF+PEFT peer, one fresh process per size and checkpointing setting
            for s in ${sizes//,/ }; do for gc in "" --gradient-checkpointing; do
              python3 "$B/peer_hf_peft.py" --size "$s" $gc --out "$OUT/peer_hf_peft.jsonl" 2>&1 | tail -1
            done; done ;;
    *) echo "unknown bench $b" ;;
  esac
done
echo "tests exit code: $tests_rc"
exit $tests_rc
