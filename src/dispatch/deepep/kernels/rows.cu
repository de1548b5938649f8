// The sender side of the deepep dispatch and combine_backward: the rank of every token among those
// bound for each destination, and the row stores into the peers' windows (the counts before them:
// dispatch/common/count_routes.h).
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/bulk_copy.cuh"
#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/kernels/launch.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;
using hybridep::SmemBudget;

namespace {

constexpr int kThreads = 256;

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

// The first l.warps warps copy the (destination, token) pairs' rows through their rings
// (device/bulk_copy.cuh); the kFieldWarps warps after them store, a lane per pair, the slots (as
// d's local ids), the weights, the source token and the FP8 scales.
__global__ void __launch_bounds__((kMaxCopyWarps + kFieldWarps) * 32)
    send_rows_kernel(const __grid_constant__ SendRowsCall c, const CopyRingLayout l) {
  extern __shared__ __align__(128) unsigned char smem[];
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const std::int64_t pairs = static_cast<std::int64_t>(c.ranks) * c.tokens;
  if (warp < l.warps) {
    const auto where = [&](std::int64_t p) -> RowRoute {
      const int row = c.dest_row[p];
      if (row < 0) return {nullptr, nullptr};
      const int d = static_cast<int>(p / c.tokens);
      const std::int64_t t = p - static_cast<std::int64_t>(d) * c.tokens;
      return {static_cast<const char*>(c.x) + t * c.row_bytes, c.peers.window[d] + c.rows_at + row * c.row_bytes};
    };
    WarpCopyRing(smem, l, warp, lane)
        .copy(RowPieces<decltype(where)>(where, static_cast<std::int64_t>(blockIdx.x) * l.warps + warp,
                                         static_cast<std::int64_t>(gridDim.x) * l.warps, pairs, c.row_bytes,
                                         l.piece_bytes));
  } else if (c.scales != nullptr || c.slot_expert != nullptr) {
    const int field_threads = kFieldWarps * 32;
    for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * field_threads + threadIdx.x - l.warps * 32; p < pairs;
         p += static_cast<std::int64_t>(gridDim.x) * field_threads) {
      const std::int64_t row = c.dest_row[p];
      if (row < 0) continue;
      const int d = static_cast<int>(p / c.tokens);
      const std::int64_t t = p - static_cast<std::int64_t>(d) * c.tokens;
      char* win = c.peers.window[d];
      if (c.scales != nullptr) {
        const float* from = c.scales + t * c.scale_cols;
        float* to = reinterpret_cast<float*>(win + c.win.scales) + row * c.scale_cols;
        int j = 0;
        for (; j + 7 < c.scale_cols; j += 8) {
          float v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) v[u] = __ldg(from + j + u);
#pragma unroll
          for (int u = 0; u < 8; ++u) to[j + u] = v[u];
        }
        for (; j < c.scale_cols; ++j) to[j] = __ldg(from + j);
      }
      if (c.slot_expert != nullptr) {
        for (int j = 0; j < c.k; ++j) {
          const int e = c.slot_expert[t * c.k + j];
          const bool here = e >= 0 && e / c.local_experts == d;
          reinterpret_cast<int*>(win + c.win.idx)[row * c.k + j] = here ? e - d * c.local_experts : -1;
          reinterpret_cast<float*>(win + c.win.w)[row * c.k + j] = here ? c.weights[t * c.k + j] : 0.0f;
        }
        reinterpret_cast<int*>(win + c.win.src)[row] = static_cast<int>(t);
      }
    }
  }
  publish_to_peers(session, c.peers, c.kind, c.ranks, c.rank, c.failed_arg);
}

SmemBudget send_rows_smem;

}  // namespace

void launch_rank_rows(const RankRowsCall& c, cudaStream_t stream) {
  if (c.tokens == 0) return;
  rank_rows_kernel<<<c.ranks, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep rank_rows_kernel");
}

void prepare_send_rows() { hybridep::raise_smem_limit(send_rows_kernel); }

void launch_send_rows(const SendRowsCall& c, int ctas, cudaStream_t stream) {
  const CopyRingLayout l = copy_ring_for(c.row_bytes, send_rows_smem.get(send_rows_kernel));
  send_rows_kernel<<<ctas < 1 ? 1 : ctas, (l.warps + kFieldWarps) * 32, l.bytes(), stream>>>(c, l);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep send_rows_kernel");
}

}  // namespace flexep::deepep
