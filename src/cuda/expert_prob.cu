// Row kernels of the after-down prob multiply (expert_prob.h): one warp per row, V consecutive
// columns per lane (V = 8: 16-byte accesses).
#include "flexep/cuda/expert_prob.h"

#include "cuda/expert_rows.cuh"

namespace flexep::cuda {
namespace {

using detail::bf16_t;
using detail::kRowThreads;
using detail::kWarpsPerBlock;
using detail::load_bf16;
using detail::store_bf16;

template <int V>
__global__ void __launch_bounds__(kRowThreads)
    prob_scale_kernel(const bf16_t* __restrict__ u, const float* __restrict__ probs, std::int64_t rows,
                      std::int64_t dim, bf16_t* __restrict__ y) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += nwarps) {
    const float p = probs[row];
    for (std::int64_t c = static_cast<std::int64_t>(lane) * V; c < dim; c += 32 * V) {
      float v[V];
      load_bf16<V>(u + row * dim + c, v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] *= p;
      store_bf16<V>(y + row * dim + c, v);
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kRowThreads)
    prob_scale_backward_kernel(const bf16_t* __restrict__ grad_y, const bf16_t* __restrict__ u,
                               const float* __restrict__ probs, std::int64_t rows, std::int64_t dim,
                               bf16_t* __restrict__ grad_u, float* __restrict__ grad_probs) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  // The row loop is uniform per warp, so every lane reaches warp_sum.
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += nwarps) {
    const float p = probs[row];
    float dot = 0.f;
    for (std::int64_t c = static_cast<std::int64_t>(lane) * V; c < dim; c += 32 * V) {
      float g[V], x[V];
      load_bf16<V>(grad_y + row * dim + c, g);
      load_bf16<V>(u + row * dim + c, x);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dot += g[j] * x[j];
        g[j] *= p;
      }
      store_bf16<V>(grad_u + row * dim + c, g);
    }
    dot = detail::warp_sum(dot);
    if (grad_probs && lane == 0) grad_probs[row] = dot;
  }
}

// The kernels take their pointers as __restrict__: an output must share no byte with an input.
void check_disjoint(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name) {
  if (!out.defined() || !in.defined() || out.data == nullptr || in.data == nullptr) return;
  const auto* a = static_cast<const char*>(out.data);
  const auto* b = static_cast<const char*>(in.data);
  FLEXEP_CHECK_ARG(!(a < b + in.nbytes() && b < a + out.nbytes()), out_name, "overlaps ", in_name,
                   "; pass separate memory");
}

}  // namespace

void prob_scale_rows(const TensorView& u, const TensorView& probs, const TensorView& y, cudaStream_t stream) {
  check::rank(u, 2, "u");
  const std::int64_t rows = u.size(0), dim = u.size(1);
  detail::check_matrix(u, rows, dim, DType::bf16, "u");
  detail::check_matrix(y, rows, dim, DType::bf16, "y");
  check::device(y, u.device, "y");
  FLEXEP_CHECK_ARG(probs.defined(), "probs", "is required");
  detail::check_rows_args(probs, TensorView(), rows, u.device);
  check_disjoint(y, "y", u, "u");
  if (rows == 0 || dim == 0) return;
  DeviceGuard guard(u.device.index);
  const bool vec = dim % 8 == 0 && detail::aligned16(u) && detail::aligned16(y);
  const int blocks = detail::row_blocks(rows, u.device.index);
  auto* up = static_cast<const bf16_t*>(u.data);
  auto* pp = static_cast<const float*>(probs.data);
  auto* yp = static_cast<bf16_t*>(y.data);
  if (vec)
    prob_scale_kernel<8><<<blocks, kRowThreads, 0, stream>>>(up, pp, rows, dim, yp);
  else
    prob_scale_kernel<1><<<blocks, kRowThreads, 0, stream>>>(up, pp, rows, dim, yp);
  FLEXEP_CUDA_CHECK_LAUNCH("prob_scale_rows");
}

void prob_scale_rows_backward(const TensorView& grad_y, const TensorView& u, const TensorView& probs,
                              const TensorView& grad_u, const TensorView& grad_probs, cudaStream_t stream) {
  check::rank(grad_y, 2, "grad_y");
  const std::int64_t rows = grad_y.size(0), dim = grad_y.size(1);
  detail::check_matrix(grad_y, rows, dim, DType::bf16, "grad_y");
  detail::check_matrix(u, rows, dim, DType::bf16, "u");
  detail::check_matrix(grad_u, rows, dim, DType::bf16, "grad_u");
  check::device(u, grad_y.device, "u");
  check::device(grad_u, grad_y.device, "grad_u");
  FLEXEP_CHECK_ARG(probs.defined(), "probs", "is required");
  detail::check_rows_args(probs, TensorView(), rows, grad_y.device);
  if (grad_probs.defined()) detail::check_rows_args(grad_probs, TensorView(), rows, grad_y.device, "grad_probs");
  check_disjoint(grad_u, "grad_u", grad_y, "grad_y");
  check_disjoint(grad_u, "grad_u", u, "u");
  check_disjoint(grad_probs, "grad_probs", probs, "probs");
  if (rows == 0) return;
  DeviceGuard guard(grad_y.device.index);
  const bool vec = dim % 8 == 0 && detail::aligned16(grad_y) && detail::aligned16(u) && detail::aligned16(grad_u);
  const int blocks = detail::row_blocks(rows, grad_y.device.index);
  auto* gp = static_cast<const bf16_t*>(grad_y.data);
  auto* up = static_cast<const bf16_t*>(u.data);
  auto* pp = static_cast<const float*>(probs.data);
  auto* gup = static_cast<bf16_t*>(grad_u.data);
  auto* gpp = grad_probs.defined() ? static_cast<float*>(grad_probs.data) : nullptr;
  if (vec)
    prob_scale_backward_kernel<8><<<blocks, kRowThreads, 0, stream>>>(gp, up, pp, rows, dim, gup, gpp);
  else
    prob_scale_backward_kernel<1><<<blocks, kRowThreads, 0, stream>>>(gp, up, pp, rows, dim, gup, gpp);
  FLEXEP_CUDA_CHECK_LAUNCH("prob_scale_rows_backward");
}

}  // namespace flexep::cuda
