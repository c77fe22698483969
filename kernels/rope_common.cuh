// Shared pieces of the RoPE kernels (rope_fwd.cu: forward and rotation-only backward; rope_bwd.cu:
// the norm backward), optionally fused with the per-head RMSNorm in front of it (Qwen3's q_norm /
// k_norm). Math and launcher contract: rope.h. Internal to those two files.
//
// Floor: memory bound. Bytes that must move per call = rows * K * sizeof(T) * (2 forward: read
// x, write y; 2 for the rotation-only backward: read dy, write dx; 3 for the norm backward: read
// dy and x, write dx) + the angle source: 4 bytes per token (positions mode) or 2 * 4 * F per
// token (table mode; typically L2 hits when q and k share it). FLOPs are ~10 per element plus
// one sincosf per (token, pair, row group) in positions mode, far below the bandwidth cost.
// At the H100's ~3.0 TB/s measured copy bandwidth, e.g. Qwen3-0.6B q [4, 2048, 16, 128] bf16:
// 2 * 33.5 MB -> ~22 us forward, ~34 us norm backward; Qwen3-8B q [2, 2048, 32, 128]: same sizes.
// Target: >= 75% of that, never slower than XLA's fusion of the reference (ops/rope.py).
//
// Design (why):
//  * A row (one head of one token, K = 64..256 typically) is owned by a group of `width` lanes
//    (power of two <= 32); a lane owns the same columns (a 16-byte vector in each half, j and
//    j + F, so the rotation pairs meet in one thread) for every row it touches; the norm's sum of
//    squares is a shuffle reduction inside the group (no barriers, no shared memory).
//  * The work unit of a group is U consecutive heads of one token (forward U = 4, norm backward
//    U = 2: the fastest on the H100 at the benchmarked Qwen3 shapes; other unit sizes and a
//    persistent per-token grid measured slower, see git tag pre-cleanup). All U rows' loads are
//    issued before any math (more bytes in flight per thread), the token's cos/sin are computed
//    (sincosf) or read once per unit, and consecutive groups take consecutive units, so groups of
//    one token read the same angle entries (L1 broadcast).
//  * Rows are held packed (16-bit pairs share a register) between the reduction and the write
//    (one DRAM read), and w is re-read from L1, which keeps ~60-120 registers a thread: the
//    launch bounds ask for 4 resident 128-thread blocks per SM.
//  * The forward's grid is one-shot (one unit per group, grid-stride only beyond the grid
//    limit): the block scheduler balances. The norm backward's grid is as large as fits (and as
//    the dw workspace has rows), shrunk so that every group gets the same number of units.
//  * 16-byte vector loads/stores when F is a multiple of 16 / sizeof(T) and the pointers are
//    16-byte aligned; a scalar path otherwise (any even K up to rope_max_head_dim()). Longer rows
//    (vector path: K > 512 in 16-bit, K > 256 in fp32; scalar path: K > 64) get more chunks per
//    lane (make_plan) and no register cap.
//  * Norm backward: rstd is recomputed from x (x is read anyway), so the forward saves nothing.
//    dw: every lane accumulates fp32 partials of its own columns in registers over all its rows,
//    the block combines them (shuffles across groups, shared memory across warps) into one
//    workspace row, and a second small kernel sums the rows over blocks. No atomics, so results
//    are deterministic.
//  * The forward's fused norm is a runtime switch (w != nullptr), not a template flag: the branch
//    is uniform over the grid and taken per row chunk, outside the per-element math, and the kernel
//    needs no more registers than a norm-only instantiation (same resident blocks per SM; nvcc 13,
//    sm_90a), at half the code to compile.
//  * q and k of a layer (rope_*_pair) run in one launch each way, blocks split between the two
//    tensors: one launch instead of two saves the second launch's ramp, which dominated the small
//    k tensors (8 MB at Qwen3-8B).
#pragma once

#include <climits>
#include <cstdint>
#include <initializer_list>

#include "kernels/device_common.cuh"
#include "kernels/rope.h"

