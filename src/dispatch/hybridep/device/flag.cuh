// Flags: the one cross-GPU handshake of the backend, following the recipe of NCCL's device API:
//
//   producer: plain stores of the payload (rows, records) into the peer's window
//             -> fence_sys(seq_cst) in every storing thread, then a CTA/warp barrier
//             -> ONE thread: st_sys(release) of the epoch into the consumer's flag (warp_publish)
//   consumer: ld_sys(acquire) of its own flag until it reaches the epoch (wait_flag_at_least)
//             -> a barrier, then the payload is read (with ld.global.cg: L2, never a stale L1)
//
// (The count exchange carries the epoch in every word instead of a flag: count_words.cuh.)
#pragma once

#include "dispatch/hybridep/device/epoch.cuh"
#include "dispatch/hybridep/device/memory.cuh"
#include "dispatch/hybridep/device/status.cuh"
#include "dispatch/hybridep/device/timer.cuh"

namespace flexep::hybridep {

// Spins (acquire, system scope) until *flag has reached `epoch`. False when the deadline passed
// (the status then names `phase` and `peer`, the epoch waited for as its value and the flag's value
// at the deadline as its limit: a flag that holds the epoch later was published late, not lost) or
// another wait already timed out. One thread calls it; the caller then synchronises its warp/CTA
// before anyone reads the payload.
__device__ inline bool wait_flag_at_least(const unsigned* flag, unsigned epoch, const WaitContext& w, int peer) {
  unsigned seen = ld_sys(flag, ::cuda::memory_order_acquire);
  if (epoch_reached(seen, epoch)) return true;
  const unsigned long long start = global_timer_ns();
  while (true) {
    __nanosleep(64);
    seen = ld_sys(flag, ::cuda::memory_order_acquire);
    if (epoch_reached(seen, epoch)) return true;
    if (timed_out(w.status)) return false;
    if (global_timer_ns() - start > w.timeout_ns) {
      report_status(w.status, StatusCode::timeout, w.phase, peer, epoch, seen);
      return false;
    }
  }
}

// The whole warp waits for the flags of ranks 0..ranks-1 (lane d waits for flags[d * stride]).
// Returns, in every lane, whether all of them arrived.
__device__ inline bool warp_wait_ranks(const unsigned* flags, int stride, int ranks, unsigned epoch,
                                       const WaitContext& w, int lane) {
  bool ok = true;
  if (lane < ranks) ok = wait_flag_at_least(flags + static_cast<long long>(lane) * stride, epoch, w, lane);
  __syncwarp();  // the acquiring lanes' loads are ordered before the other lanes' reads
  return __all_sync(kFullMask, ok);
}

// Publishes what the warp stored so far to the flag `flag` (any GPU): every lane fences its own
// stores, the warp synchronises, and `lane == publisher` releases the epoch.
__device__ __forceinline__ void warp_publish(unsigned* flag, unsigned epoch, int lane, int publisher) {
  fence_sys(::cuda::memory_order_seq_cst);
  __syncwarp();
  if (lane == publisher) st_sys(flag, epoch, ::cuda::memory_order_release);
}

}  // namespace flexep::hybridep
