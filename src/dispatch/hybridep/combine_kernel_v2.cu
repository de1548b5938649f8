// The v2 hybridep combine kernel (also dispatch_backward; HybridEpOptions::kernels = 2): the
// protocol of combine_kernel.cu (same partial rows, ready and consumed flags, epochs) and bitwise
// the same results, with the rows streamed straight into registers by the whole CTA, many rows in
// flight: `flexep bench sm-copy` measured 16 warps of 16-byte loads with 4-8 in flight per lane at
// ~95-105 GB/s per SM, against ~51 GB/s for one thread's bulk loads into shared memory (the first
// v2 combine, a ring of bulk-loaded stages: 961 us at 16 SMs on dsv3-ep2) and one row at a time
// per 256 threads (a later try: 1263 us; each row paid a full load latency).
//
// CTA = 512 threads; thread i owns the 16-byte words i and i + 512 of a row (H <= 8192). The CTA
// works on one part at a time (work_items.cuh: parts handed out through an atomic counter):
//   first the "consumed" flags of the previous operation on this buffer (deadline: *:buffer-reuse);
//   LEVEL 1 (this rank as owner): parts of the (source, chunk) items. Warp 0 lists the rows of the
//     part's tokens that have a record of the handle's dispatch here, token by token in record
//     order (= ascending local expert), in shared memory (dispatch_backward: and writes their prob
//     gradients). Every thread then streams the list with kDepth rows in flight (stream_rows),
//     adding each token's rows in fp32 from +0.0f and writing the partial row (bf16) into this
//     rank's window when its last row is added. At the part's end every thread fences at system
//     scope, the CTA synchronises, and thread 0 counts the part; the last part of (source, chunk)
//     releases the ready flag on the source.
//   LEVEL 2 (this rank as source): parts of its own chunks. Warp 0 acquires the chunk's ready flag
//     of every rank (deadline: *:partials) and lists, per token, the owners' partial rows in
//     ascending rank order (a peer's window over NVLink, or this rank's); a token that went
//     nowhere gets one entry without a row (its output is zeros). The stream writes the output
//     rows; dispatch_backward gathers the prob gradients per slot.
// The additions are exactly v1's (add_bf16x8 in the same order, to_bf16x8 once), hence exactly the
// host backend's. The last CTA releases "consumed" on every rank and publishes the new epoch.
//
// Only __syncthreads orders the CTA's threads (one group: no named barriers). A flag is acquired by
// warp 0 and handed to the CTA by the barrier; partial rows are plain stores, ordered by the
// barrier before thread 0's system-scope fence, count and release (cumulativity).
// Progress: level 1 waits for nothing remote after the reuse flags, so every ready flag is
// released; level 2 waits only for ready flags, each with a deadline.
#include <cuda_runtime.h>

#include "dispatch/hybridep/access.cuh"
#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/kernel_launch.h"
#include "dispatch/hybridep/kernels.h"
#include "dispatch/hybridep/tma.cuh"
#include "dispatch/hybridep/work_items.cuh"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kThreadsV2 = 512;
constexpr int kWordsPerThread = 2;  // 16-byte words of a row per thread: H <= 8 * 512 * 2
constexpr long long kMaxHidden = 8LL * kThreadsV2 * kWordsPerThread;
constexpr int kDepth = 8;  // rows in flight per thread (2 words each): 128 KB per SM
constexpr int kPartTokens = kChunkTokens;  // parts.h: a part is at most one chunk

// One entry of the stream: a row to add (or none: -1 with no load) and, on a token's last entry,
// where its sum goes.
struct Entry {
  const uint4* row;  // nullptr: nothing to add (a token that went nowhere)
  int token;         // part-local token index
  int last;          // 1 on the token's last entry: write the sum
};

// The CTA's shared memory: the current part's entries, the next item and a flag.
struct CtaSmem {
  Entry* entries;  // [kPartTokens * max(width, ranks)]
  long long* item;
  int* count;  // entries listed
  int* ok;

  __device__ static CtaSmem make(unsigned char* smem) {
    CtaSmem m;
    m.item = reinterpret_cast<long long*>(smem);
    m.count = reinterpret_cast<int*>(smem + 8);
    m.ok = reinterpret_cast<int*>(smem + 12);
    m.entries = reinterpret_cast<Entry*>(smem + 16);
    return m;
  }
  __host__ __device__ static std::size_t bytes(int width, int ranks) {
    const int per_token = width > ranks ? width : ranks;
    return 16 + sizeof(Entry) * static_cast<std::size_t>(kPartTokens) * per_token;
  }
};