namespace surogate {
namespace {  // internal linkage: each including .cu gets its own copy

constexpr int kWarp = 32;
constexpr int kThreads = 128;  // small blocks: finer occupancy steps at ~100 registers
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int kFwdHeads = 4;  // heads per work unit (U), forward
constexpr int kBwdHeads = 2;  // heads per work unit (U), norm backward

// How lanes map onto rows: a warp holds 32 / width groups of `width` lanes, one row each.
struct Layout {
  int half;         // F = K / 2
  int nchunks;      // F / V: vectors per half row
  int width;        // lanes per group
  bool table_vec4;  // table rows can be read as float4 (16-byte aligned, stride % 4 == 0)
};

// Chunk (vector index within a half row) i of this lane.
__device__ __forceinline__ int lane_chunk(int lane, int i, const Layout& L) {
  return lane + i * L.width;
}

__device__ __forceinline__ float group_sum(float v, unsigned mask, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);  // stays in group
  return v;
}

// This thread's place: `lane` in its group `group` (of `groups` per warp), the group's shuffle
// mask.
struct Place {
  int lane, group, groups;
  unsigned mask;
};

__device__ __forceinline__ Place place_of(const Layout& L) {
  Place p;
  const int lw = static_cast<int>(threadIdx.x) % kWarp;
  p.groups = kWarp / L.width;
  p.lane = lw % L.width;
  p.group = lw / L.width;
  p.mask = L.width == kWarp ? 0xffffffffu : ((1u << L.width) - 1u) << (p.group * L.width);
  return p;
}

// cos and sgn * sin of this lane's pairs for token `tok`.
template <int V, int PER>
__device__ __forceinline__ void token_angles(const RopeAngles& a, int64_t tok, int lane,
                                             const Layout& L, float sgn, float (&c)[PER][V],
                                             float (&s)[PER][V]) {
  if (a.positions != nullptr) {
    const float p = static_cast<float>(a.positions[tok]);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int ch = lane_chunk(lane, i, L);
      if (ch < L.nchunks) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float sv, cv;
          sincosf(p * a.inv_freq[ch * V + k], &sv, &cv);
          c[i][k] = cv;
          s[i][k] = sgn * sv;
        }
      }
    }
  } else {
    const float* cp = a.cos + tok * a.stride;
    const float* sp = a.sin + tok * a.stride;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int ch = lane_chunk(lane, i, L);
      if (ch < L.nchunks) {
        if constexpr (V % 4 == 0) {
          if (L.table_vec4) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
              const float4 cv = *reinterpret_cast<const float4*>(cp + ch * V + k);
              const float4 sv = *reinterpret_cast<const float4*>(sp + ch * V + k);
              c[i][k] = cv.x, c[i][k + 1] = cv.y, c[i][k + 2] = cv.z, c[i][k + 3] = cv.w;
              s[i][k] = sgn * sv.x, s[i][k + 1] = sgn * sv.y, s[i][k + 2] = sgn * sv.z,
              s[i][k + 3] = sgn * sv.w;
            }
            continue;
          }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          c[i][k] = cp[ch * V + k];
          s[i][k] = sgn * sp[ch * V + k];
        }
      }
    }
  }
}

// Resident 128-thread blocks per SM asked of ptxas: 4 (128 registers) for rows of one chunk per
// lane; long rows (PER > 1) keep their registers rather than spill.
template <int PER>
constexpr int min_blocks() {
  return PER > 1 ? 1 : 4;
}

// ---------------------------------------------------------------------------------------------
// Host side: launch plans.

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

constexpr int kMaxPerScalar = 16;  // chunks per lane: scalar path instantiates 1, 4, 16
constexpr int kMaxPerVector = 4;   // vector path: 1, 4

struct Plan {
  int vec = 1;
  int per = 1;  // chunks per lane the kernel is instantiated for
  Layout L{};
  int blocks = 0;
  size_t smem = 0;
};

template <typename T>
int pick_vec(int64_t half, std::initializer_list<const void*> ptrs) {
  if (half % kVec<T> != 0) return 1;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVec<T>;
}

// Chunks per lane: 1 up to K = 512 (16-bit) / 256 (fp32) on the vector path and K = 64 on the
// scalar path, more beyond. false when head_dim is too large for the register-resident rows.
inline bool make_plan(int64_t half, int vec, Plan* out) {
  Plan p;
  p.vec = vec;
  const int nchunks = static_cast<int>(half / vec);
  int width = 1;
  while (width < nchunks && width < kWarp) width *= 2;
  const int need = (nchunks + width - 1) / width;
  if (vec == 1) {
    p.per = need <= 1 ? 1 : need <= 4 ? 4 : kMaxPerScalar;
  } else {
    p.per = need <= 1 ? 1 : kMaxPerVector;
  }
  if (need > p.per) return false;
  p.L.half = static_cast<int>(half);
  p.L.nchunks = nchunks;
  p.L.width = width;
  p.L.table_vec4 = false;
  *out = p;
  return true;
}

// Lane groups per block, and blocks for tokens * ceil(heads / U) work units, one per group.
inline int64_t groups_per_block(const Plan& p) {
  return static_cast<int64_t>(kWarpsPerBlock) * (kWarp / p.L.width);
}

inline int64_t unit_blocks(int64_t tokens, int64_t heads, int64_t U, const Plan& p) {
  const int64_t per_block = groups_per_block(p);
  return (tokens * ((heads + U - 1) / U) + per_block - 1) / per_block;
}

inline cudaError_t check_args(const RopeAngles& ang, int64_t tokens, int64_t heads,
                              int64_t head_dim) {
  if (tokens < 0 || heads <= 0 || heads > INT_MAX || head_dim <= 0 || head_dim % 2 != 0 ||
      head_dim > rope_max_head_dim()) {
    return cudaErrorInvalidValue;
  }
  const bool by_pos = ang.positions != nullptr && ang.inv_freq != nullptr;
  const bool by_table = ang.cos != nullptr && ang.sin != nullptr && ang.stride >= head_dim / 2;
  if (by_pos == by_table && tokens > 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// The angle source as the kernels read it (positions mode clears the table pointers); sets the
// plan's table_vec4.
inline RopeAngles kernel_angles(const RopeAngles& ang, Plan* p) {
  RopeAngles a = ang;
  if (a.positions != nullptr) a.cos = a.sin = nullptr;
  p->L.table_vec4 = a.cos != nullptr && a.stride % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(a.cos) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.sin) % 16 == 0;
  return a;
}

}  // namespace
}  // namespace surogate
