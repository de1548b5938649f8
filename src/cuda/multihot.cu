// Top-k <-> multihot kernels and their host entry points: one thread per (token, slot), grid-stride.
// Each (token, expert) cell is written by at most one thread (the first slot naming the expert;
// repeats are reported instead), so the scatter has no races.
#include "flexep/cuda/multihot.h"

#include <algorithm>
#include <climits>

#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 4096;

__device__ inline long long index_at(const void* indices, bool is64, std::int64_t i) {
  return is64 ? static_cast<const long long*>(indices)[i] : static_cast<const int*>(indices)[i];
}

// routing_map and probs are zero on entry.
__global__ void __launch_bounds__(kThreads)
    topk_to_multihot_kernel(const void* indices, bool is64, const float* weights, std::int64_t tokens, int topk,
                            int experts, bool* routing_map, float* probs, DeviceErrorRecord* errors) {
  const std::int64_t n = tokens * topk, stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const std::int64_t t = i / topk;
    const int j = static_cast<int>(i % topk);
    const long long e = index_at(indices, is64, i);
    if (e == -1) continue;
    if (e < -1 || e >= experts) {
      report_device_error(errors, DeviceArg::indices, t, j, e, experts);
      continue;
    }
    bool repeated = false;
    for (int q = 0; q < j && !repeated; ++q) repeated = index_at(indices, is64, t * topk + q) == e;
    if (repeated) {  // the first slot naming e writes the cell; this one only reports
      report_device_error(errors, DeviceArg::indices, t, j, e, experts);
      continue;
    }
    routing_map[t * experts + e] = true;
    probs[t * experts + e] = weights[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    multihot_backward_kernel(const float* grad_probs, const void* indices, bool is64, std::int64_t tokens, int topk,
                             int experts, float* grad_weights, DeviceErrorRecord* errors) {
  const std::int64_t n = tokens * topk, stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const std::int64_t t = i / topk;
    const long long e = index_at(indices, is64, i);
    float g = 0.0f;
    if (e >= 0 && e < experts) {
      g = grad_probs[t * experts + e];
    } else if (e != -1) {  // other negatives are corrupt ids, not padding (as on the CPU)
      report_device_error(errors, DeviceArg::indices, t, static_cast<int>(i % topk), e, experts);
    }
    grad_weights[i] = g;
  }
}

unsigned blocks_for(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}

void check_indices(const TensorView& indices, const DeviceErrors& errors) {
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  FLEXEP_CHECK_ARG(indices.device.is_cuda(), "indices", "is on device ", indices.device.str(),
                   "; expected a CUDA tensor");
  FLEXEP_CHECK_ARG(indices.device.index == errors.device(), "errors", "records errors of cuda:", errors.device(),
                   " but 'indices' is on ", indices.device.str());
  FLEXEP_CHECK_ARG(indices.size(1) <= INT_MAX, "indices", "has ", indices.size(1), " columns; at most ", INT_MAX);
}

}  // namespace

Multihot topk_to_multihot(const TensorView& indices, const TensorView& weights, int num_experts, DeviceErrors& errors,
                          cudaStream_t stream) {
  FLEXEP_CHECK_ARG(num_experts >= 1, "num_experts", "must be >= 1, got ", num_experts);
  check_indices(indices, errors);
  check::shape(weights, {indices.size(0), indices.size(1)}, "weights");
  check::dtype(weights, {DType::f32}, "weights");
  check::same_device(indices, "indices", weights, "weights");
  const std::int64_t T = indices.size(0);
  const int k = static_cast<int>(indices.size(1));

  init();
  DeviceGuard device(indices.device.index);
  StreamGuard ordered(stream);
  Multihot m{Tensor::empty({T, num_experts}, DType::b8, indices.device),
             Tensor::empty({T, num_experts}, DType::f32, indices.device)};
  zero_async(m.routing_map, stream);
  zero_async(m.probs, stream);
  if (T * k > 0) {
    topk_to_multihot_kernel<<<blocks_for(T * k), kThreads, 0, stream>>>(
        indices.data, indices.dtype == DType::i64, weights.ptr<float>(), T, k, num_experts,
        m.routing_map.data<bool>(), m.probs.data<float>(), errors.record());
    FLEXEP_CUDA_CHECK_LAUNCH("topk_to_multihot_kernel");
  }
  return m;
}

Tensor multihot_backward(const TensorView& grad_probs, const TensorView& indices, DeviceErrors& errors,
                         cudaStream_t stream) {
  check_indices(indices, errors);
  check::rank(grad_probs, 2, "grad_probs");
  check::dtype(grad_probs, {DType::f32}, "grad_probs");
  check::same_device(indices, "indices", grad_probs, "grad_probs");
  FLEXEP_CHECK_ARG(grad_probs.size(0) == indices.size(0), "grad_probs", "has ", grad_probs.size(0),
                   " rows but 'indices' has ", indices.size(0));
  FLEXEP_CHECK_ARG(grad_probs.size(1) >= 1 && grad_probs.size(1) <= INT_MAX, "grad_probs", "has ",
                   grad_probs.size(1), " columns (experts); expected 1 to ", INT_MAX);
  const std::int64_t T = indices.size(0);
  const int k = static_cast<int>(indices.size(1)), E = static_cast<int>(grad_probs.size(1));

  init();
  DeviceGuard device(indices.device.index);
  StreamGuard ordered(stream);
  Tensor g = Tensor::empty({T, k}, DType::f32, indices.device);
  if (T * k > 0) {
    multihot_backward_kernel<<<blocks_for(T * k), kThreads, 0, stream>>>(
        grad_probs.ptr<float>(), indices.data, indices.dtype == DType::i64, T, k, E, g.data<float>(), errors.record());
    FLEXEP_CUDA_CHECK_LAUNCH("multihot_backward_kernel");
  }
  return g;
}

}  // namespace flexep::cuda
