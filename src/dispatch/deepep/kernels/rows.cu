// The sender side of the deepep dispatch and combine_backward: blocking mode's chunk bases, and the
// row stores into the peers' windows, each row's place derived from the count kernel's masks
// (device/chunk_rows.cuh; the counts before them: dispatch/common/count_routes.h), with budget
// mode's tail cleared on the way.
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/chunk_rows.cuh"
#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;

namespace {

constexpr int kThreads = 256;
constexpr int kSendThreads = 1024;  // 32 warps per SM, each with kRowUnroll loads in flight

__global__ void __launch_bounds__(kThreads) chunk_bases_kernel(ChunkBasesCall c) {
  __shared__ typename cub::BlockScan<int, kThreads>::TempStorage scan;
  const int d = static_cast<int>(blockIdx.x);
  chunk_bases<kThreads>(c.dest_mask + d * c.chunks, c.chunks, c.layout[layout_word::row_begin + d],
                        c.chunk_base + d * c.chunks, scan);
}

// This rank's tail (TailCall), a warp per row, spread over the grid's warps.
__device__ inline void clear_tail(const TailCall& c, std::int64_t warp, std::int64_t warps, int lane) {
  const std::int64_t vectors = c.row_bytes / 16;
  for (std::int64_t r = received_rows(c.layout) + warp; r < c.rows; r += warps) {
    if (c.zero_rows) {
      zero_row(reinterpret_cast<uint4*>(c.window + c.rows_at) + r * vectors, vectors, lane);
      zero_row(reinterpret_cast<float*>(c.window + c.win.scales) + r * c.scale_cols, c.scale_cols, lane);
    }
    if (!c.slots) continue;
    for (int j = lane; j < c.k; j += 32) {
      reinterpret_cast<int*>(c.window + c.win.idx)[r * c.k + j] = -1;
      reinterpret_cast<float*>(c.window + c.win.w)[r * c.k + j] = 0.0f;
    }
    if (lane == 0) reinterpret_cast<int*>(c.window + c.win.src)[r] = -1;
  }
}

// One warp per (destination, token) pair; the row in 16-byte vectors (then its FP8 scales), the slots
// by lanes 0..k-1.
__global__ void __launch_bounds__(kSendThreads) send_rows_kernel(SendRowsCall c) {
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * (kSendThreads / 32) + threadIdx.x / 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kSendThreads / 32);
  const std::int64_t vectors = c.row_bytes / 16;
  const std::int64_t pairs = static_cast<std::int64_t>(c.ranks) * c.tokens;
  const bool derive = c.dest_row == nullptr;  // a dispatch: each row from the masks, written for the way back
  const bool aborted = derive && c.layout != nullptr && c.layout[layout_word::abort] != 0;
  for (std::int64_t p = warp; p < pairs; p += warps) {
    const int d = static_cast<int>(p / c.tokens);
    const std::int64_t t = p - static_cast<std::int64_t>(d) * c.tokens;
    int row = -1;
    if (!derive) {
      row = c.dest_row[p];
    } else {
      if (!aborted) row = token_row(c.dest_mask + d * c.chunks, c.chunk_base + d * c.chunks, t);
      if (c.budget >= 0 && row >= c.budget) row = -1;  // the drop policy: past the receiver's budget
      if (lane == 0) c.dest_row_out[p] = row;
    }
    if (row < 0) continue;
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
  if (c.tail.rows > 0) clear_tail(c.tail, warp, warps, lane);
  for (std::int64_t i = warp * 32 + lane; i < c.minus_one_count; i += warps * 32) c.minus_one[0][i] = c.minus_one[1][i] = -1;
  publish_to_peers(session, c.peers, c.kind, c.ranks, c.rank, c.failed_arg);
}

}  // namespace

void launch_chunk_bases(const ChunkBasesCall& c, cudaStream_t stream) {
  if (c.chunks == 0) return;
  chunk_bases_kernel<<<c.ranks, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep chunk_bases_kernel");
}

void launch_send_rows(const SendRowsCall& c, int ctas, cudaStream_t stream) {
  send_rows_kernel<<<ctas < 1 ? 1 : ctas, kSendThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep send_rows_kernel");
}

}  // namespace flexep::deepep