// The CTA's next item: thread 0 takes it from the counter, every thread gets it.
__device__ long long cta_grab(unsigned* counter, const CtaSmem& sm) {
  if (threadIdx.x == 0) *sm.item = atomicAdd(counter, 1u);
  __syncthreads();
  const long long i = *sm.item;
  __syncthreads();  // every thread has read it before the next grab overwrites it
  return i;
}

// kReadOnly: rows this kernel never writes (expert_out) go through the read-only data path
// (ld.global.nc), which keeps many more loads in flight per SM than L2-only loads (ld.global.cg);
// partial rows, written during this kernel by this rank and its peers, must not (non-coherent).
template <bool kReadOnly>
__device__ __forceinline__ void load_words(uint4 (&x)[kWordsPerThread], const uint4* row, long long words) {
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const long long w = threadIdx.x + static_cast<long long>(k) * kThreadsV2;
    if (row == nullptr || w >= words)
      x[k] = make_uint4(0, 0, 0, 0);
    else
      x[k] = kReadOnly ? __ldg(row + w) : __ldcg(row + w);
  }
}

// Streams `count` entries with kDepth rows in flight per thread: each token's rows are added in
// entry order from +0.0f, and at its last entry dst(token) receives the bf16 sum.
template <bool kReadOnly, class Dst>
__device__ void stream_rows(const Entry* entries, int count, long long words, Dst dst) {
  float acc[kWordsPerThread][8];
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[k][e] = 0.0f;
  uint4 x[kDepth][kWordsPerThread];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) load_words<kReadOnly>(x[d], d < count ? entries[d].row : nullptr, words);
  for (int base = 0; base < count; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {  // unrolled: x[d] stays in registers
      const int i = base + d;
      if (i < count) {
        const Entry e = entries[i];
#pragma unroll
        for (int k = 0; k < kWordsPerThread; ++k)
          if (threadIdx.x + static_cast<long long>(k) * kThreadsV2 < words) add_bf16x8(acc[k], x[d][k]);
        if (e.last) {
          uint4* out = dst(e.token);
#pragma unroll
          for (int k = 0; k < kWordsPerThread; ++k) {
            const long long w = threadIdx.x + static_cast<long long>(k) * kThreadsV2;
            if (w < words) out[w] = to_bf16x8(acc[k]);
#pragma unroll
            for (int el = 0; el < 8; ++el) acc[k][el] = 0.0f;
          }
        }
        load_words<kReadOnly>(x[d], i + kDepth < count ? entries[i + kDepth].row : nullptr, words);
      }
    }
  }
}

// Warp 0: where lane l's `n` entries start when every lane's entries are listed in lane order
// (first), and how many there are in all (second, the same in every lane).
__device__ int2 list_offsets(int n, int lane) {
  int end = n;
  for (int o = 1; o < 32; o *= 2) {  // inclusive scan of n over the lanes
    const int y = __shfl_up_sync(kFullMask, end, o);
    if (lane >= o) end += y;
  }
  return make_int2(end - n, __shfl_sync(kFullMask, end, 31));
}

// ---- level 1 ----------------------------------------------------------------------------------------------

