// The probes of sm_copy_kernels.h. Each CTA first fills its stages with ordinary stores (made
// visible to the bulk-copy unit by a proxy fence), then moves `copies` rows; nothing is checked:
// the probes measure speed (the hybridep tests check the same primitives' results).
#include "dispatch/hybridep/kernels/launch.h"
#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"
#include "sm_copy_kernels.h"

namespace flexep::tools {

namespace tma = flexep::hybridep::tma;

namespace {

constexpr int kThreads = 512;  // 16 warps: the most the warp-store probe uses
constexpr int kMaxInFlight = 8;
constexpr int kMaxStages = 16;  // issuers x in flight (16 rows of 14 KB fill the 227 KB of shared memory)

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

// One issuing thread's bulk loads: rows first, first + step, ... below `copies` (row_of(offset + i)),
// each into the next of its `stages` stages, at most `stages` in flight.
__device__ void bulk_load_rows(const SmCopyParams& p, unsigned char* stages, std::uint64_t* full, int n_stages,
                               int first, int step, int copies, int offset) {
  int n = 0;
  for (int i = first; i < copies; i += step, ++n) {
    const int s = n % n_stages;
    if (n >= n_stages) tma::mbar_wait(&full[s], static_cast<std::uint32_t>((n / n_stages - 1) & 1));
    tma::mbar_arrive_expect_tx(&full[s], static_cast<std::uint32_t>(p.row_bytes));
    tma::load_async(stages + s * p.row_bytes, p.src + (row_of(offset + i) % p.rows) * p.row_bytes,
                    static_cast<std::uint32_t>(p.row_bytes), &full[s]);
  }
  for (int m = n > n_stages ? n - n_stages : 0; m < n; ++m)
    tma::mbar_wait(&full[m % n_stages], static_cast<std::uint32_t>((m / n_stages) & 1));
}

// The mbarriers after `stages` stages of shared memory, initialised by thread 0 (one arrival each).
__device__ std::uint64_t* init_full_barriers(unsigned char* smem, const SmCopyParams& p, int stages) {
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + static_cast<long long>(stages) * p.row_bytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) tma::mbar_init(&full[s], 1);
    tma::fence_mbar_init();
  }
  __syncthreads();
  return full;
}

// `issuers` threads each bulk-load every issuers-th row into their own `in_flight` stages: lane 0 of
// warps 0, step, 2 step, ... (warp w runs on sub-partition w % 4), or lanes 0, 1, ... of warp 0
// (step 0): which of thread, warp and sub-partition limits the bulk loads one issuer has in flight.
__global__ void __launch_bounds__(kThreads, 1) bulk_load_probe(const SmCopyParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  std::uint64_t* full = init_full_barriers(smem, p, p.issuers * p.in_flight);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int step = p.issuer_warp_step;
  const int issuer = step == 0 ? (warp == 0 ? lane : -1) : (lane == 0 && warp % step == 0 ? warp / step : -1);
  if (issuer < 0 || issuer >= p.issuers) return;
  bulk_load_rows(p, smem + static_cast<long long>(issuer) * p.in_flight * p.row_bytes, full + issuer * p.in_flight,
                 p.in_flight, issuer, p.issuers, p.copies, 0);
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

__global__ void __launch_bounds__(kThreads, 1) mixed_load_probe(const SmCopyParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  std::uint64_t* full = init_full_barriers(smem, p, p.in_flight);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == kThreads / 32 - 1) {
    if (lane == 0) bulk_load_rows(p, smem, full, p.in_flight, 0, 1, p.bulk_copies, p.copies);
    return;
  }
  if (warp >= p.warps) return;
  const float acc = sum_rows<8, false>(p, warp, lane);
  if (acc == 1.2345f) p.sink[blockIdx.x] = acc;
}

