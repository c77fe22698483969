// SwiGLU with the gate/up LoRA updates computed in-kernel (framework-free launchers;
// ffi/swiglu_lora.cc binds them to XLA). The projections' frozen GEMM output and the rank-R LoRA
// factors come in separately, so neither gate nor up is ever written to memory:
//
//   gate, up   [rows, F] each, row stride ld: the base GEMM's outputs, either one buffer
//              x @ [W_gate | W_up] (up = gate + F, ld = 2F) or two (ld = F)
//   xa      [rows, 2R]   [x @ A_gate | x @ A_up]        (LoRA down-projections, after dropout)
//   lora_b  [2, R, F]    (B_gate, B_up)
//   gate' = round(gate + round(round(xa_g @ B_gate) * scale)),  up' likewise     (each round: to T)
//
//   forward : h = silu(gate') * up'                                -> h [rows, F] (row stride F)
//   backward: dh [rows, F] (plus dh2 [rows, F] when not null: h's gradient arriving in two parts,
//             summed and rounded to T like autodiff's add) -> dgate, dup [rows, F] each, row
//             stride ld_out (one buffer dgate_up: dup = dgate + F, ld_out = 2F; or two: ld_out =
//             F), s = sigmoid(gate'), dgate = dh * up' * s * (1 + gate' * (1 - s)),  dup = dh *
//             gate' * s
// The roundings mirror the model's unfused Linear (`y + ((xa @ B) * scale).astype(T)`); the LoRA
// weight/input gradients (GEMMs over dgate_up) are left to XLA (ops/swiglu_lora.py).
//
// T is float, __nv_bfloat16 or __half. Launchers enqueue on `stream`, never synchronize, and
// return the first CUDA error (cudaSuccess otherwise). R >= 1, any F >= 1, ld and ld_out >= F (F,
// ld, ld_out % 8 == 0 and 16-byte aligned pointers take the vector path).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace surogate {

template <typename T>
cudaError_t swiglu_lora_fwd(const T* gate, const T* up, int64_t ld, const T* xa, const T* lora_b,
                            T* h, int64_t rows, int64_t F, int64_t R, float scale,
                            cudaStream_t stream);

template <typename T>
cudaError_t swiglu_lora_bwd(const T* dh, const T* dh2, const T* gate, const T* up, int64_t ld,
                            const T* xa, const T* lora_b, T* dgate, T* dup, int64_t ld_out,
                            int64_t rows, int64_t F, int64_t R, float scale, cudaStream_t stream);

}  // namespace surogate