// Warp 0 (lane l: token t0 + l): the rows of the part's tokens that have a record of the handle's
// dispatch here; dispatch_backward: their prob gradients. The loads of a token's rows are
// independent (no early exit), so a lane has them all in flight at once: the CTA waits for this.
__device__ void list_partial_rows(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                                  unsigned dispatch_epoch, const CtaSmem& sm, int lane) {
  const long long t = p.t0 + lane;
  const RecordEntry* e = nullptr;
  int n = 0;
  if (t < p.t1) {
    const unsigned char* rec = record_at(h.records, p.source, t, h.max_tokens, h.record_bytes);
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));
    if (head.x == dispatch_epoch) {  // else t has no row here: the source will not read (source, t)
      e = record_entries(rec);
      if (head.y == 0 || head.y > static_cast<unsigned>(v.width))
        report_status(v.status, StatusCode::corrupt, c.data_phase, p.source, -1, h.rows);
      else
        n = static_cast<int>(head.y);
    }
  }
  const auto* rows = static_cast<const uint4*>(c.rows);
  const long long words = v.hidden / 8;
  const int2 at = list_offsets(n, lane);
  constexpr int kBatch = 8;  // a token's row indices (and prob gradients) loaded together
  for (int q0 = 0; q0 < n; q0 += kBatch) {
    int row[kBatch];
    float grad[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) row[u] = q0 + u < n ? __ldcg(&e[q0 + u].row) : 0;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool ok = row[u] >= 0 && row[u] < h.rows;
      grad[u] = c.grad_probs != nullptr && q0 + u < n && ok ? c.grad_probs[row[u]] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int q = q0 + u;
      if (q >= n) break;
      const bool ok = row[u] >= 0 && row[u] < h.rows;
      // Never read outside expert_out: the call fails as corrupt, the token sums nothing.
      if (!ok) report_status(v.status, StatusCode::corrupt, c.data_phase, p.source, row[u], h.rows);
      if (c.grad_probs) *grad_at(v, v.rank, p.source, t, q) = grad[u];
      sm.entries[at.x + q] = Entry{ok ? rows + static_cast<long long>(row[u]) * words : nullptr, lane, q == n - 1};
    }
  }
  const int total = at.y;
  if (lane == 0) *sm.count = total;
}

// ---- level 2 ----------------------------------------------------------------------------------------------

// Warp 0: waits for the chunk's ready flag of every rank (lane d: rank d), then lists per token of
// the part (lane l: token t0 + l) the owners' partial rows in ascending rank order, or one empty
// entry for a token that went nowhere. Returns whether every flag arrived.
__device__ bool list_owner_rows(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                                unsigned epoch, const CtaSmem& sm, int lane) {
  const WaitContext wait{v.status, v.timeout_ns, c.data_phase};
  const bool ok = warp_wait_ranks(ready_flag(v, v.rank, 0, p.chunk), v.max_chunks, v.ranks, epoch, wait, lane);
  const long long t = p.t0 + lane;
  unsigned owners = 0;
  int n = 0;
  if (t < p.t1) {
    for (int d = 0; d < v.ranks; ++d)
      if (reinterpret_cast<const RecordHeader*>(record_at(h.staging, d, t, h.max_tokens, h.record_bytes))->n > 0)
        owners |= 1u << d;
    n = owners == 0 ? 1 : __popc(owners);
  }
  const int2 at = list_offsets(n, lane);
  unsigned m = owners;
  for (int q = 0; q < n; ++q) {  // owners in ascending rank order
    const int d = __ffs(m) - 1;
    m &= m - 1;
    sm.entries[at.x + q] = Entry{owners == 0 ? nullptr : partial_row(v, d, v.rank, t), lane, q == n - 1};
  }
  const int total = at.y;
  if (lane == 0) *sm.count = total;
  return ok;
}

// dispatch_backward: each slot's prob gradient of the part's tokens from the owner's window (as
// v1's consume_chunk; the ready flags were acquired before).
__device__ void gather_slot_grads(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p) {
  const long long slots = h.slots, n = (p.t1 - p.t0) * slots;
  for (long long idx = threadIdx.x; idx < n; idx += kThreadsV2) {
    const long long t = p.t0 + idx / slots;
    const long long i = t * slots + idx % slots;
    const int entry = h.slot_entry[i];
    float grad = 0.0f;
    if (entry >= 0) {
      const int d = entry / v.width, q = entry % v.width;
      if (d < v.ranks) grad = __ldcg(grad_at(v, d, v.rank, t, q));
    }
    if (!h.multihot) {
      c.grad_weights[i] = grad;
    } else {
      const int e = h.slot_expert[i];
      if (e >= 0 && e < h.experts) c.grad_weights[t * h.experts + e] = grad;
    }
  }
}

// ---- the CTA's work ---------------------------------------------------------------------------------------

