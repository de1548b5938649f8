// The hybridep combine kernel (also dispatch_backward): persistent (grid = combine_sms CTAs of 8
// warps), warp-specialised. The two levels of docs/semantics.md's combine:
//
//   producer warps (0-3), this rank as OWNER of expert rows: first acquire every rank's "consumed"
//     flag of the previous operation on this combine buffer (epoch - 1; deadline: *:buffer-reuse):
//     nobody still reads the partials we are about to overwrite. Then the (source s, chunk c)
//     items, source-major, item i to producer warp i mod W: for each token t of the chunk that has a
//     record from this handle's dispatch, partial (s, t) = bf16(fp32 sum of its rows in record
//     order = ascending row = ascending local expert), written into this rank's window; with
//     grad_probs (dispatch_backward) also each entry's prob gradient. Then the warp publishes ready
//     flag (me, c) on rank s.
//   consumer warps (4-7), this rank as SOURCE of the tokens: chunk c of its tokens to consumer warp
//     c mod W: lane d acquires ready flag (d, c) from every rank d (deadline: *:partials), then for
//     each token out[t] = bf16(fp32 sum over d ascending, among the ranks that got t, of partial
//     (me, t) pulled from d's window over NVLink); with grad_weights also each slot's prob gradient,
//     pulled from the owner's window.
//
// Every addition happens in the host backend's order from +0.0f, so the result is bitwise equal to
// it and identical run to run. The last CTA to finish tells every rank that this rank is done
// reading its window ("consumed", after the whole grid's reads) and publishes the new epoch.
#include <cuda_runtime.h>

#include "dispatch/hybridep/access.cuh"
#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/kernels.h"
#include "dispatch/hybridep/work_items.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kConsumerWarps = kThreads / 32 - kCombineProducerWarps;

// Level 1 for the tokens of (source s, chunk c); publishes the chunk to rank s.
__device__ void produce_item(const CombineView& v, const HandleView& h, const CombineCall& c, int s, int chunk,
                             unsigned epoch, unsigned dispatch_epoch, int lane) {
  const int me = v.rank;
  const long long words = v.hidden / 8;
  const uint4* rows = static_cast<const uint4*>(c.rows);
  const long long Ts = tokens_of(h.control, s, h.max_tokens);
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = Ts < t0 + kChunkTokens ? Ts : t0 + kChunkTokens;
  for (long long t = t0; t < t1; ++t) {
    const unsigned char* rec = record_at(h.records, s, t, h.max_tokens, h.record_bytes);
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));
    if (head.x != dispatch_epoch) continue;  // t has no row here: rank s will not read (s, t)
    const unsigned n = head.y;
    const RecordEntry* entries = record_entries(rec);
    bool bad = n == 0 || n > static_cast<unsigned>(v.width);
    long long bad_row = -1;
    for (unsigned q = lane; !bad && q < n; q += 32) {
      const int row = __ldcg(&entries[q].row);
      if (row < 0 || row >= h.rows) bad = true, bad_row = row;
    }
    if (__any_sync(kFullMask, bad)) {
      if (bad) report_status(v.status, StatusCode::corrupt, c.data_phase, s, bad_row, h.rows);
      continue;
    }
    uint4* partial = partial_row(v, me, s, t);
    for (long long i = lane; i < words; i += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (unsigned q = 0; q < n; ++q)
        add_bf16x8(acc, rows[static_cast<long long>(__ldcg(&entries[q].row)) * words + i]);
      partial[i] = to_bf16x8(acc);
    }
    if (c.grad_probs)
      for (unsigned q = lane; q < n; q += 32)
        *grad_at(v, me, s, t, static_cast<int>(q)) = c.grad_probs[__ldcg(&entries[q].row)];
  }
  warp_publish(ready_flag(v, s, me, chunk), epoch, lane, 0);
}

