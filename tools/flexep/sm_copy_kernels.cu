// The probes of sm_copy_kernels.h. Each CTA first fills its stages with ordinary stores (made
// visible to the bulk-copy unit by a proxy fence), then moves `copies` rows; nothing is checked:
// the probes measure speed (the hybridep tests check the same primitives' results).
#include "dispatch/hybridep/tma.cuh"
#include "flexep/cuda/runtime.h"
#include "sm_copy_kernels.h"

namespace flexep::tools {

namespace tma = flexep::hybridep::tma;

namespace {

constexpr int kThreads = 512;  // 16 warps: the most the warp-store probe uses
constexpr int kMaxInFlight = 8;

__device__ long long row_of(int copy) { return static_cast<long long>(copy) * gridDim.x + blockIdx.x; }

__device__ void fill_stages(unsigned char* smem, int bytes) {
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(i, blockIdx.x, 0x3f803f80u, 0x3f803f80u);
  tma::fence_proxy_shared();
  __syncthreads();
}

// Waits until at most n of this thread's bulk groups are still reading shared memory.
__device__ void wait_reads_at_most(int n) {
  switch (n) {
    case 0:
      tma::wait_groups_read<0>();
      break;
    case 1:
      tma::wait_groups_read<1>();
      break;
    case 2:
      tma::wait_groups_read<2>();
      break;
    case 3:
      tma::wait_groups_read<3>();
      break;
    case 4:
      tma::wait_groups_read<4>();
      break;
    case 5:
      tma::wait_groups_read<5>();
      break;
    case 6:
      tma::wait_groups_read<6>();
      break;
    default:
      tma::wait_groups_read<7>();
      break;
  }
}

__global__ void __launch_bounds__(kThreads, 1) bulk_store_probe(const SmCopyParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  fill_stages(smem, p.in_flight * p.row_bytes);
  if (threadIdx.x != 0) return;
  for (int i = 0; i < p.copies; ++i) {
    tma::store_async(p.dst + (row_of(i) % p.rows) * p.row_bytes, smem + (i % p.in_flight) * p.row_bytes,
                     static_cast<std::uint32_t>(p.row_bytes));
    tma::commit();
    wait_reads_at_most(p.in_flight - 1);
  }
  tma::wait_groups<0>();
}

__global__ void __launch_bounds__(kThreads, 1) bulk_load_probe(const SmCopyParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + p.in_flight * p.row_bytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.in_flight; ++s) tma::mbar_init(&full[s], 1);
    tma::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int i = 0; i < p.copies; ++i) {
    const int s = i % p.in_flight;
    if (i >= p.in_flight) tma::mbar_wait(&full[s], static_cast<std::uint32_t>((i / p.in_flight - 1) & 1));
    tma::mbar_arrive_expect_tx(&full[s], static_cast<std::uint32_t>(p.row_bytes));
    tma::load_async(smem + s * p.row_bytes, p.src + (row_of(i) % p.rows) * p.row_bytes,
                    static_cast<std::uint32_t>(p.row_bytes), &full[s]);
  }
  for (int i = p.copies > p.in_flight ? p.copies - p.in_flight : 0; i < p.copies; ++i)
    tma::mbar_wait(&full[i % p.in_flight], static_cast<std::uint32_t>((i / p.in_flight) & 1));
}

__global__ void __launch_bounds__(kThreads, 1) warp_store_probe(const SmCopyParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  fill_stages(smem, p.row_bytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= p.warps) return;
  const uint4* src = reinterpret_cast<const uint4*>(smem);
  const int words = p.row_bytes / 16;
  for (int i = warp; i < p.copies; i += p.warps) {
    uint4* dst = reinterpret_cast<uint4*>(p.dst + (row_of(i) % p.rows) * p.row_bytes);
#pragma unroll 4
    for (int w = lane; w < words; w += 32) dst[w] = src[w];
  }
}

// Each warp sums rows (as the combine does): lane i takes 16-byte words i, i + 32, ...; U of them are
// loaded before any is used, so U loads per lane are in flight. The load path is a template
// parameter: a runtime choice inside the loop cut the loads in flight (measured at 16 SMs, GB/s per
// SM: 16 warps x 2 loads 82.8 -> 34.6, 16 x 8 96.9 -> 79.0).
template <int U, bool kL2Only>
__device__ float sum_rows(const SmCopyParams& p, int warp, int lane) {
  const int words = p.row_bytes / 16;
  float acc = 0.0f;
  for (int i = warp; i < p.copies; i += p.warps) {
    const uint4* src = reinterpret_cast<const uint4*>(p.src + (row_of(i) % p.rows) * p.row_bytes);
    for (int base = lane; base < words; base += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        x[u] = base + 32 * u < words ? (kL2Only ? __ldcg(src + base + 32 * u) : __ldg(src + base + 32 * u))
                                     : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) acc += __uint_as_float(x[u].x ^ x[u].y ^ x[u].z ^ x[u].w);
    }
  }
  return acc;
}

template <bool kL2Only>
__device__ float sum_rows_in_flight(const SmCopyParams& p, int warp, int lane) {
  switch (p.in_flight) {
    case 1:
      return sum_rows<1, kL2Only>(p, warp, lane);
    case 2:
      return sum_rows<2, kL2Only>(p, warp, lane);
    case 4:
      return sum_rows<4, kL2Only>(p, warp, lane);
    default:
      return sum_rows<8, kL2Only>(p, warp, lane);
  }
}

__global__ void __launch_bounds__(kThreads, 1) warp_load_probe(const SmCopyParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= p.warps) return;
  const float acc = p.l2_only ? sum_rows_in_flight<true>(p, warp, lane) : sum_rows_in_flight<false>(p, warp, lane);
  if (acc == 1.2345f) p.sink[blockIdx.x] = acc;  // practically never; keeps the loads alive
}

template <class Kernel>
void launch(Kernel kernel, const SmCopyParams& p, int sms, cudaStream_t stream) {
  const std::size_t smem = sm_copy_smem_bytes(p);
  FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<sms, kThreads, smem, stream>>>(p);
  FLEXEP_CUDA_CHECK_LAUNCH("sm-copy probe");
}

}  // namespace

std::size_t sm_copy_smem_bytes(const SmCopyParams& p) {
  const int stages = p.in_flight < 1 ? 1 : (p.in_flight > kMaxInFlight ? kMaxInFlight : p.in_flight);
  return static_cast<std::size_t>(stages) * p.row_bytes + kMaxInFlight * sizeof(std::uint64_t);
}

void launch_bulk_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(bulk_store_probe, p, sms, stream);
}
void launch_bulk_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(bulk_load_probe, p, sms, stream);
}
void launch_warp_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(warp_store_probe, p, sms, stream);
}
void launch_warp_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(warp_load_probe, p, sms, stream);
}

}  // namespace flexep::tools
