// The v2 hybridep combine kernel (also dispatch_backward; HybridEpOptions::kernels = 2): the
// protocol of combine_kernel.cu (same partial rows, ready and consumed flags, epochs) and bitwise
// the same results, with a whole row in flight per group of 256 threads instead of one warp's
// 32 x 16 bytes (v1), and the rows loaded straight into registers: `flexep bench sm-copy` measured
// 16 warps of 16-byte loads with 4-8 in flight per lane at ~95-105 GB/s per SM against ~51 GB/s for
// one thread's bulk loads into shared memory (the first v2 combine, a ring of bulk-loaded stages).
//
// CTA = kGroups groups of 8 warps (256 threads; thread i owns the 16-byte words i, i + 256, ... of
// a row, up to kWordsPerThread of them, so H <= 8192). A group works on one part at a time
// (work_items.cuh: parts handed out through an atomic counter):
//   first the "consumed" flags of the previous operation on this buffer (deadline: *:buffer-reuse);
//   LEVEL 1 (this rank as owner): parts of the (source, chunk) items. The group's first warp reads
//     the part's records of the handle's dispatch (a lane per token) into shared memory; then for
//     each token with rows here every thread loads its words of the token's rows in record order
//     (= ascending local expert), adds them in fp32 from +0.0f, and writes the partial row (bf16)
//     into this rank's window; dispatch_backward also writes the prob gradients. At the part's end
//     every thread fences at system scope, the group meets at its named barrier, and one thread
//     counts the part; the last part of (source, chunk) releases the ready flag on the source.
//   LEVEL 2 (this rank as source): parts of its own chunks. The first warp acquires the chunk's
//     ready flag of every rank (deadline: *:partials) and notes which ranks each token went to;
//     then per token the owners' partial rows (a peer's window over NVLink, or this rank's) are
//     added in ascending rank order and the output row written (zeros for a token that went
//     nowhere); dispatch_backward gathers the prob gradients per slot.
// The additions are exactly v1's (add_bf16x8 in the same order, to_bf16x8 once), hence exactly the
// host backend's. The last CTA releases "consumed" on every rank and publishes the new epoch.
//
// Ordering: a flag is acquired by one thread and handed to the group by the named barrier, which
// orders the group's later loads after it; partial rows are plain stores, fenced at system scope by
// every thread that wrote them before the barrier that precedes the count and the release.
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

// 16 warps per SM with 4 loads in flight per lane reach ~95 GB/s in the probe; 4 words per thread
// keep the fp32 sums and the loads in registers (8 words with 128 threads spilled).
constexpr int kGroups = 2;
constexpr int kGroupThreads = 256;
constexpr int kThreadsV2 = kGroups * kGroupThreads;
constexpr int kWordsPerThread = 4;  // 16-byte words of a row per thread: H <= 8 * 256 * 4
constexpr long long kMaxHidden = 8LL * kGroupThreads * kWordsPerThread;
constexpr int kPartTokens = kChunkTokens;  // parts.h: a part is at most one chunk

// A group's view of its shared memory: the current part's tokens (rows per token and the rows).
struct GroupSmem {
  int* n;     // [kPartTokens] rows of each token here (level 1) / bit mask of its owners (level 2)
  int* rows;  // [kPartTokens * width] level 1: the token's rows, record order
  long long* item;
  int* ok;

  __device__ static GroupSmem make(unsigned char* smem, int group, int width) {
    const std::size_t per_group = group_bytes(width);
    unsigned char* base = smem + static_cast<std::size_t>(group) * per_group;
    GroupSmem g;
    g.item = reinterpret_cast<long long*>(base);
    g.ok = reinterpret_cast<int*>(base + 8);
    g.n = reinterpret_cast<int*>(base + 16);
    g.rows = g.n + kPartTokens;
    return g;
  }
  __host__ __device__ static std::size_t group_bytes(int width) {
    return (16 + 4 * static_cast<std::size_t>(kPartTokens) * (1 + width) + 15) / 16 * 16;
  }
};

struct Group {
  int id, tid, lane, warp;
  __device__ void sync() const { tma::named_sync(1 + id, kGroupThreads); }
};

// The group's next item: its first thread takes it from the counter, the group gets it.
__device__ long long group_grab(unsigned* counter, const Group& g, const GroupSmem& sm) {
  if (g.tid == 0) *sm.item = atomicAdd(counter, 1u);
  g.sync();
  const long long i = *sm.item;
  g.sync();  // every thread has read it before the next grab overwrites it
  return i;
}

