// Device primitives of the hybridep protocol: flags with epochs, deadline waits, the status record
// and the per-kernel completion count. Every cross-GPU handshake in the backend is built from
// these, following the recipe of the NCCL device-API notes (section 3.6):
//
//   producer: plain stores of the payload (rows, records) into the peer's window
//             -> fence_sys() in every storing thread, then a CTA/warp barrier
//             -> ONE thread: st.release.sys of the epoch into the consumer's flag (publish_flag)
//   consumer: ld.acquire.sys of its own flag until it reaches the epoch (wait_flag_at_least)
//             -> a barrier, then the payload is read (with ld.global.cg: L2, never a stale L1)
//
// Flags only grow: operation n of a buffer writes n, and waiting means "flag - n >= 0" in 32-bit
// modular arithmetic, so nothing is ever reset and replays of a captured graph keep working.
// (The count exchange carries the epoch in every word instead of a flag: count_words.cuh.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch/hybridep/device_state.h"

namespace flexep::hybridep {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's earlier stores (local or remote) before its later memory operations, for
// observers on any GPU.
__device__ __forceinline__ void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

// After relaxed reads that observed a peer's writes (the count exchange's words): orders them
// before this thread's later memory operations (an acquire made of a fence).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ int ld_volatile(const int* p) { return *static_cast<const volatile int*>(p); }
__device__ __forceinline__ unsigned ld_volatile(const unsigned* p) { return *static_cast<const volatile unsigned*>(p); }

__device__ __forceinline__ bool epoch_reached(unsigned value, unsigned epoch) {
  return static_cast<int>(value - epoch) >= 0;
}

// ---- status -------------------------------------------------------------------------------------------

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

struct WaitContext {
  Status* status;
  unsigned long long timeout_ns;
  Phase phase;
};

// Spins (acquire, system scope) until *flag has reached `epoch`. False when the deadline passed
// (the status then names `phase` and `peer`) or another wait already timed out. One thread calls
// it; the caller then synchronises its warp/CTA before anyone reads the payload.
__device__ inline bool wait_flag_at_least(const unsigned* flag, unsigned epoch, const WaitContext& w, int peer) {
  if (epoch_reached(ld_acquire_sys(flag), epoch)) return true;
  const unsigned long long start = global_timer_ns();
  while (true) {
    __nanosleep(64);
    if (epoch_reached(ld_acquire_sys(flag), epoch)) return true;
    if (timed_out(w.status)) return false;
    if (global_timer_ns() - start > w.timeout_ns) {
      report_status(w.status, StatusCode::timeout, w.phase, peer, epoch, 0);
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
  fence_sys();
  __syncwarp();
  if (lane == publisher) st_release_sys(flag, epoch);
}

// ---- operation bookkeeping ---------------------------------------------------------------------------

// The epoch of the operation this kernel belongs to (completed operations + 1). Call from every
// thread; costs one __syncthreads.
__device__ inline unsigned op_epoch(const OpControl* op) {
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) epoch = ld_volatile(&op->epoch) + 1;
  __syncthreads();
  return epoch;
}

// Called by every thread of every CTA at the end of the kernel. Returns true in all threads of the
// CTA that finished last; that CTA resets the count and is the one to publish anything that needs
// the whole grid's work to be done (the new epoch, "consumed" flags).
//   Every CTA fences its work at system scope before counting itself (its reads of peer memory
//   must be complete before a peer may overwrite that memory), and the last CTA fences after
//   seeing the full count, so everything the grid did happens-before what it publishes.
//   The answer reaches the CTA through __syncthreads_or, not a shared variable: nothing for
//   racecheck to misread when warps of the CTA also used named barriers.
__device__ inline bool last_cta_to_finish(OpControl* op) {
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    fence_sys();
    const unsigned before = atomicAdd(&op->done_ctas, 1u);
    last = before == gridDim.x - 1;
    if (last) {
      fence_sys();
      op->done_ctas = 0;  // the next kernel on this buffer starts counting from 0 (stream order)
    }
  }
  return __syncthreads_or(last) != 0;
}

// The last CTA ends the operation: later kernels on this buffer see the new epoch.
__device__ __forceinline__ void finish_op(OpControl* op, unsigned epoch) {
  *static_cast<volatile unsigned*>(&op->epoch) = epoch;
}

// ---- 16-byte rows of bf16 ------------------------------------------------------------------------------

__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }

// Adds the 8 bf16 values of `v` to acc[0..8) in fp32.
__device__ __forceinline__ void add_bf16x8(float* acc, uint4 v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

// acc[0..8) = +0.0f + the 8 bf16 values of `v`: the first add_bf16x8 of a sum from +0.0f, without
// zeroing the sums first. Bitwise the same (+0.0f + -0.0f is +0.0f, so it is an addition, not a copy).
__device__ __forceinline__ void first_bf16x8(float* acc, uint4 v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = 0.0f + __uint_as_float(w[i] << 16);
    acc[2 * i + 1] = 0.0f + __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Rounds acc[0..8) to bf16 (round to nearest even, as flexep::bf16::from_float for every non-NaN).
__device__ __forceinline__ uint4 to_bf16x8(const float* acc) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i]));
    const unsigned hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i + 1]));
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// acc[0..8) = +0.0f + bf16(acc[0..8)): a sum rounded as to_bf16x8 stores it, then added to +0.0f
// as first_bf16x8 would add it back after loading it (-0.0f becomes +0.0f). Bitwise the same as
// storing the row and starting a sum from it.
__device__ __forceinline__ void round_bf16x8(float* acc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f + __bfloat162float(__float2bfloat16_rn(acc[i]));
}

}  // namespace flexep::hybridep
