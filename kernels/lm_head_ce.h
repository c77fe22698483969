// Cross-entropy over rows of LM-head logits (framework-free launchers; ffi/lm_head_ce.cc binds them
// to XLA, surogate_jax/ops/lm_head_ce.py runs them chunk by chunk between the cuBLAS GEMMs).
//
// Per row r of logits x [rows, V] with target t = targets[r], weight w = weights[r], z = z_loss:
//   w == 0            : loss[r] = lse[r] = 0, dlogits row = 0; the row's logits are not read.
//   t outside [0, V)  : loss[r] = lse[r] = NaN, dlogits row = NaN (a data bug made visible).
//   otherwise         : lse = log(sum_j exp(x_j)), loss[r] = w * (lse - x_t + z * lse^2)
//                       dlogits[r, j] = w * (exp(x_j - lse) * (1 + 2 z lse) - [j == t])
// Math in fp32; dlogits rounded once to TOut. TIn / TOut are float, __nv_bfloat16 or __half.
// dlogits may alias logits when TIn == TOut (in place: every element is read before it is
// written, by the same thread). Launchers enqueue on `stream`, never synchronize, and return the
// first CUDA error (cudaSuccess otherwise). Deterministic (no atomics).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

// loss and lse only (no gradient): one pass over each row.
template <typename TIn>
cudaError_t lm_head_ce_loss(const TIn* logits, const int32_t* targets, const float* weights,
                            float* loss, float* lse, int64_t rows, int64_t vocab, float z_loss,
                            cudaStream_t stream);

// Which gradient kernel runs. kAuto: on compute capability >= 9.0, rows of >= 512 vectors that
// fit 8 x 100 KB of shared memory use the single-read cluster kernel (each logit read once from
// DRAM); everything else the two-pass kernel (the row is read twice). kTwoPass forces the latter:
// the op's kernel="two_pass", what pre-Hopper GPUs run (tests and benchmarks compare them).
enum class LmHeadCeAlgo : int { kAuto = 0, kTwoPass = 1 };

// loss, lse and dlogits.
template <typename TIn, typename TOut>
cudaError_t lm_head_ce_grad(const TIn* logits, const int32_t* targets, const float* weights,
                            float* loss, float* lse, TOut* dlogits, int64_t rows, int64_t vocab,
                            float z_loss, LmHeadCeAlgo algo, cudaStream_t stream);

}  // namespace surogate
