// The device stamp of phase_trace.h: one thread per CTA (or per warp role) calls it; two reductions to
// global memory, only when the call is traced (kernel_timing).
#pragma once

#include "dispatch/hybridep/device/timer.cuh"
#include "dispatch/hybridep/kernels/phase_trace.h"

namespace flexep::hybridep {

// Reductions (RED), not atomics with a result (ATOM): atomicMin/Max compile to ATOMG (SASS of
// 7d6a00d), whose round trip the step that follows would pay; a RED is posted and forgotten.
__device__ __forceinline__ void trace_stamp(PhaseTrace* trace, TracePoint point) {
  if (trace == nullptr) return;
  const unsigned long long now = global_timer_ns();
  asm volatile("red.relaxed.gpu.global.min.u64 [%0], %1;" ::"l"(&trace->first[point]), "l"(now) : "memory");
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(&trace->last[point]), "l"(now) : "memory");
}

}  // namespace flexep::hybridep
