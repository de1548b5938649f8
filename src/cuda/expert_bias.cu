// Down-projection bias kernels (y += b[e] * p and its backward) and the deterministic per-expert
// column sum. Row kernels: one warp per row, V consecutive columns per lane (V = 8: 16-byte accesses).
#include "flexep/cuda/expert_bias.h"

#include <algorithm>

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
    down_bias_forward_kernel(bf16_t* y, const bf16_t* bias, const float* probs, const std::int64_t* offsets,
                             int num_experts, std::int64_t rows, std::int64_t dim) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t active = detail::active_rows(offsets, num_experts, rows);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < active;
       row += nwarps) {
    const float p = probs ? probs[row] : 1.f;
    const std::int64_t e = offsets ? detail::find_expert(offsets, num_experts, row) : 0;
    const bf16_t* br = bias + e * dim;
    bf16_t* yr = y + row * dim;
    for (std::int64_t c = static_cast<std::int64_t>(lane) * V; c < dim; c += 32 * V) {
      float v[V], b[V];
      load_bf16<V>(yr + c, v);
      load_bf16<V>(br + c, b);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] += b[j] * p;
      store_bf16<V>(yr + c, v);
    }
  }
}

// grad_probs[n] += <grad_y[n], b[e(n)]> on active rows.
template <int V>
__global__ void __launch_bounds__(kRowThreads)
    bias_probs_grad_kernel(const bf16_t* grad_y, const bf16_t* bias, const std::int64_t* offsets, int num_experts,
                           std::int64_t rows, std::int64_t dim, float* grad_probs) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t active = detail::active_rows(offsets, num_experts, rows);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  // The row loop is uniform per warp, so every lane reaches warp_sum.
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < active;
       row += nwarps) {
    const std::int64_t e = offsets ? detail::find_expert(offsets, num_experts, row) : 0;
    const bf16_t* br = bias + e * dim;
    const bf16_t* gr = grad_y + row * dim;
    float dot = 0.f;
    for (std::int64_t c = static_cast<std::int64_t>(lane) * V; c < dim; c += 32 * V) {
      float g[V], b[V];
      load_bf16<V>(gr + c, g);
      load_bf16<V>(br + c, b);
#pragma unroll
      for (int j = 0; j < V; ++j) dot += g[j] * b[j];
    }
    dot = detail::warp_sum(dot);
    if (lane == 0) grad_probs[row] += dot;
  }
}

// Phase 1 of the column sum: block (x, part, e); each thread sums columns [c, c + V) over part `part`
// of expert e's rows, in row order, into partial[e][part][c..].
constexpr int kColThreads = 128;

template <int V>
__global__ void __launch_bounds__(kColThreads)
    column_sum_partial_kernel(const bf16_t* x, const float* scale, const std::int64_t* offsets, std::int64_t rows,
                              std::int64_t cols, int parts, float* partial) {
  const std::int64_t c = (static_cast<std::int64_t>(blockIdx.x) * kColThreads + threadIdx.x) * V;
  const int part = static_cast<int>(blockIdx.y);
  const int e = static_cast<int>(blockIdx.z);
  if (c >= cols) return;
  // Expert e's rows, clamped into [0, rows) so that bad offsets cannot send a read out of bounds.
  std::int64_t lo = 0, hi = rows;
  if (offsets) {
    const std::int64_t a = offsets[e], b = offsets[e + 1];
    lo = a < 0 ? 0 : (a > rows ? rows : a);
    hi = b < lo ? lo : (b > rows ? rows : b);
  }
  const std::int64_t len = hi - lo;
  const std::int64_t r0 = lo + len * part / parts, r1 = lo + len * (part + 1) / parts;
  float acc[V] = {};
  for (std::int64_t r = r0; r < r1; ++r) {
    float v[V];
    load_bf16<V>(x + r * cols + c, v);
    const float s = scale ? scale[r] : 1.f;
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += s * v[j];
  }
  float* out = partial + (static_cast<std::int64_t>(e) * parts + part) * cols + c;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = acc[j];
}

// Phase 2: out[e][c] += sum over parts, in part order.
__global__ void column_sum_finish_kernel(const float* partial, std::int64_t num_experts, int parts, std::int64_t cols,
                                         float* out) {
  const std::int64_t total = num_experts * cols;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t e = i / cols, c = i % cols;
    float s = 0.f;
    for (int part = 0; part < parts; ++part) s += partial[(e * parts + part) * cols + c];
    out[i] += s;
  }
}

template <class T>
const T* ptr_or_null(const TensorView& t) {
  return t.defined() ? static_cast<const T*>(t.data) : nullptr;
}

}  // namespace

void down_bias_forward(const TensorView& y, const TensorView& down_bias, const TensorView& probs,
                       const TensorView& expert_offsets, cudaStream_t stream) {
  check::rank(y, 2, "y");
  const std::int64_t rows = y.size(0), dim = y.size(1);
  detail::check_matrix(y, rows, dim, DType::bf16, "y");
  const int E = detail::check_rows_args(probs, expert_offsets, rows, y.device);
  detail::check_matrix(down_bias, E, dim, DType::bf16, "down_bias");
  check::device(down_bias, y.device, "down_bias");
  if (rows == 0 || dim == 0) return;
  DeviceGuard guard(y.device.index);
  const bool vec = dim % 8 == 0 && detail::aligned16(y) && detail::aligned16(down_bias);
  const int blocks = detail::row_blocks(rows, y.device.index);
  auto* yp = static_cast<bf16_t*>(y.data);
  auto* bp = static_cast<const bf16_t*>(down_bias.data);
  auto* pp = ptr_or_null<float>(probs);
  auto* op = ptr_or_null<std::int64_t>(expert_offsets);
  if (vec)
    down_bias_forward_kernel<8><<<blocks, kRowThreads, 0, stream>>>(yp, bp, pp, op, E, rows, dim);
  else
    down_bias_forward_kernel<1><<<blocks, kRowThreads, 0, stream>>>(yp, bp, pp, op, E, rows, dim);
  FLEXEP_CUDA_CHECK_LAUNCH("down_bias_forward");
}

