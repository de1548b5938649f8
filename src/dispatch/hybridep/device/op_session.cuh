// One operation (a kernel's grid) on a buffer, as a session object: it opens with the operation's
// epoch (completed operations + 1, read once by every thread) and closes in the grid's last CTA,
// which publishes what needs the whole grid's work (the new epoch, "consumed" flags). Every kernel
// of the backend is one such operation; OpControl (device_state.h) is its state in device memory.
#pragma once

#include "dispatch/hybridep/device/memory.cuh"
#include "dispatch/hybridep/kernels/device_state.h"

namespace flexep::hybridep {

class OpSession {
 public:
  // Every thread of the CTA; costs one __syncthreads.
  __device__ explicit OpSession(OpControl* op) : op_(op), epoch_(read_epoch(op)) {}

  __device__ unsigned epoch() const { return epoch_; }

  // Every thread of every CTA, at the end of its work. Returns true in all threads of the CTA that
  // finished last; that CTA resets the count (the next kernel on this buffer counts from 0, in
  // stream order) and is the one to publish.
  //   Every CTA fences its work at system scope before counting itself (its reads of peer memory
  //   must be complete before a peer may overwrite that memory), and the last CTA fences after
  //   seeing the full count, so everything the grid did happens-before what it publishes.
  //   The answer reaches the CTA through __syncthreads_or, not a shared variable: nothing for
  //   racecheck to misread when warps of the CTA also used named barriers.
  __device__ bool last_cta_to_finish() const {
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
      fence_sys(::cuda::memory_order_seq_cst);
      const unsigned before = atomicAdd(&op_->done_ctas, 1u);
      last = before == gridDim.x - 1;
      if (last) {
        fence_sys(::cuda::memory_order_seq_cst);
        op_->done_ctas = 0;
      }
    }
    return __syncthreads_or(last) != 0;
  }

  // The last CTA ends the operation: later kernels on this buffer see the new epoch.
  __device__ void finish() const { *static_cast<volatile unsigned*>(&op_->epoch) = epoch_; }

 private:
  __device__ static unsigned read_epoch(const OpControl* op) {
    __shared__ unsigned epoch;
    if (threadIdx.x == 0) epoch = ld_volatile(&op->epoch) + 1;
    __syncthreads();
    return epoch;
  }

  OpControl* op_;
  unsigned epoch_;
};

}  // namespace flexep::hybridep
