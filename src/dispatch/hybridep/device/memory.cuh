// Loads, stores and fences at system scope (any GPU of the NVLink domain, and the host), with the
// memory order an explicit argument, as in NCCL's device API (::cuda::memory_order). Each is one PTX
// instruction; the order is a constant at every call, so the branch folds away.
//
// Only the orders the protocol uses are accepted, and a wrong one does not compile into something
// weaker: a load takes relaxed or acquire, a store relaxed or release, a fence acq_rel or seq_cst.
#pragma once

#include <cuda/atomic>

namespace flexep::hybridep {

// A 32-bit word another GPU may write (a flag). acquire: this thread's later reads see what the
// writer stored before its release of this word.
__device__ __forceinline__ unsigned ld_sys(const unsigned* p, ::cuda::memory_order order) {
  unsigned v;
  if (order == ::cuda::memory_order_relaxed)
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A 32-bit word another GPU reads (a flag). release: everything this thread stored (or observed
// through an acquire or a fence) before is visible to a reader that acquires the value.
__device__ __forceinline__ void st_sys(unsigned* p, unsigned v, ::cuda::memory_order order) {
  if (order == ::cuda::memory_order_relaxed)
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// seq_cst (fence.sc): orders this thread's earlier stores, local or remote, before its later memory
// operations for observers on any GPU - what a producer does before a barrier and one thread's
// release. acq_rel (fence.acq_rel): after relaxed reads that observed a peer's writes (the count
// exchange's words), orders them before this thread's later memory operations - an acquire made of
// a fence.
__device__ __forceinline__ void fence_sys(::cuda::memory_order order) {
  if (order == ::cuda::memory_order_seq_cst)
    asm volatile("fence.sc.sys;" ::: "memory");
  else
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// A word of this GPU's memory that other threads of the grid, or the host, change while we poll it
// (the status code, the operation epoch): a volatile load, never a stale register or L1 copy.
__device__ __forceinline__ int ld_volatile(const int* p) { return *static_cast<const volatile int*>(p); }
__device__ __forceinline__ unsigned ld_volatile(const unsigned* p) { return *static_cast<const volatile unsigned*>(p); }

}  // namespace flexep::hybridep
