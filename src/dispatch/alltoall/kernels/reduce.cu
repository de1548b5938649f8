// The two levels of the combine (docs/semantics.md), and the gather of prob gradients.
//   level 1, on the owner: per received row, its expert rows summed in fp32 in entry order
//            (= ascending local expert) starting from +0, rounded to bf16 once;
//   level 2, on the source: per token, the returned partials summed in fp32 over ascending owner
//            rank starting from +0, rounded to bf16 once.
// These are the host backend's operations in the host backend's order, so the results are equal
// bit for bit. Only additions: nothing for the compiler to contract into FMAs.
#include <cuda_bf16.h>

#include "dispatch/alltoall/device/block_rows.cuh"
#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

namespace {

__global__ void __launch_bounds__(kRowThreads)
    partial_sums_kernel(const __nv_bfloat16* expert_rows, const int* out_row, std::int64_t count, int meta_width,
                        std::int64_t hidden, __nv_bfloat16* partial, const float* grad_probs, float* ret_probs) {
  for (std::int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int* rows = out_row + i * meta_width;
    for (std::int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;
      bool any = false;
      for (int m = 0; m < meta_width; ++m) {
        const int r = rows[m];
        if (r < 0) continue;
        acc += __bfloat162float(expert_rows[static_cast<std::int64_t>(r) * hidden + h]);
        any = true;
      }
      // A row whose pairs were all dropped by the budget contributes nothing on the host (its
      // owner is skipped). Sending -0.0 makes the source's addition an exact identity
      // (x + -0 == x for every x, including x = -0), so no "skip" flag has to travel back.
      partial[i * hidden + h] = any ? __float2bfloat16_rn(acc) : __ushort_as_bfloat16(0x8000);
    }
    if (ret_probs)
      for (int m = threadIdx.x; m < meta_width; m += blockDim.x) {
        const int r = rows[m];
        ret_probs[i * meta_width + m] = r >= 0 ? grad_probs[r] : 0.0f;
      }
  }
}

__global__ void __launch_bounds__(kRowThreads)
    sum_partials_kernel(const __nv_bfloat16* partials, const int* send_pos, std::int64_t tokens, int ranks,
                        std::int64_t hidden, __nv_bfloat16* out) {
  for (std::int64_t t = blockIdx.x; t < tokens; t += gridDim.x)
    for (std::int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0.0f;
      for (int d = 0; d < ranks; ++d) {
        const int p = send_pos[static_cast<std::int64_t>(d) * tokens + t];
        if (p >= 0) acc += __bfloat162float(partials[static_cast<std::int64_t>(p) * hidden + h]);
      }
      out[t * hidden + h] = __float2bfloat16_rn(acc);
    }
}

__global__ void __launch_bounds__(kThreads)
    gather_weight_grads_kernel(const float* ret_probs, const int* slot_entry, const int* slot_expert,
                               std::int64_t tokens, int slots, bool multihot, float* out) {
  const std::int64_t n = tokens * slots, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int entry = slot_entry[i];
    const float g = entry >= 0 ? ret_probs[entry] : 0.0f;
    if (!multihot) {
      out[i] = g;
    } else {
      const int e = slot_expert[i];  // multihot: slots == E, so e indexes the row of [T, E]
      if (e >= 0 && e < slots) out[i / slots * slots + e] = g;
    }
  }
}

}  // namespace

void launch_partial_sums(const void* expert_rows, const int* out_row, std::int64_t count, int meta_width,
                         std::int64_t hidden, void* partial, const float* grad_probs, float* ret_probs,
                         cudaStream_t stream) {
  if (count == 0) return;
  partial_sums_kernel<<<blocks_for_rows(count), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(expert_rows), out_row, count, meta_width, hidden,
      static_cast<__nv_bfloat16*>(partial), grad_probs, ret_probs);
  FLEXEP_CUDA_CHECK_LAUNCH("partial_sums_kernel");
}

void launch_sum_partials(const void* partials, const int* send_pos, std::int64_t tokens, int ranks,
                         std::int64_t hidden, void* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  sum_partials_kernel<<<blocks_for_rows(tokens), kRowThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(partials), send_pos, tokens, ranks, hidden, static_cast<__nv_bfloat16*>(out));
  FLEXEP_CUDA_CHECK_LAUNCH("sum_partials_kernel");
}

void launch_gather_weight_grads(const float* ret_probs, const int* slot_entry, const int* slot_expert,
                                std::int64_t tokens, int slots, bool multihot, float* out, cudaStream_t stream) {
  if (tokens == 0 || slots == 0) return;
  gather_weight_grads_kernel<<<blocks_for_items(tokens * slots), kThreads, 0, stream>>>(
      ret_probs, slot_entry, slot_expert, tokens, slots, multihot, out);
  FLEXEP_CUDA_CHECK_LAUNCH("gather_weight_grads_kernel");
}

}  // namespace flexep::alltoall
