// The sender side of the deepep dispatch and combine_backward: the rank of every token among those
// bound for each destination, and the row stores into the peers' windows (the counts before them:
// dispatch/common/count_routes.h).
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;

namespace {

constexpr int kThreads = 256;
constexpr int kSendThreads = 1024;  // 32 warps per SM, each with kRowUnroll loads in flight

__global__ void __launch_bounds__(kThreads) rank_rows_kernel(RankRowsCall c) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int d = static_cast<int>(blockIdx.x);
  const int* flag = c.dest_flag + static_cast<std::int64_t>(d) * c.tokens;
  int* row = c.dest_row + static_cast<std::int64_t>(d) * c.tokens;
  const bool abort = c.layout[layout_word::abort] != 0;
  long long next = c.layout[layout_word::row_begin + d];
  for (std::int64_t base = 0; base < c.tokens; base += kThreads) {
    const std::int64_t t = base + threadIdx.x;
    const int f = t < c.tokens && !abort ? flag[t] : 0;
    int before = 0, total = 0;
    Scan(scan).ExclusiveSum(f, before, total);
    const bool kept = c.budget < 0 || next + before < c.budget;
    if (t < c.tokens) row[t] = f && kept ? static_cast<int>(next + before) : -1;
    next += total;
    __syncthreads();  // the scan storage is reused
  }
}

// One warp per (destination, token) pair; the row in 16-byte vectors (then its FP8 scales), the slots
// by lanes 0..k-1.
__global__ void __launch_bounds__(kSendThreads) send_rows_kernel(SendRowsCall c) {
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kSendThreads / 32);
  const std::int64_t vectors = c.row_bytes / 16;
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
    if (c.scales != nullptr)
      copy_row<RowSource::nc>(c.scales + t * c.scale_cols,
                              reinterpret_cast<float*>(win + c.win.scales) + static_cast<std::int64_t>(row) * c.scale_cols,
                              c.scale_cols, lane);
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
  publish_to_peers(session, c.peers, c.kind, c.ranks, c.rank, c.failed_arg);
}

}  // namespace

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
