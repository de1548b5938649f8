#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "flexep/core/checks.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(std::int64_t n) {
  return static_cast<int>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535));
}

__global__ void mask_padding_kernel(const std::int64_t* indices, const bool* padding, std::int64_t* out,
                                    std::int64_t T, std::int64_t k) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < T * k;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = padding[i / k] ? -1 : indices[i];
}

// One warp per token: the dot product of x[t] and w, lanes striding over the columns.
__global__ void sigmoid_gate_kernel(const __nv_bfloat16* x, const __nv_bfloat16* w, float* gate, std::int64_t T,
                                    std::int64_t dim) {
  const std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  float acc = 0.f;
  for (std::int64_t d = lane; d < dim; d += 32) acc += __bfloat162float(x[t * dim + d]) * __bfloat162float(w[d]);
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) gate[t] = 1.f / (1.f + expf(-acc));
}

__global__ void gate_grad_logit_kernel(const float* gate, const float* grad_gate, float* g, std::int64_t T) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < T;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    g[t] = grad_gate[t] * gate[t] * (1.f - gate[t]);
}

// One thread per column: sum over tokens in ascending order (deterministic).
__global__ void gate_grad_w_kernel(const __nv_bfloat16* x, const float* g, float* grad_w, std::int64_t T,
                                   std::int64_t dim) {
  const std::int64_t d = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (d >= dim) return;
  float acc = 0.f;
  for (std::int64_t t = 0; t < T; ++t) acc += g[t] * __bfloat162float(x[t * dim + d]);
  grad_w[d] += acc;
}

__global__ void gate_grad_x_kernel(const __nv_bfloat16* w, const float* g, __nv_bfloat16* grad_x, std::int64_t T,
                                   std::int64_t dim) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < T * dim;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / dim, d = i % dim;
    grad_x[i] = __float2bfloat16(__bfloat162float(grad_x[i]) + g[t] * __bfloat162float(w[d]));
  }
}

__global__ void add_kernel(__nv_bfloat16* y, const __nv_bfloat16* z, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(__bfloat162float(y[i]) + __bfloat162float(z[i]));
}

__global__ void not_kernel(const bool* in, bool* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = !in[i];
}

__global__ void add_i64_kernel(std::int64_t* acc, const std::int64_t* x, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    acc[i] += x[i];
}

__device__ inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <class T>
__global__ void fill_random_kernel(T* t, std::uint64_t seed, float half_width, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix64(seed ^ mix64(static_cast<std::uint64_t>(i))) >> 40) * (1.0f / 16777216.0f);
    const float v = (2.f * u - 1.f) * half_width;
    if constexpr (std::is_same_v<T, float>)
      t[i] = v;
    else
      t[i] = __float2bfloat16(v);
  }
}

// Integer atomics: the counts do not depend on the order of the adds.
__global__ void count_expert_load_kernel(const std::int64_t* indices, unsigned long long* load, std::int64_t n,
                                         std::int64_t experts) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = indices[i];
    if (e >= 0 && e < experts) atomicAdd(load + e, 1ull);
  }
}

__global__ void f32_to_bf16_kernel(const float* src, __nv_bfloat16* dst, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16(src[i]);
}

__global__ void fill_kernel(float* t, float v, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    t[i] = v;
}

}  // namespace

void mask_padding_indices(const TensorView& indices, const TensorView& padding_mask, const TensorView& out,
                          cudaStream_t stream) {
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i64}, "indices");
  check::shape(padding_mask, {indices.size(0)}, "padding_mask");
  check::dtype(padding_mask, {DType::b8}, "padding_mask");
  check::shape(out, {indices.size(0), indices.size(1)}, "out");
  check::dtype(out, {DType::i64}, "out");
  const std::int64_t n = indices.numel();
  if (!n) return;
  mask_padding_kernel<<<blocks_for(n), kThreads, 0, stream>>>(indices.ptr<std::int64_t>(), padding_mask.ptr<bool>(),
                                                               out.ptr<std::int64_t>(), indices.size(0), indices.size(1));
  FLEXEP_CUDA_CHECK_LAUNCH("mask_padding_kernel");
}

void sigmoid_gate_forward(const TensorView& x, const TensorView& w, const TensorView& gate, cudaStream_t stream) {
  check::rank(x, 2, "x");
  check::dtype(x, {DType::bf16}, "x");
  check::shape(w, {x.size(1)}, "shared_expert_gate.weight");
  check::dtype(w, {DType::bf16}, "shared_expert_gate.weight");
  check::shape(gate, {x.size(0)}, "gate");
  check::dtype(gate, {DType::f32}, "gate");
  const std::int64_t T = x.size(0);
  if (!T) return;
  const int warps = kThreads / 32;
  sigmoid_gate_kernel<<<static_cast<unsigned>((T + warps - 1) / warps), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x.data), static_cast<const __nv_bfloat16*>(w.data), gate.ptr<float>(), T,
      x.size(1));
  FLEXEP_CUDA_CHECK_LAUNCH("sigmoid_gate_kernel");
}

