// Element-wise conversions of the router: bf16 <-> f32/f64 casts (8 elements per step with 16-byte
// loads and stores when sizes and addresses allow), the hi/lo bf16 split of gradients and the fp64
// into fp32 accumulation. Grid-stride loops, 64-bit indices.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/router_kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::router {

static_assert(sizeof(bf16) == sizeof(__nv_bfloat16), "flexep::bf16 and __nv_bfloat16 share one layout");

namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough resident threads for HBM

unsigned blocks_for(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

__device__ inline void convert(__nv_bfloat16 v, float& out) { out = __bfloat162float(v); }
__device__ inline void convert(__nv_bfloat16 v, double& out) { out = __bfloat162float(v); }
__device__ inline void convert(float v, __nv_bfloat16& out) { out = __float2bfloat16_rn(v); }
__device__ inline void convert(double v, __nv_bfloat16& out) { out = __double2bfloat16(v); }  // one rounding
__device__ inline void convert(float v, double& out) { out = v; }
__device__ inline void convert(double v, float& out) { out = static_cast<float>(v); }

template <class T>
struct alignas(16) Vec16 {
  T v[16 / sizeof(T)];
};

// 8 consecutive elements at a 16-byte aligned address, as 16-byte accesses.
template <class T>
__device__ inline void load8(const T* p, T (&out)[8]) {
  constexpr int per = 16 / sizeof(T);
#pragma unroll
  for (int q = 0; q < 8 / per; ++q) {
    const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(p)[q];
#pragma unroll
    for (int r = 0; r < per; ++r) out[q * per + r] = v.v[r];
  }
}

template <class T>
__device__ inline void store8(T* p, const T (&in)[8]) {
  constexpr int per = 16 / sizeof(T);
#pragma unroll
  for (int q = 0; q < 8 / per; ++q) {
    Vec16<T> v;
#pragma unroll
    for (int r = 0; r < per; ++r) v.v[r] = in[q * per + r];
    reinterpret_cast<Vec16<T>*>(p)[q] = v;
  }
}

// vectorized: n % 8 == 0 and both pointers 16-byte aligned (checked by the launcher).
template <class From, class To>
__global__ void __launch_bounds__(kThreads) cast_kernel(const From* src, To* dst, std::int64_t n, bool vectorized) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (vectorized) {
    for (std::int64_t v = first; v < n / 8; v += stride) {
      From in[8];
      To out[8];
      load8(src + 8 * v, in);
#pragma unroll
      for (int q = 0; q < 8; ++q) convert(in[q], out[q]);
      store8(dst + 8 * v, out);
    }
  } else {
    for (std::int64_t i = first; i < n; i += stride) convert(src[i], dst[i]);
  }
}

template <class From, class To>
void cast(const From* src, To* dst, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vectorized = n % 8 == 0 && aligned16(src) && aligned16(dst);
  cast_kernel<From, To><<<blocks_for(vectorized ? n / 8 : n), kThreads, 0, stream>>>(src, dst, n, vectorized);
  FLEXEP_CUDA_CHECK_LAUNCH("cast_kernel");
}

__global__ void __launch_bounds__(kThreads)
    split_bf16_kernel(const float* g, __nv_bfloat16* hl, std::int64_t rows, int cols) {
  const std::int64_t n = rows * cols, stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const std::int64_t r = i / cols, c = i % cols;
    const float v = g[i];
    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
    hl[r * 2 * cols + c] = hi;
    hl[r * 2 * cols + cols + c] = __float2bfloat16_rn(v - __bfloat162float(hi));  // v - hi is exact in fp32
  }
}

__global__ void __launch_bounds__(kThreads) accumulate_kernel(const double* src, float* dst, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    dst[i] = static_cast<float>(static_cast<double>(dst[i]) + src[i]);
}

__global__ void __launch_bounds__(kThreads) accumulate_halves_kernel(const float* src, float* dst, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    dst[i] += src[i] + src[n + i];
}

const __nv_bfloat16* as_nv(const bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
__nv_bfloat16* as_nv(bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

}  // namespace

void launch_cast(const bf16* src, float* dst, std::int64_t n, cudaStream_t stream) { cast(as_nv(src), dst, n, stream); }
void launch_cast(const bf16* src, double* dst, std::int64_t n, cudaStream_t stream) { cast(as_nv(src), dst, n, stream); }
void launch_cast(const float* src, bf16* dst, std::int64_t n, cudaStream_t stream) { cast(src, as_nv(dst), n, stream); }
void launch_cast(const double* src, bf16* dst, std::int64_t n, cudaStream_t stream) { cast(src, as_nv(dst), n, stream); }
void launch_cast(const float* src, double* dst, std::int64_t n, cudaStream_t stream) { cast(src, dst, n, stream); }
void launch_cast(const double* src, float* dst, std::int64_t n, cudaStream_t stream) { cast(src, dst, n, stream); }

void launch_split_bf16(const float* g, bf16* hl, std::int64_t rows, int cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  split_bf16_kernel<<<blocks_for(rows * cols), kThreads, 0, stream>>>(g, as_nv(hl), rows, cols);
  FLEXEP_CUDA_CHECK_LAUNCH("split_bf16_kernel");
}

void launch_accumulate(const double* src, float* dst, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  accumulate_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  FLEXEP_CUDA_CHECK_LAUNCH("accumulate_kernel");
}

void launch_accumulate_halves(const float* src, float* dst, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  accumulate_halves_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  FLEXEP_CUDA_CHECK_LAUNCH("accumulate_halves_kernel");
}

}  // namespace flexep::cuda::router