// Level 2 for this rank's tokens of chunk c. False when a wait failed.
__device__ bool consume_chunk(const CombineView& v, const HandleView& h, const CombineCall& c, int chunk,
                              unsigned epoch, const WaitContext& wait, int lane) {
  const int me = v.rank, R = v.ranks;
  // Every rank publishes every chunk of ours (also with no token of ours): wait for all of them.
  if (!warp_wait_ranks(ready_flag(v, me, 0, chunk), v.max_chunks, R, epoch, wait, lane)) return false;
  const long long words = v.hidden / 8;
  uint4* out = static_cast<uint4*>(c.out);
  const long long t0 = static_cast<long long>(chunk) * kChunkTokens;
  const long long t1 = h.tokens < t0 + kChunkTokens ? h.tokens : t0 + kChunkTokens;
  for (long long t = t0; t < t1; ++t) {
    // Lane d: did rank d get token t (the staged record of the dispatch has entries)?
    unsigned n = 0;
    if (lane < R)
      n = reinterpret_cast<const RecordHeader*>(record_at(h.staging, lane, t, h.max_tokens, h.record_bytes))->n;
    const unsigned owners = __ballot_sync(kFullMask, n > 0);
    for (long long i = lane; i < words; i += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (unsigned m = owners; m != 0; m &= m - 1) add_bf16x8(acc, __ldcg(partial_row(v, __ffs(m) - 1, me, t) + i));
      out[t * words + i] = to_bf16x8(acc);
    }
    if (c.grad_weights) {
      for (int j = lane; j < h.slots; j += 32) {
        const long long i = t * h.slots + j;
        const int entry = h.slot_entry[i];
        float g = 0.0f;
        if (entry >= 0) {
          const int d = entry / v.width, q = entry % v.width;
          if (d < R) g = __ldcg(grad_at(v, d, me, t, q));
        }
        if (!h.multihot) {
          c.grad_weights[i] = g;
        } else {
          const int e = h.slot_expert[i];
          if (e >= 0 && e < h.experts) c.grad_weights[t * h.experts + e] = g;
        }
      }
    }
  }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ CombineView v, const __grid_constant__ HandleView h,
                   const __grid_constant__ CombineCall c) {
  const unsigned epoch = op_epoch(v.control);
  __shared__ int s_broken;
  __shared__ unsigned s_dispatch_epoch;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);
    s_dispatch_epoch = ld_volatile(&h.control->op.epoch);  // the handle's dispatch was the last one
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (!s_broken) {
    if (warp < kCombineProducerWarps) {
      const int W = gridDim.x * kCombineProducerWarps, w = blockIdx.x * kCombineProducerWarps + warp;
      const WaitContext reuse{v.status, v.timeout_ns, c.reuse_phase};
      if (warp_wait_ranks(consumed_flag(v, v.rank, 0), 1, v.ranks, epoch - 1, reuse, lane)) {
        int item = 0;
        for (int s = 0; s < v.ranks; ++s) {
          const int chunks = num_chunks(tokens_of(h.control, s, h.max_tokens));
          for (int chunk = 0; chunk < chunks; ++chunk, ++item)
            if (item % W == w) produce_item(v, h, c, s, chunk, epoch, s_dispatch_epoch, lane);
        }
      }
    } else {
      const int W = gridDim.x * kConsumerWarps, w = blockIdx.x * kConsumerWarps + (warp - kCombineProducerWarps);
      const WaitContext wait{v.status, v.timeout_ns, c.data_phase};
      const int chunks = num_chunks(h.tokens);
      for (int chunk = w; chunk < chunks; chunk += W)
        if (!consume_chunk(v, h, c, chunk, epoch, wait, lane)) break;
    }
  }
  finish_combine_side(v, epoch);
}

}  // namespace

void launch_combine(const CombineView& v, const HandleView& h, const CombineCall& c, int grid, cudaStream_t stream) {
  combine_kernel<<<grid, kThreads, 0, stream>>>(v, h, c);
  FLEXEP_CUDA_CHECK_LAUNCH("hybridep combine_kernel");
}

}  // namespace flexep::hybridep
