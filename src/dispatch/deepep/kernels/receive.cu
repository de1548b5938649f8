// The receiver side of the deepep dispatch and combine_backward: every source's flag acquired (with
// a deadline), then each local expert's rows listed in ascending order (expert_rows), and for the
// expert-major layout each entry's prob and its place among its row's entries.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/publish.cuh"
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

// Every source arrived (false after a timeout, now or in an earlier kernel of this call: then no
// second deadline is waited out). CTA 0 also reports a source that stopped the call (abort words).
__device__ inline bool sources_arrived(const ReceiveCall& c) {
  if (ld_volatile(&c.status->code) == static_cast<int>(hybridep::StatusCode::timeout)) return false;
  if (!wait_sources(c.flags, c.ranks, c.kind, c.op, c.status, c.timeout_ns, c.phase)) return false;
  if (blockIdx.x == 0) stopped_by_peer(c.flags, c.kind, c.rank, c.ranks, ld_volatile(&c.op->epoch), c.status, c.phase);
  return true;
}

// Only the wait, for a call with no lists (combine_backward); one CTA (simulated ranks share one GPU).
__global__ void __launch_bounds__(kThreads) receive_kernel(ReceiveCall c) { sources_arrived(c); }

// Entries first, first + step, ... below the capacity: no row (-1), prob 0.
__device__ inline void clear_entries(const ReceiveCall& c, long long first, long long step) {
  for (long long i = first; i < c.capacity; i += step) {
    c.expert_rows[i] = -1;
    if (c.probs != nullptr) c.probs[i] = 0.0f;
  }
}

// One CTA per local expert, each first waiting for the sources itself. After a timed out wait every
// entry up to `capacity` is -1 (the call raises; the gather behind it then writes zero rows instead
// of following stale or uninitialised indices). The grid also copies the rows' source tokens out.
__global__ void __launch_bounds__(kThreads) list_kernel(ReceiveCall c) {
  if (!sources_arrived(c)) {
    clear_entries(c, static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<long long>(gridDim.x) * blockDim.x);
    return;
  }
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.src_rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    c.src_out[i] = __ldcg(c.src + i);
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const bool budget = c.tokens_per_expert != nullptr;
  const std::int64_t rows = budget ? received_rows(c.layout) : c.rows;
  for (int e = static_cast<int>(blockIdx.x); e < c.local_experts; e += gridDim.x) {
    long long begin = 0, len = 0;
    if (budget) {  // the lists end to end: expert e starts after the padded lists before it
      for (int q = 0; q < e; ++q) begin += __ldcg(c.tokens_per_expert + q);
      len = __ldcg(c.tokens_per_expert + e);
    } else {
      begin = c.list_begin[e];
      len = c.list_len[e];
    }
    int* out = c.expert_rows + begin;
    long long n = 0;
    for (std::int64_t base = 0; base < rows; base += kThreads) {
      const std::int64_t row = base + threadIdx.x;
      int f = 0, slot = 0, order = 0;  // order: the row's experts below e
      if (row < rows)
        for (int j = 0; j < c.k; ++j) {
          const int id = __ldcg(c.idx + row * c.k + j);  // L2: the peers wrote them
          if (id == e) f = 1, slot = j;
          order += id >= 0 && id < e;
        }
      int before = 0, total = 0;
      Scan(scan).ExclusiveSum(f, before, total);
      if (f && n + before < len) {  // past len: a pair the drop policy dropped
        const long long p = begin + n + before;
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
    for (long long i = (n < len ? n : len) + threadIdx.x; i < len; i += blockDim.x) {
      out[i] = -1;
      if (c.probs != nullptr) c.probs[begin + i] = 0.0f;
    }
  }
  if (!budget || blockIdx.x != 0) return;
  long long total = 0;  // every list is written above; the tail up to the capacity is padding
  for (int q = 0; q < c.local_experts; ++q) total += __ldcg(c.tokens_per_expert + q);
  clear_entries(c, total + threadIdx.x, blockDim.x);
}

// Budget mode with the drop policy, before list_kernel: each local expert's padded list length (the
// rows kept decide it). One CTA per expert, each first waiting for the sources itself.
__global__ void __launch_bounds__(kThreads) count_lists_kernel(ReceiveCall c) {
  using Reduce = cub::BlockReduce<int, kThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  const bool ok = sources_arrived(c) && c.layout[layout_word::abort] == 0;
  const std::int64_t rows = ok ? c.layout[layout_word::received] : 0;
  for (int e = static_cast<int>(blockIdx.x); e < c.local_experts; e += gridDim.x) {
    int mine = 0;
    for (std::int64_t row = threadIdx.x; row < rows; row += kThreads)
      for (int j = 0; j < c.k; ++j) mine += __ldcg(c.idx + row * c.k + j) == e;
    const int n = Reduce(reduce).Sum(mine);
    if (threadIdx.x == 0) {
      c.tokens_per_expert[e] = (n + c.pad - 1) / c.pad * c.pad;
      if (c.dropped != nullptr && ok) {
        long long sent = 0;  // every source's pairs for this expert
        for (int s = 0; s < c.ranks; ++s)
          sent += __ldcg(c.exchanged + static_cast<long long>(s) * c.words + exchange_word::header +
                         c.rank * c.local_experts + e);
        atomicAdd(c.dropped, static_cast<unsigned long long>(sent - n));
      }
    }
    __syncthreads();
  }
}

}  // namespace

void launch_receive(const ReceiveCall& c, cudaStream_t stream) {
  if (c.expert_rows == nullptr || c.local_experts == 0) {
    receive_kernel<<<1, kThreads, 0, stream>>>(c);
    FLEXEP_CUDA_CHECK_LAUNCH("deepep receive_kernel");
    return;
  }
  const int ctas = c.local_experts < 65535 ? c.local_experts : 65535;
  if (c.tokens_per_expert != nullptr && !c.lengths_known) {
    count_lists_kernel<<<ctas, kThreads, 0, stream>>>(c);
    FLEXEP_CUDA_CHECK_LAUNCH("deepep count_lists_kernel");
  }
  list_kernel<<<ctas, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep list_kernel");
}

}  // namespace flexep::deepep
