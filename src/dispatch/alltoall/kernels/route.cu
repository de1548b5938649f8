// Sender-side routing kernels: multihot -> slots, validation and counting, and the header of the
// count exchange. One thread per token: a token's k slots are few, and one thread per token lets
// the repeat check and the deduplication per destination rank run without atomics on flags.
#include "dispatch/alltoall/device/block_rows.cuh"
#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

namespace {

__device__ inline long long load_index(const void* p, bool is64, std::int64_t i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<const int*>(p)[i];
}

__global__ void __launch_bounds__(kThreads)
    multihot_to_slots_kernel(const unsigned char* map, const float* probs, std::int64_t tokens, int experts,
                             int* slot_expert, float* slot_weight) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const std::int64_t base = t * experts;
    int j = 0;
    for (int e = 0; e < experts; ++e) {
      if (map[base + e] == 0) continue;
      slot_expert[base + j] = e;
      slot_weight[base + j] = probs[base + e];
      ++j;
    }
    for (; j < experts; ++j) {
      slot_expert[base + j] = -1;
      slot_weight[base + j] = 0.0f;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    count_slots_kernel(const void* indices, bool is64, std::int64_t tokens, int topk, int experts, int local_experts,
                       int* slot_expert, unsigned long long* expert_counts, unsigned long long* dest_counts,
                       int* dest_flag, cuda::DeviceErrorRecord* errors) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const std::int64_t base = t * topk;
    // Pass 1: validate. A bad id is reported and then treated as -1: it never becomes an index.
    for (int j = 0; j < topk; ++j) {
      const long long e = load_index(indices, is64, base + j);
      bool ok = e >= 0 && e < experts;
      if (e != -1 && !ok) cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, e, experts);
      for (int q = 0; ok && q < j; ++q)
        if (load_index(indices, is64, base + q) == e) {
          ok = false;
          cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, e, experts);
        }
      slot_expert[base + j] = ok ? static_cast<int>(e) : -1;
    }
    // Pass 2: count the valid pairs, and the token once per destination rank.
    for (int j = 0; j < topk; ++j) {
      const int e = slot_expert[base + j];
      if (e < 0) continue;
      atomicAdd(&expert_counts[e], 1ull);
      const int d = e / local_experts;
      int& flag = dest_flag[static_cast<std::int64_t>(d) * tokens + t];
      if (flag == 0) {  // only this thread touches token t's flags
        flag = 1;
        atomicAdd(&dest_counts[d], 1ull);
      }
    }
  }
}

__global__ void write_header_kernel(HeaderWords h, const cuda::DeviceErrorRecord* errors, long long* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int i = 0; i < word::count; ++i) out[i] = h.w[i];
  out[word::device_arg] = errors->arg;
  out[word::device_row] = errors->row;
  out[word::device_column] = errors->column;
  out[word::device_value] = errors->value;
  out[word::device_limit] = errors->limit;
}

}  // namespace

void launch_multihot_to_slots(const unsigned char* routing_map, const float* probs, std::int64_t tokens, int experts,
                              int* slot_expert, float* slot_weight, cudaStream_t stream) {
  if (tokens == 0) return;
  multihot_to_slots_kernel<<<blocks_for_items(tokens), kThreads, 0, stream>>>(routing_map, probs, tokens, experts,
                                                                              slot_expert, slot_weight);
  FLEXEP_CUDA_CHECK_LAUNCH("multihot_to_slots_kernel");
}

void launch_count_slots(const void* indices, bool indices_i64, std::int64_t tokens, int topk, int experts,
                        int local_experts, int* slot_expert, long long* expert_counts, long long* dest_counts,
                        int* dest_flag, cuda::DeviceErrorRecord* errors, cudaStream_t stream) {
  if (tokens == 0 || topk == 0) return;
  count_slots_kernel<<<blocks_for_items(tokens), kThreads, 0, stream>>>(
      indices, indices_i64, tokens, topk, experts, local_experts, slot_expert,
      reinterpret_cast<unsigned long long*>(expert_counts), reinterpret_cast<unsigned long long*>(dest_counts),
      dest_flag, errors);
  FLEXEP_CUDA_CHECK_LAUNCH("count_slots_kernel");
}

void launch_write_header(const HeaderWords& words, const cuda::DeviceErrorRecord* errors, long long* out,
                         cudaStream_t stream) {
  write_header_kernel<<<1, 1, 0, stream>>>(words, errors, out);
  FLEXEP_CUDA_CHECK_LAUNCH("write_header_kernel");
}

}  // namespace flexep::alltoall