// Sums `count` rows (row_at(q) gives the q-th) into acc, in order, from +0.0f: each thread its words.
template <class RowAt>
__device__ void sum_rows(float (&acc)[kWordsPerThread][8], int count, RowAt row_at, long long words, int tid) {
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[k][e] = 0.0f;
  for (int q = 0; q < count; ++q) {
    const uint4* row = row_at(q);
    uint4 x[kWordsPerThread];
#pragma unroll
    for (int k = 0; k < kWordsPerThread; ++k) {  // all loads first: a row's words in flight at once
      const long long w = tid + static_cast<long long>(k) * kGroupThreads;
      x[k] = w < words ? __ldcg(row + w) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kWordsPerThread; ++k)
      if (tid + static_cast<long long>(k) * kGroupThreads < words) add_bf16x8(acc[k], x[k]);
  }
}

__device__ void store_row(uint4* dst, const float (&acc)[kWordsPerThread][8], long long words, int tid) {
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const long long w = tid + static_cast<long long>(k) * kGroupThreads;
    if (w < words) dst[w] = to_bf16x8(acc[k]);
  }
}

// ---- level 1 ----------------------------------------------------------------------------------------------

// The first warp: the rows of every token of part p that has a record of the handle's dispatch
// here (lane l: token t0 + l), checked, into shared memory; 0 rows for the others.
__device__ void stage_records(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                              unsigned dispatch_epoch, const GroupSmem& sm, int lane) {
  const long long t = p.t0 + lane;
  unsigned n = 0;
  if (t < p.t1) {
    const unsigned char* rec = record_at(h.records, p.source, t, h.max_tokens, h.record_bytes);
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));
    if (head.x == dispatch_epoch) {  // else t has no row here: the source will not read (source, t)
      n = head.y;
      const RecordEntry* e = record_entries(rec);
      bool bad = n == 0 || n > static_cast<unsigned>(v.width);
      long long bad_row = -1;
      for (unsigned q = 0; !bad && q < n; ++q) {
        const int row = __ldcg(&e[q].row);
        if (row < 0 || row >= h.rows) bad = true, bad_row = row;
        sm.rows[lane * v.width + q] = row;
      }
      if (bad) {
        report_status(v.status, StatusCode::corrupt, c.data_phase, p.source, bad_row, h.rows);
        n = 0;
      }
    }
  }
  sm.n[lane] = static_cast<int>(n);
}

__device__ void level1_part(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                            const GroupSmem& sm, const Group& g) {
  const int me = v.rank, s = p.source;
  const long long words = v.hidden / 8;
  const auto* rows = static_cast<const uint4*>(c.rows);
  for (int l = 0; l < static_cast<int>(p.t1 - p.t0); ++l) {
    const int n = sm.n[l];
    if (n == 0) continue;
    const long long t = p.t0 + l;
    const int* token_rows = sm.rows + l * v.width;
    float acc[kWordsPerThread][8];
    sum_rows(acc, n, [&](int q) { return rows + static_cast<long long>(token_rows[q]) * words; }, words, g.tid);
    store_row(partial_row(v, me, s, t), acc, words, g.tid);
    if (c.grad_probs)
      for (int q = g.tid; q < n; q += kGroupThreads) *grad_at(v, me, s, t, q) = c.grad_probs[token_rows[q]];
  }
}

// ---- level 2 ----------------------------------------------------------------------------------------------

// The first warp: waits for the chunk's ready flag of every rank (lane d: rank d), then notes the
// ranks each token of part p went to (its staged records of the dispatch have entries).
__device__ bool stage_owners(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                             unsigned epoch, const GroupSmem& sm, int lane) {
  const WaitContext wait{v.status, v.timeout_ns, c.data_phase};
  const bool ok = warp_wait_ranks(ready_flag(v, v.rank, 0, p.chunk), v.max_chunks, v.ranks, epoch, wait, lane);
  const long long t = p.t0 + lane;
  unsigned owners = 0;
  if (t < p.t1)
    for (int d = 0; d < v.ranks; ++d)
      if (reinterpret_cast<const RecordHeader*>(record_at(h.staging, d, t, h.max_tokens, h.record_bytes))->n > 0)
        owners |= 1u << d;
  sm.n[lane] = static_cast<int>(owners);
  return ok;
}

__device__ void level2_part(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                            const GroupSmem& sm, const Group& g) {
  const int me = v.rank;
  const long long words = v.hidden / 8;
  for (int l = 0; l < static_cast<int>(p.t1 - p.t0); ++l) {
    const unsigned owners = static_cast<unsigned>(sm.n[l]);
    const long long t = p.t0 + l;
    float acc[kWordsPerThread][8];
    // The q-th owner in ascending rank order (a token that went nowhere sums nothing: zeros).
    sum_rows(
        acc, __popc(owners),
        [&](int q) {
          unsigned m = owners;
          for (int i = 0; i < q; ++i) m &= m - 1;
          return static_cast<const uint4*>(partial_row(v, __ffs(m) - 1, me, t));
        },
        words, g.tid);
    store_row(static_cast<uint4*>(c.out) + t * words, acc, words, g.tid);
    if (c.grad_weights) {
      // As v1's consume_chunk: each slot's prob gradient from the owner's window (ready flags
      // acquired above).
      for (int jj = g.tid; jj < h.slots; jj += kGroupThreads) {
        const long long i = t * h.slots + jj;
        const int entry = h.slot_entry[i];
        float grad = 0.0f;
        if (entry >= 0) {
          const int d = entry / v.width, q = entry % v.width;
          if (d < v.ranks) grad = __ldcg(grad_at(v, d, me, t, q));
        }
        if (!h.multihot) {
          c.grad_weights[i] = grad;
        } else {
          const int e = h.slot_expert[i];
          if (e >= 0 && e < h.experts) c.grad_weights[t * h.experts + e] = grad;
        }
      }
    }
  }
}