template <int U>
__device__ void copy_rows(const SmCopyParams& p, int warp, int lane) {
  const int words = p.row_bytes / 16;
  const long long src_rows = p.src_rows > 0 ? p.src_rows : p.rows;
  for (int i = warp; i < p.copies; i += p.warps) {
    const uint4* src = reinterpret_cast<const uint4*>(p.src + (row_of(i) % src_rows) * p.row_bytes);
    uint4* dst = reinterpret_cast<uint4*>(p.dst + (row_of(i) % p.rows) * p.row_bytes);
    for (int base = lane; base < words; base += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + 32 * u < words) x[u] = __ldg(src + base + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + 32 * u < words) dst[base + 32 * u] = x[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) warp_copy_probe(const SmCopyParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= p.warps) return;
  switch (p.in_flight) {
    case 2:
      copy_rows<2>(p, warp, lane);
      break;
    case 4:
      copy_rows<4>(p, warp, lane);
      break;
    default:
      copy_rows<8>(p, warp, lane);
      break;
  }
}

constexpr int kRingConsumerWarps = 4;
constexpr int kRingWarps = 1 + kRingConsumerWarps;
constexpr int kRingWords = 7;  // 16-byte words per consumer thread: rows up to 14 KB, as the combine's
constexpr int kRingSpan = kRingWords * 16 * 32 * kRingConsumerWarps;  // stage bytes: every word read

__global__ void __launch_bounds__(kThreads, 1) ring_load_probe(const SmCopyParams p, const hybridep::RingLayout layout) {
  using hybridep::Job;
  using hybridep::Ring;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kConsumers = 32 * kRingConsumerWarps;
  if (threadIdx.x == 0) {
    for (int r = 0; r < layout.rings; ++r) Ring::make(smem, layout, r).init(kConsumers);
    tma::fence_mbar_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, pipe = warp / kRingWarps, role = warp % kRingWarps;
  if (pipe >= layout.rings) return;
  const Ring ring = Ring::make(smem, layout, pipe);
  if (role == 0) {  // producer: rows pipe, pipe + pipes, ... of this CTA's copies
    unsigned j = 0;
    for (int i = pipe; i < p.copies; i += layout.rings, ++j) {
      ring.acquire(j, lane);
      if (lane == 0) {
        ring.post_expecting(j, Job{0, 0, 0, 0, 0, 0, 0, 0}, static_cast<std::uint32_t>(p.row_bytes));
        tma::load_async(ring.stage(j), p.src + (row_of(i) % p.rows) * p.row_bytes,
                        static_cast<std::uint32_t>(p.row_bytes), ring.full_bar(j));
      }
    }
    ring.acquire(j, lane);
    if (lane == 0) ring.post(j, Job{1, 0, 0, 0, 0, 0, 0, 0});
    return;
  }
  // consumers, as the combine's compute warps: all of a thread's words loaded (all inside the stage), then used
  const int tid = (role - 1) * 32 + lane, words = p.row_bytes / 16;
  uint4 acc[kRingWords];
#pragma unroll
  for (int k = 0; k < kRingWords; ++k) acc[k] = make_uint4(0, 0, 0, 0);
  int since_store = 0, stored = 0;
  Ring::Pos pos = ring.first_pos(static_cast<std::uint32_t>(tid) * 16);
  while (ring.wait(pos).kind == 0) {
    if (p.read_stages) {
      uint4 x[kRingWords];
#pragma unroll
      for (int k = 0; k < kRingWords; ++k) x[k] = hybridep::ld_shared_16(pos.data + k * kConsumers * 16);
#pragma unroll
      for (int k = 0; k < kRingWords; ++k)
        acc[k] = make_uint4(acc[k].x ^ x[k].x, acc[k].y ^ x[k].y, acc[k].z ^ x[k].z, acc[k].w ^ x[k].w);
    }
    ring.release(pos);
    ring.advance(pos);
    if (p.store_every > 0 && ++since_store == p.store_every) {  // one row out, as a partial per token
      since_store = 0;
      uint4* out = reinterpret_cast<uint4*>(p.dst + (row_of(stored++ * layout.rings + pipe) % p.rows) * p.row_bytes);
#pragma unroll
      for (int k = 0; k < kRingWords; ++k)
        if (tid + k * kConsumers < words) out[tid + k * kConsumers] = acc[k];
    }
  }
  ring.release(pos);
  unsigned all = 0;
#pragma unroll
  for (int k = 0; k < kRingWords; ++k) all ^= acc[k].x ^ acc[k].y ^ acc[k].z ^ acc[k].w;
  if (all == 0x12345678u) p.sink[blockIdx.x] = static_cast<float>(all);  // practically never
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
  const int in_flight = p.in_flight < 1 ? 1 : (p.in_flight > kMaxInFlight ? kMaxInFlight : p.in_flight);
  const int issuers = p.issuers < 1 ? 1 : p.issuers;
  const int stages = issuers * in_flight > kMaxStages ? kMaxStages : issuers * in_flight;
  return static_cast<std::size_t>(stages) * p.row_bytes + kMaxStages * sizeof(std::uint64_t);
}

void launch_bulk_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(bulk_store_probe, p, sms, stream);
}
void launch_bulk_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  FLEXEP_CHECK(p.issuers >= 1 && p.issuers <= kThreads / 32 && p.in_flight >= 1 && p.in_flight <= kMaxInFlight &&
                   p.issuers * p.in_flight <= kMaxStages,
               "bulk load probe: issuers x in flight must be at most ", kMaxStages, ", got ", p.issuers, " x ",
               p.in_flight);
  launch(bulk_load_probe, p, sms, stream);
}
void launch_warp_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(warp_store_probe, p, sms, stream);
}
void launch_warp_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  launch(warp_load_probe, p, sms, stream);
}
void launch_ring_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  FLEXEP_CHECK(p.pipes >= 1 && p.pipes * kRingWarps <= kThreads / 32, "ring load probe: 1 to ",
               kThreads / 32 / kRingWarps, " pipelines, got ", p.pipes);
  FLEXEP_CHECK(p.row_bytes <= kRingSpan, "ring load probe: rows up to ", kRingSpan, " bytes, got ", p.row_bytes);
  int device = 0, optin = 0;
  FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
  FLEXEP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const hybridep::RingLayout layout =
      hybridep::fit_rings(p.pipes, static_cast<std::size_t>(kRingSpan), 0, 2, 8, static_cast<std::size_t>(optin));
  FLEXEP_CHECK(layout.stages >= 2, "ring load probe: ", p.pipes, " rings of rows of ", p.row_bytes,
               " bytes do not fit in shared memory");
  FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(ring_load_probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(layout.total_bytes())));
  ring_load_probe<<<sms, kThreads, layout.total_bytes(), stream>>>(p, layout);
  FLEXEP_CUDA_CHECK_LAUNCH("sm-copy ring load probe");
}
void launch_warp_copy_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  FLEXEP_CHECK(p.warps >= 1 && p.warps <= kThreads / 32, "warp copy probe: 1 to ", kThreads / 32, " warps, got ",
               p.warps);
  launch(warp_copy_probe, p, sms, stream);
}
void launch_mixed_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream) {
  FLEXEP_CHECK(p.warps >= 1 && p.warps < kThreads / 32, "mixed load probe: 1 to ", kThreads / 32 - 1,
               " loading warps (the last warp issues the bulk loads), got ", p.warps);
  launch(mixed_load_probe, p, sms, stream);
}

}  // namespace flexep::tools