void sigmoid_gate_backward(const TensorView& x, const TensorView& w, const TensorView& gate,
                           const TensorView& grad_gate, const TensorView& grad_w, const TensorView& grad_x,
                           cudaStream_t stream) {
  const std::int64_t T = x.size(0), dim = x.size(1);
  check::shape(gate, {T}, "gate");
  check::shape(grad_gate, {T}, "grad_gate");
  check::dtype(grad_gate, {DType::f32}, "grad_gate");
  check::shape(grad_w, {dim}, "grad_w");
  check::dtype(grad_w, {DType::f32}, "grad_w");
  check::shape(grad_x, {T, dim}, "grad_x");
  check::dtype(grad_x, {DType::bf16}, "grad_x");
  if (!T) return;
  Tensor g = Tensor::empty({T}, DType::f32, x.device);
  gate_grad_logit_kernel<<<blocks_for(T), kThreads, 0, stream>>>(gate.ptr<float>(), grad_gate.ptr<float>(),
                                                                 g.data<float>(), T);
  FLEXEP_CUDA_CHECK_LAUNCH("gate_grad_logit_kernel");
  gate_grad_w_kernel<<<static_cast<unsigned>((dim + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x.data), g.data<float>(), grad_w.ptr<float>(), T, dim);
  FLEXEP_CUDA_CHECK_LAUNCH("gate_grad_w_kernel");
  gate_grad_x_kernel<<<blocks_for(T * dim), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(w.data),
                                                                   g.data<float>(),
                                                                   static_cast<__nv_bfloat16*>(grad_x.data), T, dim);
  FLEXEP_CUDA_CHECK_LAUNCH("gate_grad_x_kernel");
}

void add_into(const TensorView& y, const TensorView& z, cudaStream_t stream) {
  check::dtype(y, {DType::bf16}, "y");
  check::dtype(z, {DType::bf16}, "z");
  FLEXEP_CHECK_ARG(y.numel() == z.numel(), "z", "has ", z.numel(), " elements, y has ", y.numel());
  if (!y.numel()) return;
  add_kernel<<<blocks_for(y.numel()), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(y.data),
                                                              static_cast<const __nv_bfloat16*>(z.data), y.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("add_kernel");
}

void logical_not(const TensorView& mask, const TensorView& out, cudaStream_t stream) {
  check::dtype(mask, {DType::b8}, "mask");
  check::dtype(out, {DType::b8}, "out");
  FLEXEP_CHECK_ARG(mask.numel() == out.numel(), "out", "has ", out.numel(), " elements, mask has ", mask.numel());
  if (!mask.numel()) return;
  not_kernel<<<blocks_for(mask.numel()), kThreads, 0, stream>>>(mask.ptr<bool>(), out.ptr<bool>(), mask.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("not_kernel");
}

void add_i64(const TensorView& acc, const TensorView& x, cudaStream_t stream) {
  check::dtype(acc, {DType::i64}, "acc");
  check::dtype(x, {DType::i64}, "x");
  FLEXEP_CHECK_ARG(acc.numel() == x.numel(), "x", "has ", x.numel(), " elements, acc has ", acc.numel());
  if (!acc.numel()) return;
  add_i64_kernel<<<blocks_for(acc.numel()), kThreads, 0, stream>>>(acc.ptr<std::int64_t>(), x.ptr<std::int64_t>(),
                                                                  acc.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("add_i64_kernel");
}

void count_expert_load(const TensorView& indices, const TensorView& load, cudaStream_t stream) {
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i64}, "indices");
  check::rank(load, 1, "load");
  check::dtype(load, {DType::i64}, "load");
  check::same_device(indices, "indices", load, "load");
  zero_async(load, stream);
  const std::int64_t n = indices.numel();
  if (!n) return;
  static_assert(sizeof(unsigned long long) == sizeof(std::int64_t));
  count_expert_load_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      indices.ptr<std::int64_t>(), static_cast<unsigned long long*>(load.data), n, load.size(0));
  FLEXEP_CUDA_CHECK_LAUNCH("count_expert_load_kernel");
}

void convert_f32_to_bf16(const TensorView& src, const TensorView& dst, cudaStream_t stream) {
  check::dtype(src, {DType::f32}, "src");
  check::dtype(dst, {DType::bf16}, "dst");
  FLEXEP_CHECK_ARG(src.numel() == dst.numel(), "dst", "has ", dst.numel(), " elements, src has ", src.numel());
  check::same_device(src, "src", dst, "dst");
  if (!src.numel()) return;
  f32_to_bf16_kernel<<<blocks_for(src.numel()), kThreads, 0, stream>>>(
      src.ptr<float>(), static_cast<__nv_bfloat16*>(dst.data), src.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("f32_to_bf16_kernel");
}

void fill_random(const TensorView& t, std::uint64_t seed, float std, cudaStream_t stream) {
  check::dtype(t, {DType::bf16, DType::f32}, "t");
  if (!t.numel()) return;
  const float half_width = std * 1.7320508f;  // uniform on [-a, a] has std a / sqrt(3)
  if (t.dtype == DType::f32)
    fill_random_kernel<float><<<blocks_for(t.numel()), kThreads, 0, stream>>>(t.ptr<float>(), seed, half_width, t.numel());
  else
    fill_random_kernel<__nv_bfloat16><<<blocks_for(t.numel()), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(t.data), seed, half_width, t.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("fill_random_kernel");
}

void fill(const TensorView& t, float value, cudaStream_t stream) {
  check::dtype(t, {DType::f32}, "t");
  if (!t.numel()) return;
  fill_kernel<<<blocks_for(t.numel()), kThreads, 0, stream>>>(t.ptr<float>(), value, t.numel());
  FLEXEP_CUDA_CHECK_LAUNCH("fill_kernel");
}

}  // namespace flexep::cuda
