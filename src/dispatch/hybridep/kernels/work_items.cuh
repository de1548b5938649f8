// Work items of the hybridep kernels on the device: the parts of parts.h are handed out one at a
// time through an atomic counter, so no pipeline waits for a slow one at the end. Each pipeline's
// first item is its own index, without the counter: at the start every pipeline is free anyway, and
// a small call (decode: about one part per pipeline) then pays no atomic round trip at all.
//
// A chunk's flag is released once all its parts are done: every part's pipeline counts itself in
// `work[kWorkChunks + chunk]` after its stores are complete, and the last one releases the flag and
// resets the counter (the next kernel on the buffer comes after this one in stream order). The two
// "next item" counters are reset by the grid's last CTA.
#pragma once

#include "dispatch/hybridep/kernels/access.cuh"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/kernels/layout_math.h"
#include "dispatch/hybridep/kernels/parts.h"

namespace flexep::hybridep {

// Words of the work array (plain device memory next to each buffer, zeroed at allocation).
constexpr int kWorkFirst = 0;   // next item of the kernel's first phase (dispatch: sends; combine: partials)
constexpr int kWorkSecond = 1;  // next item of the second phase (dispatch: fan-out; combine: outputs)
constexpr int kWorkChunks = 2;  // then one counter per chunk (dispatch) or per (source, chunk) (combine)

// The next item for this warp: lane 0 takes it from the counter, every lane gets it.
__device__ inline long long grab_item(unsigned* counter, int lane) {
  unsigned i = 0;
  if (lane == 0) i = atomicAdd(counter, 1u);
  return static_cast<long long>(__shfl_sync(kFullMask, i, 0));
}

// The items [0, n) of one phase as pipeline `pipe` of `pipelines` takes them: first item `pipe`,
// then items pipelines, pipelines + 1, ... from `counter` (never touched when n <= pipelines);
// every item goes to exactly one pipeline. next() returns n or more when there is none left.
struct ItemQueue {
  unsigned* counter;
  long long n;
  int pipe, pipelines;
  bool started = false;

  __device__ long long next(int lane) {
    if (!started) {
      started = true;
      return pipe;
    }
    if (n <= pipelines) return n;
    return pipelines + grab_item(counter, lane);
  }
};

// Counts one finished part of the chunk whose counter is `done`; returns true in the caller that
// counted the last of `per_chunk` parts (it then owns the release of the chunk's flag). The caller
// has made everything the part wrote complete and fenced at system scope before; the returned true
// comes after an acquire fence, so that the release that follows publishes every part's writes.
__device__ inline bool count_part(unsigned* done, int per_chunk) {
  fence_sys(::cuda::memory_order_seq_cst);
  const unsigned before = atomicAdd(done, 1u);
  if (before + 1 != static_cast<unsigned>(per_chunk)) return false;
  fence_sys(::cuda::memory_order_seq_cst);
  *done = 0;  // every part of this call has counted itself; the next kernel comes in stream order
  return true;
}

// The end of every combine-side kernel (combine, dispatch_backward, combine_backward),
// called by every thread: the grid's last CTA lets every rank overwrite what this grid read of its
// window ("consumed"), resets the work counters and ends the operation.
__device__ inline void finish_combine_side(const CombineView& v, const OpSession& op) {
  if (!op.last_cta_to_finish()) return;
  const unsigned epoch = op.epoch();
  if (threadIdx.x < v.ranks) st_sys(consumed_flag(v, threadIdx.x, v.rank), epoch, ::cuda::memory_order_release);
  if (threadIdx.x == 0) {
    v.work[kWorkFirst] = 0;
    v.work[kWorkSecond] = 0;
    op.finish();
  }
}

}  // namespace flexep::hybridep
