// Shared pieces of the expert row kernels (expert_activation.cu, expert_bias.cu): the row -> expert
// lookup, bf16 vector loads/stores, the launch shape, and the host-side validation of the common
// arguments (probs, expert_offsets). Private to src/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "flexep/core/checks.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::detail {

using bf16_t = __nv_bfloat16;

// ---------------------------------------------------------------- device side

// The expert of a row: the e in [0, E) with offsets[e] <= row < offsets[e + 1] (empty experts are
// skipped because their two offsets are equal). The answer is in [0, E) whatever `offsets` holds, so
// a caller indexing with it never leaves the bias tensor.
__device__ inline int find_expert(const std::int64_t* offsets, int num_experts, std::int64_t row) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (offsets[mid + 1] > row) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Number of active rows: offsets[E] clamped to [0, rows] (all rows without offsets).
__device__ inline std::int64_t active_rows(const std::int64_t* offsets, int num_experts, std::int64_t rows) {
  if (offsets == nullptr) return rows;
  const std::int64_t a = offsets[num_experts];
  return a < 0 ? 0 : (a > rows ? rows : a);
}

// N consecutive bf16 values to/from fp32. N a multiple of 8: 16-byte accesses (the pointer must be
// 16-byte aligned, which the host guarantees before choosing the vector path); otherwise scalar.
template <int N>
__device__ inline void load_bf16(const bf16_t* p, float (&out)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      __nv_bfloat162 h2[4];
      memcpy(h2, &raw, sizeof raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h2[j]);
        out[8 * c + 2 * j] = f.x;
        out[8 * c + 2 * j + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = __bfloat162float(p[j]);
  }
}

template <int N>
__device__ inline void store_bf16(bf16_t* p, const float (&in)[N]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      __nv_bfloat162 h2[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) h2[j] = __floats2bfloat162_rn(in[8 * c + 2 * j], in[8 * c + 2 * j + 1]);
      uint4 raw;
      memcpy(&raw, h2, sizeof raw);
      reinterpret_cast<uint4*>(p)[c] = raw;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = __float2bfloat16_rn(in[j]);
  }
}

__device__ inline float warp_sum(float v) {
  // Butterfly: every lane ends with the same total, added in a fixed order (deterministic).
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
  return v;
}

// ---------------------------------------------------------------- host side

constexpr int kRowThreads = 256;  // one warp per row, 8 rows per block
constexpr int kWarpsPerBlock = kRowThreads / 32;

// Blocks for a warp-per-row kernel over `rows` rows (grid-stride beyond that).
inline int row_blocks(std::int64_t rows, int device) {
  const std::int64_t need = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const std::int64_t cap = static_cast<std::int64_t>(sm_count(device)) * 16;
  return static_cast<int>(std::max<std::int64_t>(1, std::min(need, cap)));
}

inline bool aligned16(const TensorView& t) {
  return !t.defined() || reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
}

// A CUDA bf16 tensor of shape [rows, cols] (rows = -1: any).
inline void check_matrix(const TensorView& t, std::int64_t rows, std::int64_t cols, DType dtype, const char* arg) {
  check::shape(t, {rows, cols}, arg);
  check::dtype(t, {dtype}, arg);
  FLEXEP_CHECK_ARG(t.device.is_cuda(), arg, "must be a CUDA tensor, got one on ", t.device.str());
}

// Validates the optional probs [rows] f32 and expert_offsets [E + 1] i64 (both on `device`) and
// returns E (1 when offsets are undefined).
inline int check_rows_args(const TensorView& probs, const TensorView& offsets, std::int64_t rows, Device device,
                           const char* probs_arg = "probs") {
  if (probs.defined()) {
    check::shape(probs, {rows}, probs_arg);
    check::dtype(probs, {DType::f32}, probs_arg);
    check::device(probs, device, probs_arg);
  }
  if (!offsets.defined()) return 1;
  check::rank(offsets, 1, "expert_offsets");
  check::dtype(offsets, {DType::i64}, "expert_offsets");
  check::device(offsets, device, "expert_offsets");
  // 65535: the column-sum kernel puts experts on gridDim.z.
  FLEXEP_CHECK_ARG(offsets.size(0) >= 2 && offsets.size(0) - 1 <= 65535, "expert_offsets",
                   "must hold E + 1 entries with 1 <= E <= 65535, got shape ", offsets.shape.str());
  return static_cast<int>(offsets.size(0) - 1);
}

}  // namespace flexep::cuda::detail