void down_bias_backward(const TensorView& grad_y, const TensorView& down_bias, const TensorView& probs,
                        const TensorView& expert_offsets, const TensorView& grad_down_bias,
                        const TensorView& grad_probs, cudaStream_t stream) {
  check::rank(grad_y, 2, "grad_y");
  const std::int64_t rows = grad_y.size(0), dim = grad_y.size(1);
  detail::check_matrix(grad_y, rows, dim, DType::bf16, "grad_y");
  const int E = detail::check_rows_args(probs, expert_offsets, rows, grad_y.device);
  detail::check_matrix(down_bias, E, dim, DType::bf16, "down_bias");
  check::device(down_bias, grad_y.device, "down_bias");
  if (grad_down_bias.defined()) {
    detail::check_matrix(grad_down_bias, E, dim, DType::f32, "grad_down_bias");
    check::device(grad_down_bias, grad_y.device, "grad_down_bias");
  }
  if (grad_probs.defined()) {
    check::shape(grad_probs, {rows}, "grad_probs");
    check::dtype(grad_probs, {DType::f32}, "grad_probs");
    check::device(grad_probs, grad_y.device, "grad_probs");
  }
  if (rows == 0 || dim == 0) return;
  if (grad_down_bias.defined()) expert_column_sum(grad_y, probs, expert_offsets, grad_down_bias, stream);
  if (!grad_probs.defined()) return;
  DeviceGuard guard(grad_y.device.index);
  const bool vec = dim % 8 == 0 && detail::aligned16(grad_y) && detail::aligned16(down_bias);
  const int blocks = detail::row_blocks(rows, grad_y.device.index);
  auto* gp = static_cast<const bf16_t*>(grad_y.data);
  auto* bp = static_cast<const bf16_t*>(down_bias.data);
  auto* op = ptr_or_null<std::int64_t>(expert_offsets);
  auto* gpp = static_cast<float*>(grad_probs.data);
  if (vec)
    bias_probs_grad_kernel<8><<<blocks, kRowThreads, 0, stream>>>(gp, bp, op, E, rows, dim, gpp);
  else
    bias_probs_grad_kernel<1><<<blocks, kRowThreads, 0, stream>>>(gp, bp, op, E, rows, dim, gpp);
  FLEXEP_CUDA_CHECK_LAUNCH("down_bias_backward");
}

void expert_column_sum(const TensorView& x, const TensorView& scale, const TensorView& expert_offsets,
                       const TensorView& out, cudaStream_t stream) {
  check::rank(x, 2, "x");
  const std::int64_t rows = x.size(0), cols = x.size(1);
  detail::check_matrix(x, rows, cols, DType::bf16, "x");
  const int E = detail::check_rows_args(scale, expert_offsets, rows, x.device, "scale");
  detail::check_matrix(out, E, cols, DType::f32, "out");
  check::device(out, x.device, "out");
  if (rows == 0 || cols == 0) return;
  const int device = x.device.index;
  DeviceGuard guard(device);
  StreamGuard stream_guard(stream);  // the workspace below is allocated and freed on `stream`
  const bool vec = cols % 8 == 0 && detail::aligned16(x);
  const std::int64_t V = vec ? 8 : 1;
  const std::int64_t groups = cols / V;
  // Parts per expert: enough threads to keep the GPU busy, never more than one part per 32 rows.
  // A function of (rows, E, cols) only, so the summation order is the same run to run.
  const std::int64_t want = (131072 + E * groups - 1) / (E * groups);
  const int parts = static_cast<int>(std::clamp<std::int64_t>(std::min(want, (rows + 31) / 32), 1, 64));
  Tensor partial = Tensor::empty({static_cast<std::int64_t>(E) * parts * cols}, DType::f32, Device::cuda(device));
  const dim3 grid(static_cast<unsigned>((groups + kColThreads - 1) / kColThreads), static_cast<unsigned>(parts),
                  static_cast<unsigned>(E));
  auto* xp = static_cast<const bf16_t*>(x.data);
  auto* sp = ptr_or_null<float>(scale);
  auto* op = ptr_or_null<std::int64_t>(expert_offsets);
  float* pp = partial.data<float>();
  if (vec)
    column_sum_partial_kernel<8><<<grid, kColThreads, 0, stream>>>(xp, sp, op, rows, cols, parts, pp);
  else
    column_sum_partial_kernel<1><<<grid, kColThreads, 0, stream>>>(xp, sp, op, rows, cols, parts, pp);
  FLEXEP_CUDA_CHECK_LAUNCH("expert_column_sum");
  const std::int64_t total = static_cast<std::int64_t>(E) * cols;
  const int blocks =
      static_cast<int>(std::min<std::int64_t>((total + 255) / 256, static_cast<std::int64_t>(sm_count(device)) * 16));
  column_sum_finish_kernel<<<blocks, 256, 0, stream>>>(pp, E, parts, cols, static_cast<float*>(out.data));
  FLEXEP_CUDA_CHECK_LAUNCH("expert_column_sum");
}

}  // namespace flexep::cuda
