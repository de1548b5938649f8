// The status record of a dispatcher's kernels (device_state.h's Status): the first error any thread
// reports, with its phase, peer and values, which the host turns into an exception; and the
// deadline every wait carries.
#pragma once

#include "dispatch/hybridep/device/memory.cuh"
#include "dispatch/hybridep/kernels/device_state.h"

namespace flexep::hybridep {

// First report wins: the code is claimed, the fields are filled in, then the code is published.
__device__ inline void report_status(Status* st, StatusCode code, Phase phase, int peer, long long value,
                                     long long limit) {
  if (atomicCAS(&st->code, 0, -1) == 0) {
    st->phase = static_cast<int>(phase);
    st->peer = peer;
    st->value = value;
    st->limit = limit;
    __threadfence();
    atomicExch(&st->code, static_cast<int>(code));
  }
}

// True once any wait of this dispatcher has timed out: every other wait then gives up at once, so a
// missing peer costs one timeout, not one per wait.
__device__ __forceinline__ bool timed_out(const Status* st) {
  return ld_volatile(&st->code) == static_cast<int>(StatusCode::timeout);
}

// What a wait reports when its deadline passes: where, and after how long.
struct WaitContext {
  Status* status;
  unsigned long long timeout_ns;
  Phase phase;
};

}  // namespace flexep::hybridep
