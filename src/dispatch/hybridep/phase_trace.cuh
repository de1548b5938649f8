// The device stamp of phase_trace.h: one thread per CTA (or per warp role) calls it; two atomics to
// global memory, only when the call is traced (kernel_timing).
#pragma once

#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/phase_trace.h"

namespace flexep::hybridep {

__device__ __forceinline__ void trace_stamp(PhaseTrace* trace, TracePoint point) {
  if (trace == nullptr) return;
  const unsigned long long now = global_timer_ns();
  atomicMin(&trace->first[point], now);
  atomicMax(&trace->last[point], now);
}

}  // namespace flexep::hybridep
