// Budget mode's count exchange (DeepEP's notify): every rank's words to every rank through the
// windows, then the call's layout derived on the device, so that no host sync sits in a dispatch.
#include <cub/block/block_scan.cuh>

#include "dispatch/deepep/device/chunk_rows.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/status.cuh"
#include "dispatch/hybridep/kernels/layout_math.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;
using hybridep::report_status;
using hybridep::StatusCode;
using hybridep::wait_flag_at_least;
using hybridep::WaitContext;
namespace word = call_signature::word;

namespace {

constexpr int kThreads = 256;

// The configuration words every rank must agree on (call_signature.cpp compares the same ones).
__device__ inline bool same_config(const long long* a, const long long* b) {
  constexpr int fields[] = {word::experts,      word::multihot,    word::hidden,   word::topk,
                            word::mode,         word::pad_multiple, word::budget_rows, word::overflow,
                            exchange_word::fp8, exchange_word::layout};
  for (int f : fields)
    if (a[f] != b[f]) return false;
  return true;
}

__global__ void __launch_bounds__(kThreads) notify_kernel(NotifyCall c) {
  const OpSession session(c.op);
  const int R = c.ranks, P = c.words, E = c.experts;
  // 1. This rank's words into row `rank` of every peer's count area.
  for (int i = static_cast<int>(threadIdx.x); i < R * P; i += blockDim.x) {
    const int d = i / P, w = i - d * P;
    long long v = 0;
    if (w < exchange_word::header) {
      v = c.header[w];
      if (c.errors->arg != 0) {  // a bad id this rank's count kernel found travels as its device_* words
        if (w == word::device_arg) v = c.errors->arg;
        if (w == word::device_row) v = c.errors->row;
        if (w == word::device_column) v = c.errors->column;
        if (w == word::device_value) v = c.errors->value;
        if (w == word::device_limit) v = c.errors->limit;
      }
    } else if (c.counts != nullptr) {
      v = c.counts[w - exchange_word::header];
    }
    reinterpret_cast<long long*>(c.peers.window[d] + c.win.counts)[static_cast<long long>(c.rank) * P + w] = v;
  }
  publish_to_peers(session, c.peers, kCounts, R, c.rank);
  __syncthreads();
  if (c.counts != nullptr)  // every thread has read them: zero for the next call's count kernel
    for (int i = static_cast<int>(threadIdx.x); i < E + R; i += blockDim.x) c.counts[i] = 0;
  // 2. Every source's words.
  const unsigned* flags = reinterpret_cast<const unsigned*>(c.peers.flags[c.rank]);
  const WaitContext wait{c.status, c.timeout_ns, hybridep::Phase::dispatch_counts};
  bool ok = true;
  for (int s = static_cast<int>(threadIdx.x); s < R; s += blockDim.x)
    ok = ok && wait_flag_at_least(flags + kCounts * R + s, session.epoch(), wait, s);
  if (!__syncthreads_and(ok)) {
    if (threadIdx.x == 0) c.layout[layout_word::abort] = 1;
    return;
  }
  const long long* all = reinterpret_cast<const long long*>(c.peers.window[c.rank] + c.win.counts);
  auto rows = [&](int s, int d) { return __ldcg(all + static_cast<long long>(s) * P + exchange_word::header + E + d); };
  // counts(s, e): source s's pairs for global expert e, as hybridep's layout arithmetic reads them.
  auto counts = [&](int s, int e) { return __ldcg(all + static_cast<long long>(s) * P + exchange_word::header + e); };
  auto pairs = [&](int e) { return hybridep::group_pairs(counts, e, R); };
  auto padded = [&](long long n) { return hybridep::round_up(n, c.pad); };
  // 3. Agreement, budget, layout (thread 0 decides; the others derive row_begin). First, spread over
  // the threads, the expert-major entries of every receiver against their budget (drop: a prefix is
  // kept, never an error): the lowest receiver over it.
  __shared__ int bad, over;
  if (threadIdx.x == 0) over = R;
  __syncthreads();
  if (c.expert_major && !c.drop)
    for (int d = static_cast<int>(threadIdx.x); d < R; d += blockDim.x) {
      long long entries = 0;
      for (int e = 0; e < c.local_experts; ++e) entries += padded(pairs(d * c.local_experts + e));
      if (entries > c.entries_budget) atomicMin(&over, d);
    }
  __syncthreads();
  if (threadIdx.x == 0) {
    bad = -1;
    for (int s = 0; s < R && bad < 0; ++s) {
      const long long* h = all + static_cast<long long>(s) * P;
      if (__ldcg(h + word::status) != 0 || __ldcg(h + word::device_arg) != 0 || !same_config(h, all)) bad = s;
    }
    for (int d = 0; d < R && bad < 0; ++d) {
      long long n = 0;
      for (int s = 0; s < R; ++s) n += rows(s, d);
      if (c.expert_major ? n > c.capacity : !c.drop && (n > c.budget || n > c.capacity)) bad = d;
    }
    if (bad < 0 && over < R) bad = over;
    long long at = 0;  // the rows kept here are a prefix of the (source, token) order: at most the budget
    for (int s = 0; s < R; ++s) {
      c.layout[layout_word::source_begin(R) + s] = bad < 0 ? min(at, c.budget) : 0;
      at += rows(s, c.rank);
    }
    c.layout[layout_word::source_begin(R) + R] = bad < 0 ? min(at, c.budget) : 0;
    c.layout[layout_word::received] = bad < 0 ? min(at, c.budget) : 0;
    c.layout[layout_word::abort] = bad < 0 ? 0 : 1;
    *c.dropped = 0;
  }
  __syncthreads();
  for (int d = static_cast<int>(threadIdx.x); d < R; d += blockDim.x) {
    long long at = 0;
    for (int s = 0; s < c.rank; ++s) at += rows(s, d);
    c.layout[layout_word::row_begin + d] = bad < 0 ? at : 0;
  }
  __syncthreads();
  // This rank's rows on every destination, for the sender (device/chunk_rows.cuh); none on an abort.
  if (bad < 0 && c.chunks > 0) {
    __shared__ typename cub::BlockScan<int, kThreads>::TempStorage chunk_scan;
    for (int d = 0; d < R; ++d)
      chunk_bases<kThreads>(c.dest_mask + d * c.chunks, c.chunks, c.layout[layout_word::row_begin + d],
                            c.chunk_base + d * c.chunks, chunk_scan);
  }
  if (c.rank_major_lengths)  // every pair sent here is received: the lists' lengths are the counts'
    for (int e = static_cast<int>(threadIdx.x); e < c.local_experts; e += blockDim.x)
      c.tokens_per_expert[e] = bad < 0 ? padded(pairs(c.rank * c.local_experts + e)) : 0;
  if (c.expert_major) {
    // This rank's lists, as DispatchPlan::build lays them out (hybridep's cut_group, checked against
    // it on the CPU): expert e begins after the padded lists of every pair before it.
    using Scan = cub::BlockScan<long long, kThreads>;
    __shared__ typename Scan::TempStorage scan;
    long long carry = 0, dropped = 0;
    for (int base = 0; base < c.local_experts; base += kThreads) {
      const int e = base + static_cast<int>(threadIdx.x);
      const long long real = e < c.local_experts && bad < 0 ? pairs(c.rank * c.local_experts + e) : 0;
      long long begin = 0, total = 0;
      Scan(scan).ExclusiveSum(padded(real), begin, total);
      begin += carry;
      carry += total;
      const hybridep::GroupCut cut = hybridep::cut_group(begin, real, c.entries_budget, c.pad);
      if (e < c.local_experts) c.tokens_per_expert[e] = cut.len;
      dropped += real - cut.kept;
      __syncthreads();  // the scan storage is reused
    }
    if (dropped != 0) atomicAdd(reinterpret_cast<unsigned long long*>(c.dropped), static_cast<unsigned long long>(dropped));
  }
  if (bad < 0) return;
  // 4. An abort: the words stay for the host, which decodes the error every rank raises alike.
  for (int i = static_cast<int>(threadIdx.x); i < R * P; i += blockDim.x) c.snapshot[i] = __ldcg(all + i);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    report_status(c.status, StatusCode::abort, hybridep::Phase::dispatch_counts, bad, 0, 0);
  }
}

}  // namespace

void launch_notify(const NotifyCall& c, cudaStream_t stream) {
  notify_kernel<<<1, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep notify_kernel");
}

}  // namespace flexep::deepep
