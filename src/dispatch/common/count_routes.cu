// The validation and counting kernel of count_routes.h.
#include "dispatch/common/count_routes.h"
#include "flexep/cuda/runtime.h"

namespace flexep {

namespace {

constexpr int kThreads = 256;
constexpr std::size_t kSharedBins = 32 * 1024 / sizeof(unsigned);

__device__ inline long long load_index(const void* p, bool is64, std::int64_t i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<const int*>(p)[i];
}

__global__ void __launch_bounds__(kThreads) count_routes_kernel(CountRoutesCall c, bool in_shared) {
  extern __shared__ unsigned hist[];  // [E + R] when in_shared
  const int bins = c.experts + c.ranks;
  if (in_shared) {
    for (int i = static_cast<int>(threadIdx.x); i < bins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
  }
  auto count = [&](int bin, unsigned n) {
    if (in_shared)
      atomicAdd(&hist[bin], n);
    else if (bin < c.experts)
      atomicAdd(reinterpret_cast<unsigned long long*>(c.expert_counts) + bin, static_cast<unsigned long long>(n));
    else
      atomicAdd(reinterpret_cast<unsigned long long*>(c.dest_counts) + (bin - c.experts),
                static_cast<unsigned long long>(n));
  };
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  // Warp-uniform: `first` is the warp's first token (blockDim is a multiple of 32).
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
       first < c.tokens; first += stride) {
    const std::int64_t t = first + lane;
    const bool active = t < c.tokens;
    const std::int64_t base = t * c.k;
    // Pass 1: validate. A bad id is reported and then treated as -1: it never becomes an index.
    for (int j = 0; active && j < c.k; ++j) {
      const long long e = load_index(c.indices, c.indices_i64, base + j);
      bool ok = e >= 0 && e < c.experts;
      if (e != -1 && !ok) cuda::report_device_error(c.errors, cuda::DeviceArg::indices, t, j, e, c.experts);
      for (int q = 0; ok && q < j; ++q)
        if (load_index(c.indices, c.indices_i64, base + q) == e) {
          ok = false;
          cuda::report_device_error(c.errors, cuda::DeviceArg::indices, t, j, e, c.experts);
        }
      c.slot_expert[base + j] = ok ? static_cast<int>(e) : -1;
    }
    // Pass 2: count the valid pairs, and the token once per destination rank.
    if (c.dest_mask == nullptr) {
      for (int j = 0; active && j < c.k; ++j) {
        const int e = c.slot_expert[base + j];
        if (e < 0) continue;
        count(e, 1);
        const int d = e / c.local_experts;
        int& flag = c.dest_flag[static_cast<std::int64_t>(d) * c.tokens + t];
        if (flag == 0) {  // only this thread touches token t's flags
          flag = 1;
          count(c.experts + d, 1);
        }
      }
      continue;
    }
    const std::int64_t chunk = first / 32;
    if (c.ranks <= 32) {  // the token's ranks as bits; one ballot per rank gives its word, kept by lane d
      unsigned ranks = 0;
      for (int j = 0; active && j < c.k; ++j) {
        const int e = c.slot_expert[base + j];
        if (e < 0) continue;
        count(e, 1);
        ranks |= 1u << (e / c.local_experts);
      }
      unsigned word = 0;
      for (int d = 0; d < c.ranks; ++d) {
        const unsigned w = __ballot_sync(0xffffffffu, (ranks >> d) & 1u);
        if (lane == d) word = w;
      }
      if (lane < c.ranks) {
        c.dest_mask[lane * c.mask_chunks + chunk] = word;
        if (word != 0) count(c.experts + lane, __popc(word));
      }
      continue;
    }
    // More ranks than lanes: the warp clears its words, ORs its tokens' bits in (a repeat ORs the
    // same bit), and counts each word's bits.
    for (int d = lane; d < c.ranks; d += 32) c.dest_mask[d * c.mask_chunks + chunk] = 0;
    __syncwarp();
    for (int j = 0; active && j < c.k; ++j) {
      const int e = c.slot_expert[base + j];
      if (e < 0) continue;
      count(e, 1);
      atomicOr(c.dest_mask + (e / c.local_experts) * c.mask_chunks + chunk, 1u << lane);
    }
    __syncwarp();
    for (int d = lane; d < c.ranks; d += 32) {
      const unsigned n = __popc(__ldcg(c.dest_mask + d * c.mask_chunks + chunk));
      if (n != 0) count(c.experts + d, n);
    }
  }
  if (!in_shared) return;
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < bins; i += blockDim.x) {
    if (hist[i] == 0) continue;
    auto* to = i < c.experts ? c.expert_counts + i : c.dest_counts + (i - c.experts);
    atomicAdd(reinterpret_cast<unsigned long long*>(to), static_cast<unsigned long long>(hist[i]));
  }
}

}  // namespace

void launch_count_routes(const CountRoutesCall& c, cudaStream_t stream) {
  if (c.tokens == 0 || c.k == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((c.tokens + kThreads - 1) / kThreads, 4096));
  const auto bins = static_cast<std::size_t>(c.experts + c.ranks);
  const bool in_shared = bins <= kSharedBins;
  count_routes_kernel<<<blocks, kThreads, in_shared ? bins * sizeof(unsigned) : 0, stream>>>(c, in_shared);
  FLEXEP_CUDA_CHECK_LAUNCH("count_routes_kernel");
}

}  // namespace flexep
