// The hybridep combine_backward kernel: the dispatch of grad_out [T, H] along a saved handle, as a
// PULL so that the result is a fresh tensor and the dispatch's output (the experts' saved input,
// which lives in the dispatch window) is left alone. Persistent, combine_sms CTAs of 8 warps, on
// the combine buffer:
//
//   producer warps (0-3), this rank as SOURCE: acquire every rank's "consumed" flag of the previous
//     operation on the combine buffer (deadline: combine_backward:buffer-reuse), then copy its
//     grad_out rows chunk by chunk into its own window (the staging rows) and release ready flag
//     (me, c) on every rank.
//   consumer warps (4-7), this rank as OWNER of expert rows: zero the output rows no pair fills
//     (padding, budget tail), then the (source s, chunk c) items: acquire ready flag (s, c)
//     (deadline: combine_backward:rows), and for each token of the chunk with a record from the
//     handle's dispatch, pull its grad_out row from rank s's window over NVLink once and store it
//     into every row the token has here.
//
// The last CTA tells every rank that its staging rows have been read ("consumed") and publishes
// the new epoch.
#include <cuda_runtime.h>

#include "dispatch/hybridep/access.cuh"
#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/kernels.h"
#include "dispatch/hybridep/work_items.cuh"
#include "dispatch/hybridep/rows.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kConsumerWarps = kThreads / 32 - kCombineProducerWarps;

__device__ void stage_chunk(const CombineView& v, const HandleView& h, const uint4* grad_out, int chunk, unsigned epoch,
                            int lane) {
  const int me = v.rank;
  const long long words = v.hidden / 8;
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = h.tokens < t0 + kChunkTokens ? h.tokens : t0 + kChunkTokens;
  for (long long t = t0; t < t1; ++t) {
    uint4* dst = partial_row(v, me, 0, t);
    for (long long i = lane; i < words; i += 32) dst[i] = __ldg(grad_out + t * words + i);
  }
  fence_sys();
  __syncwarp();
  if (lane < v.ranks) st_release_sys(ready_flag(v, lane, me, chunk), epoch);
}

__device__ bool pull_item(const CombineView& v, const HandleView& h, uint4* out, int s, int chunk, unsigned epoch,
                          unsigned dispatch_epoch, const WaitContext& wait, int lane) {
  bool ok = true;
  if (lane == 0) ok = wait_flag_at_least(ready_flag(v, v.rank, s, chunk), epoch, wait, s);
  __syncwarp();
  if (!__shfl_sync(kFullMask, ok, 0)) return false;
  const long long words = v.hidden / 8;
  const long long Ts = tokens_of(h.control, s, h.max_tokens);
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = Ts < t0 + kChunkTokens ? Ts : t0 + kChunkTokens;
  for (long long t = t0; t < t1; ++t) {
    const unsigned char* rec = record_at(h.records, s, t, h.max_tokens, h.record_bytes);
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));
    if (head.x != dispatch_epoch) continue;
    const unsigned n = head.y;
    const RecordEntry* entries = record_entries(rec);
    bool bad = n == 0 || n > static_cast<unsigned>(v.width);
    long long bad_row = -1;
    for (unsigned q = lane; !bad && q < n; q += 32) {
      const int row = __ldcg(&entries[q].row);
      if (row < 0 || row >= h.rows) bad = true, bad_row = row;
    }
    if (__any_sync(kFullMask, bad)) {
      if (bad) report_status(v.status, StatusCode::corrupt, Phase::combine_backward_rows, s, bad_row, h.rows);
      continue;
    }
    const uint4* src = partial_row(v, s, 0, t);  // rank s's staged grad_out row t
    for (long long i = lane; i < words; i += 32) {
      const uint4 x = __ldcg(src + i);
      for (unsigned q = 0; q < n; ++q) out[static_cast<long long>(__ldcg(&entries[q].row)) * words + i] = x;
    }
  }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
    combine_backward_kernel(const __grid_constant__ CombineView v, const __grid_constant__ HandleView h,
                            const uint4* __restrict__ grad_out, uint4* __restrict__ out) {
  const unsigned epoch = op_epoch(v.control);
  __shared__ int s_broken;
  __shared__ unsigned s_dispatch_epoch;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);
    s_dispatch_epoch = ld_volatile(&h.control->op.epoch);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (!s_broken) {
    if (warp < kCombineProducerWarps) {
      const int W = gridDim.x * kCombineProducerWarps, w = blockIdx.x * kCombineProducerWarps + warp;
      const WaitContext reuse{v.status, v.timeout_ns, Phase::combine_backward_reuse};
      if (warp_wait_ranks(consumed_flag(v, v.rank, 0), 1, v.ranks, epoch - 1, reuse, lane)) {
        const int chunks = num_chunks(h.tokens);
        for (int chunk = w; chunk < chunks; chunk += W) stage_chunk(v, h, grad_out, chunk, epoch, lane);
      }
    } else {
      const int W = gridDim.x * kConsumerWarps, w = blockIdx.x * kConsumerWarps + (warp - kCombineProducerWarps);
      const bool valid = h.control->abort == 0;  // an aborted dispatch placed no rows: all zero
      zero_unfilled_rows(out, nullptr, v.hidden / 8, h.begin, h.kept, h.tpe, h.local_experts,
                         valid ? h.control->used_rows : 0, h.rows, w, W, lane);
      const WaitContext wait{v.status, v.timeout_ns, Phase::combine_backward_rows};
      int item = 0;
      bool ok = true;
      for (int s = 0; ok && s < v.ranks; ++s) {
        const int chunks = num_chunks(tokens_of(h.control, s, h.max_tokens));
        for (int chunk = 0; ok && chunk < chunks; ++chunk, ++item)
          if (item % W == w) ok = pull_item(v, h, out, s, chunk, epoch, s_dispatch_epoch, wait, lane);
      }
    }
  }
  finish_combine_side(v, epoch);
}

}  // namespace

void launch_combine_backward(const CombineView& v, const HandleView& h, const void* grad_out, void* out, int grid,
                             cudaStream_t stream) {
  combine_backward_kernel<<<grid, kThreads, 0, stream>>>(v, h, static_cast<const uint4*>(grad_out),
                                                         static_cast<uint4*>(out));
  FLEXEP_CUDA_CHECK_LAUNCH("hybridep combine_backward_kernel");
}

}  // namespace flexep::hybridep
