// The hybridep dispatch kernel: persistent (grid = dispatch_sms CTAs of 8 warps), warp-specialised.
//
//   sender warps (0-3 of every CTA): chunk c of this rank's tokens goes to sender warp c mod W.
//     For each token and each destination rank d with a staged record (preprocess.cu): the record
//     (entries sorted by row, epoch stamped in word 0) into d's record slot (me, t), and the token
//     row - read ONCE from HBM, 16 bytes per lane - stored into d's window at the token's first row
//     there. So a row crosses NVLink at most once per destination rank. After the chunk: every
//     lane fences its stores at system scope, the warp synchronises, and lane d releases the epoch
//     into chunk flag (me, c) on rank d - for EVERY rank, also when nothing went there, so that a
//     receiver always waits for every chunk of every source (that is what makes the count region
//     safe to overwrite in the next call: docs/hybridep.md).
//   receiver warps (4-7): first zero this rank's padding rows (no remote dependency), then take the
//     (source s, chunk c) items, source-major, item i to receiver warp i mod W: lane 0 acquires
//     chunk flag (s, c) (deadline: dispatch:tokens), the warp synchronises, then for each token of
//     the chunk whose record carries this call's epoch, the probs are written and the row is copied
//     from its first row into the token's other rows on this rank (local HBM, read once).
//
// No warp waits for another warp of this grid, and senders wait for nothing: the kernel makes
// progress on any number of resident CTAs. The last CTA to finish publishes the new epoch.
//
// Row format: bf16 rows of 2H bytes, or (dispatch_fp8) e4m3 rows of H bytes plus H / 128 fp32 scales
// that travel exactly like the row (same first row, same fan-out, zeroed padding).
#include <cuda_runtime.h>

#include "dispatch/hybridep/access.cuh"
#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/kernel_launch.h"
#include "dispatch/hybridep/kernels.h"
#include "dispatch/hybridep/rows.cuh"
#include "dispatch/hybridep/tma.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane while sending a row
constexpr int kReceiverWarps = kThreads / 32 - kDispatchSenderWarps;

// Stores row `src` (words 16-byte words, loaded once) into row `dst_of(d)` of every destination d in
// `dests`; lane d holds its destination's row address in `my_dst`. Loop bounds are the same in every
// lane (the shuffles need all 32).
__device__ __forceinline__ void store_to_destinations(const uint4* src, long long words, unsigned dests,
                                                      unsigned long long my_dst, int lane) {
  for (long long i0 = 0; i0 < words; i0 += 32 * kUnroll) {
    uint4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = i0 + u * 32 + lane;
      if (i < words) x[u] = __ldg(src + i);
    }
    for (unsigned m = dests; m != 0; m &= m - 1) {
      uint4* dst = reinterpret_cast<uint4*>(__shfl_sync(kFullMask, my_dst, __ffs(m) - 1));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long i = i0 + u * 32 + lane;
        if (i < words) dst[i] = x[u];
      }
    }
  }
}

__device__ void send_chunk(const DispatchView& v, const DispatchCall& c, int chunk, unsigned epoch, bool move,
                           int lane) {
  const int R = v.ranks, me = v.rank;
  const long long words = c.row_bytes / 16;          // 16-byte words per row
  const long long scale_words = c.scale_bytes / 16;  // 0 for bf16 rows
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = c.tokens < t0 + kChunkTokens ? c.tokens : t0 + kChunkTokens;
  const uint4* hidden = static_cast<const uint4*>(c.hidden);
  for (long long t = t0; move && t < t1; ++t) {
    // Lane d looks at the staged record (d, t): its entry count and the first row on rank d.
    unsigned n = 0;
    int row0 = 0;
    if (lane < R) {
      const uint4 head = *reinterpret_cast<const uint4*>(staging_at(v, lane, t));  // {0, n, row0, prob0}
      n = head.y;
      row0 = static_cast<int>(head.z);
      // Our own preprocess wrote it; still, never write outside a peer's window.
      if (n > static_cast<unsigned>(v.width) || (n > 0 && (row0 < 0 || row0 >= v.capacity_rows))) {
        report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, me, row0, v.capacity_rows);
        n = 0;
      }
    }
    const unsigned dests = __ballot_sync(kFullMask, n > 0);
    if (dests == 0) continue;

    // The records: destination d's slot (me, t), with this call's epoch in word 0.
    for (unsigned m = dests; m != 0; m &= m - 1) {
      const int d = __ffs(m) - 1;
      const unsigned nd = __shfl_sync(kFullMask, n, d);
      const uint4* src = reinterpret_cast<const uint4*>(staging_at(v, d, t));
      uint4* dst = reinterpret_cast<uint4*>(record_at(records_of(v, d), me, t, v.max_tokens, v.record_bytes));
      for (int w = lane; w < record_words(nd); w += 32) {
        uint4 x = src[w];
        if (w == 0) x.x = epoch;
        dst[w] = x;
      }
    }

    // The row: each 16-byte word loaded once from HBM, then stored into every destination's first
    // row; FP8 scales likewise.
    const unsigned long long my_dst =
        n > 0 ? reinterpret_cast<unsigned long long>(token_row(v, lane, row0, c.row_bytes)) : 0ull;
    store_to_destinations(hidden + t * words, words, dests, my_dst, lane);
    if (scale_words > 0) {
      const unsigned long long my_scales =
          n > 0 ? reinterpret_cast<unsigned long long>(scale_row(v, lane, row0, c.scale_bytes)) : 0ull;
      store_to_destinations(static_cast<const uint4*>(c.scales) + t * scale_words, scale_words, dests, my_scales, lane);
    }
  }
  // Publish the chunk on every rank: this warp's record and row stores happen-before the flag.
  fence_sys();
  __syncwarp();
  if (lane < R) st_release_sys(chunk_flag(v, lane, me, chunk), epoch);
}

