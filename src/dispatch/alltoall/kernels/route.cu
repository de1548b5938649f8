// Sender-side routing kernels: multihot -> slots, and the header of the count exchange (the
// validation and counting kernel is the common one, dispatch/common/count_routes.h).
#include "dispatch/alltoall/device/block_rows.cuh"
#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

namespace {

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

void launch_write_header(const HeaderWords& words, const cuda::DeviceErrorRecord* errors, long long* out,
                         cudaStream_t stream) {
  write_header_kernel<<<1, 1, 0, stream>>>(words, errors, out);
  FLEXEP_CUDA_CHECK_LAUNCH("write_header_kernel");
}

}  // namespace flexep::alltoall
