// The receiver side of the deepep dispatch and combine_backward: every source's flag acquired (with
// a deadline), then each local expert's rows listed in ascending order (expert_rows), and for the
// expert-major layout each entry's prob and its place among its row's entries.
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::ld_volatile;
using hybridep::wait_flag_at_least;
using hybridep::WaitContext;

namespace {

constexpr int kThreads = 256;

// Thread s < ranks of the CTA acquires source s's flag of `kind` at `op`'s current epoch (the one
// the sender kernel of this call closed: it ran before on the same stream). False in every thread
// when one wait timed out (the status then names the phase and the rank).
__device__ inline bool wait_sources(const unsigned* flags, int ranks, int kind, const OpControl* op, Status* status,
                                    unsigned long long timeout_ns, Phase phase) {
  const unsigned epoch = ld_volatile(&op->epoch);
  const WaitContext w{status, timeout_ns, phase};
  bool ok = true;
  for (int s = static_cast<int>(threadIdx.x); s < ranks; s += blockDim.x)
    ok = ok && wait_flag_at_least(flags + kind * ranks + s, epoch, w, s);
  return __syncthreads_and(ok) != 0;
}

// One CTA: it spins until the sources arrive (simulated ranks share one GPU).
__global__ void __launch_bounds__(kThreads) receive_kernel(ReceiveCall c) {
  wait_sources(c.flags, c.ranks, c.kind, c.op, c.status, c.timeout_ns, c.phase);
}

// After receive_kernel on the same stream, so the rows are here; one CTA per local expert. A timed
// out wait lists nothing (the call raises).
__global__ void __launch_bounds__(kThreads) list_kernel(ReceiveCall c) {
  if (hybridep::ld_volatile(&c.status->code) != 0) return;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  for (int e = static_cast<int>(blockIdx.x); e < c.local_experts; e += gridDim.x) {
    int* out = c.expert_rows + c.list_begin[e];
    long long n = 0;
    for (std::int64_t base = 0; base < c.rows; base += kThreads) {
      const std::int64_t row = base + threadIdx.x;
      int f = 0, slot = 0, order = 0;  // order: the row's experts below e
      if (row < c.rows)
        for (int j = 0; j < c.k; ++j) {
          const int id = __ldcg(c.idx + row * c.k + j);  // L2: the peers wrote them
          if (id == e) f = 1, slot = j;
          order += id >= 0 && id < e;
        }
      int before = 0, total = 0;
      Scan(scan).ExclusiveSum(f, before, total);
      if (f) {
        const long long p = c.list_begin[e] + n + before;
        out[n + before] = static_cast<int>(row);
        if (c.probs != nullptr) {
          c.probs[p] = __ldcg(c.weights + row * c.k + slot);
          c.slot_pos[row * c.k + slot] = static_cast<int>(p);
          c.row_order[row * c.k + order] = static_cast<int>(p);
        }
      }
      n += total;
      __syncthreads();
    }
    for (long long i = n + threadIdx.x; i < c.list_len[e]; i += blockDim.x) {
      out[i] = -1;
      if (c.probs != nullptr) c.probs[c.list_begin[e] + i] = 0.0f;
    }
  }
}

}  // namespace

void launch_receive(const ReceiveCall& c, cudaStream_t stream) {
  receive_kernel<<<1, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep receive_kernel");
  if (c.expert_rows == nullptr || c.local_experts == 0) return;
  list_kernel<<<c.local_experts < 65535 ? c.local_experts : 65535, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep list_kernel");
}

}  // namespace flexep::deepep
