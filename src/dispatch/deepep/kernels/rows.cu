// The sender side of the deepep dispatch and combine_backward: counting and validation, the rank of
// every token among those bound for each destination, and the row stores into the peers' windows.
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;

namespace {

constexpr int kThreads = 256;
constexpr int kSendThreads = 512;  // 16 warps per SM, each with kRowUnroll loads in flight

__device__ inline long long load_index(const void* p, bool is64, std::int64_t i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<const int*>(p)[i];
}

// The counts gather in a shared histogram first when it fits (`in_shared`): one global atomic per
// CTA and bin instead of one per pair, all on a few addresses.
__global__ void __launch_bounds__(kThreads)
    count_kernel(const void* indices, bool is64, std::int64_t tokens, int k, int experts, int local_experts,
                 int ranks, int* slot_expert, unsigned long long* counts, int* dest_flag,
                 cuda::DeviceErrorRecord* errors, bool in_shared) {
  extern __shared__ unsigned hist[];  // [experts + ranks] when in_shared
  const int bins = experts + ranks;
  if (in_shared) {
    for (int i = static_cast<int>(threadIdx.x); i < bins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
  }
  auto count = [&](int bin) {
    if (in_shared)
      atomicAdd(&hist[bin], 1u);
    else
      atomicAdd(&counts[bin], 1ull);
  };
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    for (int j = 0; j < k; ++j) {
      const long long e = load_index(indices, is64, t * k + j);
      bool ok = e >= 0 && e < experts;
      if (e != -1 && !ok) cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, e, experts);
      for (int q = 0; ok && q < j; ++q)
        if (load_index(indices, is64, t * k + q) == e) {
          ok = false;
          cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, e, experts);
        }
      slot_expert[t * k + j] = ok ? static_cast<int>(e) : -1;
      if (!ok) continue;
      count(static_cast<int>(e));
      const int d = static_cast<int>(e) / local_experts;
      int& flag = dest_flag[static_cast<std::int64_t>(d) * tokens + t];
      if (flag == 0) {  // only this thread touches token t's flags
        flag = 1;
        count(experts + d);
      }
    }
  }
  if (!in_shared) return;
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < bins; i += blockDim.x)
    if (hist[i] != 0) atomicAdd(&counts[i], static_cast<unsigned long long>(hist[i]));
}

__global__ void __launch_bounds__(kThreads) rank_rows_kernel(RankRowsCall c) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int d = static_cast<int>(blockIdx.x);
  const int* flag = c.dest_flag + static_cast<std::int64_t>(d) * c.tokens;
  int* row = c.dest_row + static_cast<std::int64_t>(d) * c.tokens;
  long long next = c.row_begin[d];
  for (std::int64_t base = 0; base < c.tokens; base += kThreads) {
    const std::int64_t t = base + threadIdx.x;
    const int f = t < c.tokens ? flag[t] : 0;
    int before = 0, total = 0;
    Scan(scan).ExclusiveSum(f, before, total);
    if (t < c.tokens) row[t] = f ? static_cast<int>(next + before) : -1;
    next += total;
    __syncthreads();  // the scan storage is reused
  }
}

// One warp per (destination, token) pair; the row in 16-byte vectors, the slots by lanes 0..k-1.
__global__ void __launch_bounds__(kSendThreads) send_rows_kernel(SendRowsCall c) {
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kSendThreads / 32);
  const std::int64_t vectors = c.hidden / 8;  // 8 bf16 per uint4
  const std::int64_t pairs = static_cast<std::int64_t>(c.ranks) * c.tokens;
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * (kSendThreads / 32) + threadIdx.x / 32; p < pairs;
       p += warps) {
    const int row = c.dest_row[p];
    if (row < 0) continue;
    const int d = static_cast<int>(p / c.tokens);
    const std::int64_t t = p - static_cast<std::int64_t>(d) * c.tokens;
    char* win = c.peers.window[d];
    const uint4* from = static_cast<const uint4*>(c.x) + t * vectors;
    uint4* to = reinterpret_cast<uint4*>(win + c.rows_at) + static_cast<std::int64_t>(row) * vectors;
    copy_row<RowSource::nc>(from, to, vectors, lane);
    if (c.slot_expert != nullptr) {
      for (int j = lane; j < c.k; j += 32) {
        const int e = c.slot_expert[t * c.k + j];
        const bool here = e >= 0 && e / c.local_experts == d;
        reinterpret_cast<int*>(win + c.win.idx)[static_cast<std::int64_t>(row) * c.k + j] =
            here ? e - d * c.local_experts : -1;
        reinterpret_cast<float*>(win + c.win.w)[static_cast<std::int64_t>(row) * c.k + j] =
            here ? c.weights[t * c.k + j] : 0.0f;
      }
      if (lane == 0) reinterpret_cast<int*>(win + c.win.src)[row] = static_cast<int>(t);
    }
  }
  publish_to_peers(session, c.peers, c.kind, c.ranks, c.rank);
}

}  // namespace

void launch_count(const void* indices, bool indices_i64, std::int64_t tokens, int k, int experts, int local_experts,
                  int ranks, int* slot_expert, long long* counts, int* dest_flag, cuda::DeviceErrorRecord* errors,
                  cudaStream_t stream) {
  if (tokens == 0 || k == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((tokens + kThreads - 1) / kThreads, 4096));
  const std::size_t hist_bytes = static_cast<std::size_t>(experts + ranks) * sizeof(unsigned);
  const bool in_shared = hist_bytes <= 32 * 1024;
  count_kernel<<<blocks, kThreads, in_shared ? hist_bytes : 0, stream>>>(
      indices, indices_i64, tokens, k, experts, local_experts, ranks, slot_expert,
      reinterpret_cast<unsigned long long*>(counts), dest_flag, errors, in_shared);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep count_kernel");
}

void launch_rank_rows(const RankRowsCall& c, cudaStream_t stream) {
  if (c.tokens == 0) return;
  rank_rows_kernel<<<c.ranks, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep rank_rows_kernel");
}

void launch_send_rows(const SendRowsCall& c, int ctas, cudaStream_t stream) {
  send_rows_kernel<<<ctas < 1 ? 1 : ctas, kSendThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep send_rows_kernel");
}

}  // namespace flexep::deepep
