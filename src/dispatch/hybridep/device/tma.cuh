// Hopper (sm_90) bulk-copy and mbarrier primitives of the hybridep kernels, as thin PTX wrappers.
//
//   load_async   cp.async.bulk global -> shared, completion counted in bytes on an mbarrier
//                (the TMA engine moves a whole row; one thread issues it);
//   store_async  cp.async.bulk shared -> global, completion tracked by this thread's bulk groups
//                (commit_group / wait_group); the global address may be a peer GPU's window
//                (ncclGetLsaPointer gives an ordinary virtual address mapped over NVLink; Hybrid-EP's
//                S2G warps store to cudaIpc-mapped peer buffers the same way, and its combine G2S warp
//                loads from them);
//   mbarriers    init / arrive / arrive.expect_tx / try_wait.parity, the stage handshake of a ring;
//   proxy fences bulk copies run in the ASYNC proxy, ordinary loads and stores (flags, records,
//                descriptors) in the GENERIC proxy. Where data crosses from one to the other through
//                memory, a proxy fence orders them (see "Memory ordering across proxies" in docs/hybridep.md):
//                  writer: bulk stores -> wait_group 0 (writes complete) -> fence.proxy.async.global
//                          -> fence.sc.sys -> st.release.sys flag
//                  reader: ld.acquire.sys flag -> fence.proxy.async.global -> bulk loads
//                and shared memory written by ordinary stores that a bulk store reads next needs
//                fence.proxy.async.shared::cta before the barrier that hands it over.
//
// Sizes and addresses of bulk copies must be multiples of 16 bytes (rows are 2H or H + H/32 bytes
// with H % 8 == 0 / H % 512 == 0, window regions 256-aligned, inputs checked 16-byte aligned).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flexep::hybridep::tma {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ unsigned long long gmem_addr(const void* p) {
  return static_cast<unsigned long long>(__cvta_generic_to_global(p));
}

// ---- mbarriers ------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the bulk copies complete on them);
// follow it with a CTA barrier before any thread uses them.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival (release at CTA scope: this thread's earlier writes, e.g. a job descriptor, are visible
// to whoever waits for the phase).
// (Each barrier operation also takes the barrier's 32-bit shared address, for hot loops that carry
// it rather than convert a generic pointer per call.)
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) { mbar_arrive(smem_addr(bar)); }

// One arrival that also expects `bytes` more to land through bulk loads before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// True once the phase with parity `parity` has completed (acquire at CTA scope). A fresh barrier is
// in phase 0, so parity 1 counts as completed: the "stage is free" convention of the producers.
__device__ __forceinline__ bool mbar_try_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ bool mbar_try_wait(std::uint64_t* bar, std::uint32_t parity) {
  return mbar_try_wait(smem_addr(bar), parity);
}

// Waits without a deadline. Used only where the protocol guarantees progress (a local stage
// handshake between two warps of one CTA, each of which only waits on the other or on a remote flag
// that has its own deadline): see docs/hybridep.md, "Progress".
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t parity) {
  mbar_wait(smem_addr(bar), parity);
}

// ---- bulk copies --------------------------------------------------------------------------------------

// global -> shared; `bytes` are counted on `bar` (which the caller armed with arrive.expect_tx).
__device__ __forceinline__ void load_async(void* smem_dst, const void* gmem_src, std::uint32_t bytes,
                                           std::uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_addr(gmem_src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// shared -> global (any GPU's window); part of this thread's next bulk group.
__device__ __forceinline__ void store_async(void* gmem_dst, const void* smem_src, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_addr(gmem_dst)),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

// Closes this thread's bulk group (an empty group is legal: every job commits exactly one).
__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// All but the newest N groups of this thread are complete: their writes are done and visible to
// this thread (what a later release publishes).
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// All but the newest N groups have finished READING their shared memory source (the stage may be
// refilled); their writes may still be in flight.
template <int N>
__device__ __forceinline__ void wait_groups_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// wait_groups<n> for a run-time n; n above 7 waits for more than asked (all but the newest 7),
// which is always correct, only earlier.
__device__ __forceinline__ void wait_groups_dyn(int n) {
  switch (n < 0 ? 0 : (n > 7 ? 7 : n)) {
    case 0: wait_groups<0>(); break;
    case 1: wait_groups<1>(); break;
    case 2: wait_groups<2>(); break;
    case 3: wait_groups<3>(); break;
    case 4: wait_groups<4>(); break;
    case 5: wait_groups<5>(); break;
    case 6: wait_groups<6>(); break;
    default: wait_groups<7>(); break;
  }
}

// ---- proxy fences and barriers ---------------------------------------------------------------------------

// Orders this thread's async-proxy and generic-proxy accesses of global memory (both directions).
__device__ __forceinline__ void fence_proxy_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Ordinary shared-memory stores before this fence are visible to bulk copies issued after the next
// barrier.
__device__ __forceinline__ void fence_proxy_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- programmatic dependent launch -----------------------------------------------------------------------

// Waits until the grid this one depends on (launched before it with programmatic stream
// serialisation) has completed and its memory is visible; a no-op for a normal launch.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next grid (if launched with programmatic serialisation) be scheduled now; it still
// waits in grid_dependency_wait() for this grid's completion. A no-op without a dependent.
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace flexep::hybridep::tma
