// The GPU's global nanosecond timer: the clock of every deadline and of the phase trace.
#pragma once

namespace flexep::hybridep {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace flexep::hybridep