// Returns false when the wait failed (timeout): the warp then stops.
__device__ bool receive_chunk(const DispatchView& v, const DispatchCall& c, int s, int chunk, unsigned epoch, bool move,
                              const WaitContext& wait, int lane) {
  const int me = v.rank;
  bool ok = true;
  if (lane == 0) ok = wait_flag_at_least(chunk_flag(v, me, s, chunk), epoch, wait, s);
  __syncwarp();  // lane 0's acquire is ordered before every lane's reads below
  if (!__shfl_sync(kFullMask, ok, 0)) return false;
  if (!move) return true;

  const long long words = c.row_bytes / 16, scale_words = c.scale_bytes / 16;
  const long long out_rows = v.control->out_rows;
  const long long Ts = tokens_of(v.control, s, v.max_tokens);
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = Ts < t0 + kChunkTokens ? Ts : t0 + kChunkTokens;
  const unsigned char* records = records_of(v, me);
  for (long long t = t0; t < t1; ++t) {
    const unsigned char* rec = record_at(records, s, t, v.max_tokens, v.record_bytes);
    // Written by rank s over NVLink: read through L2.
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));  // {epoch, n, row0, prob0}
    if (head.x != epoch) continue;  // token t of rank s has no row on this rank in this call
    const unsigned n = head.y;
    const RecordEntry* entries = record_entries(rec);
    bool bad = n == 0 || n > static_cast<unsigned>(v.width);
    long long bad_row = -1;
    for (unsigned q = lane; !bad && q < n; q += 32) {
      const int row = __ldcg(&entries[q].row);
      if (row < 0 || row >= out_rows) bad = true, bad_row = row;
    }
    if (__any_sync(kFullMask, bad)) {
      if (bad) report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, s, bad_row, out_rows);
      continue;
    }
    // Probs of every entry, the first one included (the sender wrote only its row).
    for (unsigned q = lane; q < n; q += 32) *prob_at(v, me, __ldcg(&entries[q].row)) = __ldcg(&entries[q].prob);
    // The row landed in entries[0]; copy it into the others: each word read once.
    if (n > 1) {
      const uint4* first = token_row(v, me, static_cast<long long>(head.z), c.row_bytes);
      for (long long i = lane; i < words; i += 32) {
        const uint4 x = __ldcg(first + i);
        for (unsigned q = 1; q < n; ++q) token_row(v, me, __ldcg(&entries[q].row), c.row_bytes)[i] = x;
      }
      if (scale_words > 0) {
        const uint4* first_scales = scale_row(v, me, static_cast<long long>(head.z), c.scale_bytes);
        for (long long i = lane; i < scale_words; i += 32) {
          const uint4 x = __ldcg(first_scales + i);
          for (unsigned q = 1; q < n; ++q) scale_row(v, me, __ldcg(&entries[q].row), c.scale_bytes)[i] = x;
        }
      }
    }
  }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ DispatchView v, const __grid_constant__ DispatchCall c) {
  tma::grid_dependency_wait();  // launched right after the preprocess kernel: wait for its results
  const unsigned epoch = op_epoch(&v.control->op);
  __shared__ int s_broken, s_move;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);               // the count exchange timed out: move nothing, wait for nothing
    s_move = !s_broken && v.control->abort == 0;  // the preprocess kernel's decision, alike on all ranks
  }
  __syncthreads();
  const bool move = s_move != 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (!s_broken) {
    if (warp < kDispatchSenderWarps) {
      const int W = gridDim.x * kDispatchSenderWarps, w = blockIdx.x * kDispatchSenderWarps + warp;
      const int chunks = num_chunks(c.tokens);
      for (int chunk = w; chunk < chunks; chunk += W) send_chunk(v, c, chunk, epoch, move, lane);
    } else {
      const int W = gridDim.x * kReceiverWarps, w = blockIdx.x * kReceiverWarps + (warp - kDispatchSenderWarps);
      if (move) {
        zero_unfilled_rows(token_row(v, v.rank, 0, c.row_bytes), prob_at(v, v.rank, 0), c.row_bytes / 16, v.begin,
                           v.kept, v.tpe, v.local_experts, v.control->used_rows, v.control->out_rows, w, W, lane);
        if (c.scale_bytes > 0)
          zero_unfilled_rows(scale_row(v, v.rank, 0, c.scale_bytes), nullptr, c.scale_bytes / 16, v.begin, v.kept,
                             v.tpe, v.local_experts, v.control->used_rows, v.control->out_rows, w, W, lane);
      }
      const WaitContext wait{v.status, v.timeout_ns, Phase::dispatch_tokens};
      int item = 0;
      bool ok = true;
      for (int s = 0; ok && s < v.ranks; ++s) {
        const int chunks = num_chunks(tokens_of(v.control, s, v.max_tokens));
        for (int chunk = 0; ok && chunk < chunks; ++chunk, ++item)
          if (item % W == w) ok = receive_chunk(v, c, s, chunk, epoch, move, wait, lane);
      }
    }
  }
  if (last_cta_to_finish(&v.control->op) && threadIdx.x == 0) finish_op(&v.control->op, epoch);
}

}  // namespace

void launch_dispatch(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream,
                     bool after_preprocess) {
  launch_kernel(dispatch_kernel, grid, kThreads, 0, stream, after_preprocess, v, c);
}

}  // namespace flexep::hybridep