__device__ void run(const CombineView& v, const HandleView& h, const CombineCall& c, unsigned epoch,
                    unsigned dispatch_epoch, const CtaSmem& sm) {
  const int R = v.ranks, me = v.rank, lane = threadIdx.x % 32;
  const bool warp0 = threadIdx.x < 32;
  const long long words = v.hidden / 8;
  // Nobody still reads the partials we are about to overwrite (every rank's previous operation on
  // this buffer is done).
  if (warp0) {
    const WaitContext reuse{v.status, v.timeout_ns, c.reuse_phase};
    const bool ok = warp_wait_ranks(consumed_flag(v, me, 0), 1, R, epoch - 1, reuse, lane);
    if (lane == 0) *sm.ok = ok;
  }
  __syncthreads();
  if (!*sm.ok) return;

  // Level 1: every source's tokens that have rows here.
  auto all = [](int) { return false; };
  auto tokens = [&h](int s) { return tokens_of(h.control, s, h.max_tokens); };
  const PartSplit split1 = part_split(chunks_of_ranks(R, tokens, all), static_cast<int>(gridDim.x));
  const long long parts1 = parts_of_ranks(R, split1, tokens, all);
  for (long long i = cta_grab(&v.work[kWorkFirst], sm); i < parts1; i = cta_grab(&v.work[kWorkFirst], sm)) {
    Part p;
    parts_of_ranks(R, split1, tokens, all, i, &p);
    if (warp0) list_partial_rows(v, h, c, p, dispatch_epoch, sm, lane);
    __syncthreads();
    stream_rows<true>(sm.entries, *sm.count, words, [&](int l) { return partial_row(v, me, p.source, p.t0 + l); });
    // Every thread's partial rows (and warp 0's prob gradients) of the part are ordered by the
    // barrier before thread 0's system-scope fence in count_part (cumulative: one fence for the
    // CTA; 512 fence.sc.sys per part, one per thread, would serialise) and its release of the
    // chunk's ready flag on the source.
    __syncthreads();
    if (threadIdx.x == 0 &&
        count_part(&v.work[kWorkChunks + p.source * v.max_chunks + p.chunk], split1.per_chunk))
      st_release_sys(ready_flag(v, p.source, me, p.chunk), epoch);
  }

  // Level 2: this rank's tokens, once every rank has published the chunk's partials.
  const PartSplit split2 = part_split(num_chunks(h.tokens), static_cast<int>(gridDim.x));
  const long long parts2 = static_cast<long long>(num_chunks(h.tokens)) * split2.per_chunk;
  for (long long i = cta_grab(&v.work[kWorkSecond], sm); i < parts2; i = cta_grab(&v.work[kWorkSecond], sm)) {
    const Part p = part_in_rank(i, split2, h.tokens, me);
    if (warp0) {
      const bool ok = list_owner_rows(v, h, c, p, epoch, sm, lane);
      if (lane == 0) *sm.ok = ok;
    }
    __syncthreads();
    if (!*sm.ok) return;  // timed out (status set): the whole CTA leaves together
    stream_rows<false>(sm.entries, *sm.count, words,
                [&](int l) { return static_cast<uint4*>(c.out) + (p.t0 + l) * words; });
    if (c.grad_weights) gather_slot_grads(v, h, c, p);
    __syncthreads();  // the part's entries are consumed before warp 0 lists the next part's
  }
}

__global__ void __launch_bounds__(kThreadsV2, 1)
    combine_kernel_v2(const __grid_constant__ CombineView v, const __grid_constant__ HandleView h,
                      const __grid_constant__ CombineCall c) {
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned epoch = op_epoch(v.control);
  __shared__ int s_broken;
  __shared__ unsigned s_dispatch_epoch;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);
    s_dispatch_epoch = ld_volatile(&h.control->op.epoch);  // the handle's dispatch was the last one
  }
  __syncthreads();
  if (!s_broken) run(v, h, c, epoch, s_dispatch_epoch, CtaSmem::make(smem));
  if (last_cta_to_finish(v.control)) {
    // Every read of a peer's window by this grid is done: each rank may overwrite its partials.
    if (threadIdx.x < v.ranks) st_release_sys(consumed_flag(v, threadIdx.x, v.rank), epoch);
    if (threadIdx.x == 0) {
      v.work[kWorkFirst] = 0;
      v.work[kWorkSecond] = 0;
      finish_op(v.control, epoch);
    }
  }
}

}  // namespace

bool combine_v2_supported(long long hidden) { return hidden <= kMaxHidden; }

void prepare_combine_v2() { raise_smem_limit(combine_kernel_v2); }

void launch_combine_v2(const CombineView& v, const HandleView& h, const CombineCall& c, int grid, cudaStream_t stream) {
  FLEXEP_CHECK(v.hidden <= kMaxHidden, "hybridep combine v2: H = ", v.hidden,
               " is above its limit (internal error: combine_v2_supported decides)");
  launch_kernel(combine_kernel_v2, grid, kThreadsV2, CtaSmem::bytes(v.width, v.ranks), stream, false, v, h, c);
}

}  // namespace flexep::hybridep