// ---- the group's work ---------------------------------------------------------------------------------------

__device__ void run_group(const CombineView& v, const HandleView& h, const CombineCall& c, unsigned epoch,
                          unsigned dispatch_epoch, const GroupSmem& sm, const Group& g) {
  const int R = v.ranks, me = v.rank;
  const int groups = static_cast<int>(gridDim.x) * kGroups;
  // Nobody still reads the partials we are about to overwrite (every rank's previous operation on
  // this buffer is done).
  if (g.warp == 0) {
    const WaitContext reuse{v.status, v.timeout_ns, c.reuse_phase};
    const bool ok = warp_wait_ranks(consumed_flag(v, me, 0), 1, R, epoch - 1, reuse, g.lane);
    if (g.lane == 0) *sm.ok = ok;
  }
  g.sync();
  if (!*sm.ok) return;

  // Level 1: every source's tokens that have rows here.
  auto all = [](int) { return false; };
  auto tokens = [&h](int s) { return tokens_of(h.control, s, h.max_tokens); };
  const PartSplit split1 = part_split(chunks_of_ranks(R, tokens, all), groups);
  const long long parts1 = parts_of_ranks(R, split1, tokens, all);
  for (long long i = group_grab(&v.work[kWorkFirst], g, sm); i < parts1; i = group_grab(&v.work[kWorkFirst], g, sm)) {
    Part p;
    parts_of_ranks(R, split1, tokens, all, i, &p);
    if (g.warp == 0) stage_records(v, h, c, p, dispatch_epoch, sm, g.lane);
    g.sync();
    level1_part(v, h, c, p, sm, g);
    // Every thread's partial rows and prob gradients of the part are complete and ordered before
    // the group's one count; the last part of (source, chunk) releases the ready flag there.
    fence_sys();
    g.sync();
    if (g.tid == 0 && count_part(&v.work[kWorkChunks + p.source * v.max_chunks + p.chunk], split1.per_chunk))
      st_release_sys(ready_flag(v, p.source, me, p.chunk), epoch);
  }

  // Level 2: this rank's tokens, once every rank has published the chunk's partials.
  const PartSplit split2 = part_split(num_chunks(h.tokens), groups);
  const long long parts2 = static_cast<long long>(num_chunks(h.tokens)) * split2.per_chunk;
  for (long long i = group_grab(&v.work[kWorkSecond], g, sm); i < parts2; i = group_grab(&v.work[kWorkSecond], g, sm)) {
    const Part p = part_in_rank(i, split2, h.tokens, me);
    if (g.warp == 0) {
      const bool ok = stage_owners(v, h, c, p, epoch, sm, g.lane);
      if (g.lane == 0) *sm.ok = ok;
    }
    g.sync();
    if (!*sm.ok) return;  // timed out (status set); the whole group leaves together
    level2_part(v, h, c, p, sm, g);
    g.sync();  // the part's tokens are done before the first warp stages the next part
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
  const int group = threadIdx.x / kGroupThreads;
  const Group g{group, static_cast<int>(threadIdx.x) % kGroupThreads, static_cast<int>(threadIdx.x) % 32,
                (static_cast<int>(threadIdx.x) % kGroupThreads) / 32};
  if (!s_broken) run_group(v, h, c, epoch, s_dispatch_epoch, GroupSmem::make(smem, group, v.width), g);
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

std::size_t smem_bytes(int width) { return kGroups * GroupSmem::group_bytes(width); }

}  // namespace

bool combine_v2_supported(long long hidden) { return hidden <= kMaxHidden; }

void prepare_combine_v2() { raise_smem_limit(combine_kernel_v2); }

void launch_combine_v2(const CombineView& v, const HandleView& h, const CombineCall& c, int grid, cudaStream_t stream) {
  FLEXEP_CHECK(v.hidden <= kMaxHidden, "hybridep combine v2: H = ", v.hidden,
               " is above its limit (internal error: combine_v2_supported decides)");
  launch_kernel(combine_kernel_v2, grid, kThreadsV2, smem_bytes(v.width), stream, false, v, h, c);
}

}  // namespace flexep::hybridep
