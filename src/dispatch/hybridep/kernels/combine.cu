// The hybridep combine kernel (also dispatch_backward): the two-level sum of docs/semantics.md with
// the rows brought into shared memory by bulk loads. The owner PUSHES each partial row into the
// source's window as it computes it, so the NVLink traffic overlaps level 1 (a source pulling the
// partials at level 2 measured ~150 us of NVLink-bound time for dsv3-ep2 whatever the SM count;
// docs/hybridep-history.md).
//
// CTA = P pipelines x 5 warps; each pipeline owns one ring of stages of W words per compute thread.
// The shape depends on H (Shape below): 4 pipelines of 7 words (H <= 7168; 89 registers, 4 x 4
// stages of 14 KB), else 3 pipelines of 8 words (H <= 8192; 106 registers, 3 x 4 of 16 KB). More
// pipelines pay (2 -> 3: 766 -> 628 us, 3 -> 4: 628 -> 562 us for dsv3-ep2 at 16 SMs) because the
// rows of a ring are added one after the other by its 4 compute warps: more rings, more rows at once.
//   loader warp (lane 0 issues): first the "consumed" flags of the previous operation on this buffer
//     (deadline: *:buffer-reuse); then LEVEL 1 (this rank as owner): grabs parts of the (source,
//     chunk) items (work_items.cuh); for every token with a record of the handle's dispatch it posts
//     one job per row of the token here, in record order (= ascending local expert), each a bulk
//     load of expert_out's row into the next stage; then "part end". It reads a part's records
//     before the previous part's last token is posted (read_part), so that the ring never drains.
//     Then LEVEL 2 (this rank as source): grabs parts of its own chunks (read ahead the same way),
//     acquires the chunk's ready flag of every rank (lane d rank d's; deadline: *:partials), and
//     for every token posts one job per owner rank in ascending order, a bulk load of the partial
//     row that owner pushed into this rank's window; a token that went nowhere gets one job
//     without data (its output is zero). Finally "exit".
//   OWN PARTIALS IN REGISTERS (ranks 0 and 1, combine; not dispatch_backward, whose prob gradients
//     go through the window): a token of this rank with rows here is summed at level 2, not level
//     1: its rows here come first, their sum is rounded to bf16 in the registers (partial (me, t) as
//     level 2 would have loaded it), then the other owners' partials in ascending order. At most
//     one owner is below rank 0 or 1, and the host's sum ((0 + P_a) + P_me) + P_b ... is the same
//     bits as ((0 + P_me) + P_a) + P_b ...: fp32 addition is commutative, signed zeros included.
//     This saves storing and reloading the rank's own partials (dsv3-ep2: 58.6 MB each way per
//     rank). Higher ranks keep level 1 for their own tokens: the owners below them could be more
//     than one (deciding it per token costs level 1's loader registers it does not have).
//   compute warps (4 = 128 threads, each owning 16-byte words tid, tid + 128, ... of a row):
//     accumulate a token's stages in fp32 registers from +0.0f in job order, free each stage, and
//     write bf16 once: the partial into the source's window (level 1: over NVLink for a peer) or the
//     output row (level 2);
//     dispatch_backward also writes the prob gradients (level 1) and gathers them per slot
//     (level 2). At a part end the group synchronises (named barrier) and one thread counts
//     the part behind a system fence; the last part of (source, chunk) releases the ready flag on
//     the source.
// The additions are fp32 in the host backend's order (add_bf16x8 per row, to_bf16x8 once), hence
// exactly the host backend's bits. The last CTA releases "consumed" on every rank and publishes the new epoch.
//
// Progress: the loader waits for free stages (the compute warps free every stage they are given)
// and for remote flags (deadlines); the compute warps wait only for their loader, which always ends
// with an exit job. Level 1 never waits for level 2 anywhere, so every ready flag is released.
#include <cuda_runtime.h>

#include "dispatch/hybridep/kernels/access.cuh"
#include "dispatch/hybridep/device/bf16x8.cuh"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/kernels/launch.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "dispatch/hybridep/kernels/work_items.cuh"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kComputeWarps = 4;
constexpr int kComputeThreads = 32 * kComputeWarps;
constexpr int kWarpsPerPipe = 1 + kComputeWarps;
constexpr int kMinStages = 2, kMaxStages = 8;

// Pipelines per CTA and 16-byte words of a row per compute thread (H <= 8 * 128 * words). The
// registers bound the pipelines: a compute thread's fp32 sums are 8 x words registers, and one CTA of
// 5 x 32 x pipes threads shares the SM's 65536 (4 pipelines: <= 96 each, which 7 words fit).
template <int Pipes, int Words>
struct Shape {
  static constexpr int pipes = Pipes;
  static constexpr int words = Words;
  static constexpr int threads = 32 * kWarpsPerPipe * Pipes;
  static constexpr long long max_hidden = 8LL * kComputeThreads * Words;
};
using Wide = Shape<4, 7>;    // H <= 7168 (dsv3: 7168)
using Narrow = Shape<3, 8>;  // H <= 8192

enum Kind : int { kPartialRow = 0, kOutRow = 1, kPartEnd = 2, kExit = 3 };
// kPartialRow: a = source, b = token, c = rows in the sum.   kOutRow: b = token, c = rows (0: zeros).
// kPartEnd: a = source, b = chunk, c = parts per chunk.       kExit: none.

// ---- loader -----------------------------------------------------------------------------------------------

// Lane 0: a job whose data is one row (2H bytes) loaded from `src` into the job's stage.
__device__ void post_row(const Ring& ring, const Ring::Slot& j, const Job& job, const void* src,
                         std::uint32_t row_bytes) {
  ring.post_expecting(j, job, row_bytes);
  tma::load_async(ring.stage(j), src, row_bytes, ring.full_bar(j));
}

// Level 1 reads a part's records (lane l: token t0 + l's header and first rows) in one round trip,
// and reads the next part's while the current part's last token is still being posted: reading each
// token's rows at its turn put a dependent global load (~1 us) before every token's first job, and
// a part's records after the previous part's last job left the ring to drain for ~3 us (the item's
// atomic, the header, then the rows) of every part.
constexpr int kHeldRows = 8;

struct PartRecords {
  int source = 0, chunk = 0, t0 = 0;  // the part's (32-bit: the loader's registers are its bound)
  uint2 head = {};           // the lane's token's record header (epoch, n)
  int held[kHeldRows] = {};  // its first rows, valid below min(n, kHeldRows)
  bool token = false;        // the lane has a token in the part
};

// The ranks that token t of this rank went to (its staged records of the dispatch have entries).
__device__ unsigned owners_of(const CombineView& v, const HandleView& h, long long t) {
  unsigned owners = 0;
  for (int d = 0; d < v.ranks; ++d)
    if (reinterpret_cast<const RecordHeader*>(record_at(h.staging, d, t, h.max_tokens, h.record_bytes))->n > 0)
      owners |= 1u << d;
  return owners;
}

// Whether level 2 sums this rank's own rows (file comment: own partials in registers).
__device__ __forceinline__ bool own_sums_at_level2(const CombineView& v, const CombineCall& c) {
  return v.rank <= 1 && c.grad_probs == nullptr && c.grad_weights == nullptr;
}

// Issues the loads of the lane's first rows of r's records; nothing waits for them until posted.
__device__ void read_held(const HandleView& h, const CombineView& v, PartRecords& r, int lane) {
  if (!r.token) return;
  const RecordEntry* e = record_entries(record_at(h.records, r.source, r.t0 + lane, h.max_tokens, h.record_bytes));
#pragma unroll
  for (int q = 0; q < kHeldRows; ++q)  // inside the record: its width has room for them
    if (q < v.width) r.held[q] = __ldcg(&e[q].row);
}

// Issues the loads of the records of part p's tokens for which `wanted` holds (lane l: token t0 +
// l); nothing waits for them until they are posted.
__device__ PartRecords read_part(const HandleView& h, const CombineView& v, const Part& p, bool wanted, int lane) {
  PartRecords r;
  r.source = p.source;
  r.chunk = p.chunk;
  r.t0 = static_cast<int>(p.t0);
  const long long t = p.t0 + lane;
  r.token = wanted && t < p.t1;
  if (r.token) r.head = __ldcg(reinterpret_cast<const uint2*>(record_at(h.records, p.source, t, h.max_tokens, h.record_bytes)));
  read_held(h, v, r, lane);
  return r;
}

// The lane's token's rows here: n of them when `valid` (the record is of the handle's dispatch and
// every row is inside expert_out; a row outside is reported as corrupt).
struct TokenRows {
  unsigned n = 0;
  bool valid = false;
};

__device__ TokenRows token_rows(const CombineView& v, const HandleView& h, const CombineCall& c, const PartRecords& r,
                                unsigned dispatch_epoch, int lane) {
  TokenRows tr;
  if (!r.token || r.head.x != dispatch_epoch) return tr;  // no row here: rank s will not read it
  const unsigned n = r.head.y;
  bool bad = n == 0 || n > static_cast<unsigned>(v.width);
  long long bad_row = -1;
#pragma unroll
  for (int q = 0; q < kHeldRows; ++q)
    if (!bad && static_cast<unsigned>(q) < n && (r.held[q] < 0 || r.held[q] >= h.rows)) bad = true, bad_row = r.held[q];
  const RecordEntry* e = record_entries(record_at(h.records, r.source, r.t0 + lane, h.max_tokens, h.record_bytes));
  for (unsigned q = kHeldRows; !bad && q < n; ++q) {
    const int row = __ldcg(&e[q].row);
    if (row < 0 || row >= h.rows) bad = true, bad_row = row;
  }
  if (bad) report_status(v.status, StatusCode::corrupt, c.data_phase, r.source, bad_row, h.rows);
  tr.n = n;
  tr.valid = !bad;
  return tr;
}

// Calls post(row) for the first nn rows of lane l's token in r, in record order (warp-collective):
// the held ones from registers, the rest of a wider record (multihot with many experts per token)
// from memory.
template <class Post>
__device__ void for_each_row(const HandleView& h, const PartRecords& r, int l, unsigned nn, int lane, Post&& post) {
#pragma unroll
  for (int i = 0; i < kHeldRows; ++i)
    if (static_cast<unsigned>(i) < nn) post(__shfl_sync(kFullMask, r.held[i], l));
  if (nn <= kHeldRows) return;
  const RecordEntry* e = record_entries(record_at(h.records, r.source, r.t0 + l, h.max_tokens, h.record_bytes));
  for (unsigned base = kHeldRows; base < nn; base += 32) {
    const int row = base + lane < nn ? __ldcg(&e[base + lane].row) : 0;
    const unsigned batch = nn - base < 32 ? nn - base : 32;
    for (unsigned i = 0; i < batch; ++i) post(__shfl_sync(kFullMask, row, static_cast<int>(i)));
  }
}

// Level 1 for the tokens of a part (source p.source): one job per row of each token here.
// `before_last()` runs once: before the part's last token is posted, or at the end.
template <class BeforeLast>
__device__ Ring::Slot post_part(const CombineView& v, const HandleView& h, const CombineCall& c, const Ring& ring,
                                Ring::Slot j, const PartRecords& r, unsigned dispatch_epoch, int lane,
                                BeforeLast&& before_last) {
  const long long words = v.hidden / 8;
  const std::uint32_t row_bytes = static_cast<std::uint32_t>(v.hidden * 2);
  const auto* rows = static_cast<const uint4*>(c.rows);
  const TokenRows tr = token_rows(v, h, c, r, dispatch_epoch, lane);
  unsigned m = __ballot_sync(kFullMask, tr.valid);
  if (m == 0) before_last();
  for (; m != 0; m &= m - 1) {
    if ((m & (m - 1)) == 0) before_last();
    const int l = __ffs(m) - 1;
    const unsigned nn = __shfl_sync(kFullMask, tr.n, l);
    const Job job{kPartialRow, r.source, static_cast<int>(r.t0 + l), static_cast<int>(nn), 0, 0, 0, 0};
    for_each_row(h, r, l, nn, lane, [&](int row) {
      ring.acquire(j, lane);
      if (lane == 0) post_row(ring, j, job, rows + static_cast<long long>(row) * words, row_bytes);
      ring.advance(j);
    });
  }
  return j;
}

// Level 2's view of one part of this rank's tokens: lane l, the ranks token t0 + l went to, and
// the header of its record here when level 2 sums its rows here. Read ahead like level 1's records,
// but without the rows: two parts' rows at once do not fit the loader's registers. They are read at
// the part's start (one round trip, while the ring still holds the previous part's last stages).
struct OutPart {
  int chunk = 0, t0 = 0, count = 0;  // count: tokens in the part
  unsigned owners = 0;
  uint2 head = {};
  bool own = false;  // the lane's token's rows here are summed at level 2
};

__device__ OutPart read_out_part(const CombineView& v, const HandleView& h, const CombineCall& c, const Part& p,
                                 int lane) {
  OutPart r;
  const long long t = p.t0 + lane;
  if (t < p.t1) r.owners = owners_of(v, h, t);
  r.chunk = p.chunk;
  r.t0 = static_cast<int>(p.t0);
  r.count = p.t1 > p.t0 ? static_cast<int>(p.t1 - p.t0) : 0;
  r.own = t < p.t1 && own_sums_at_level2(v, c) && (r.owners >> v.rank & 1u);
  if (r.own) r.head = __ldcg(reinterpret_cast<const uint2*>(record_at(h.records, v.rank, t, h.max_tokens, h.record_bytes)));
  return r;
}

// The records of the part's tokens whose rows here level 2 sums, rows included (issued, not waited for).
__device__ PartRecords own_records(const HandleView& h, const CombineView& v, const OutPart& o, int lane) {
  PartRecords r;
  r.source = v.rank;
  r.chunk = o.chunk;
  r.t0 = o.t0;
  r.head = o.head;
  r.token = o.own;
  read_held(h, v, r, lane);
  return r;
}

// Level 2 for the tokens of a part: one job per owner rank of each token (ascending), a zero row's
// job for a token that went nowhere. A token whose rows here level 2 sums gets their jobs first,
// then those of the other owners' partials: job.a is the number of own rows (the compute warps
// round the sum after them), job.c the number of stages in all. `before_last()` runs once, before
// the part's last token.
template <class BeforeLast>
__device__ Ring::Slot post_out_part(const CombineView& v, const HandleView& h, const CombineCall& c, const Ring& ring,
                                    Ring::Slot j, const OutPart& r, const PartRecords& records, unsigned dispatch_epoch,
                                    int lane, BeforeLast&& before_last) {
  const int me = v.rank;
  const std::uint32_t row_bytes = static_cast<std::uint32_t>(v.hidden * 2);
  const auto* rows_here = static_cast<const uint4*>(c.rows);
  const long long words = v.hidden / 8;
  const TokenRows own = token_rows(v, h, c, records, dispatch_epoch, lane);  // records.token false: none
  const int count = r.count;
  if (count <= 0) before_last();
  for (int l = 0; l < count; ++l) {  // every token gets an output row, zeros if it went nowhere
    if (l == count - 1) before_last();
    const int tt = r.t0 + l;
    // Rows here summed at this level (n_own of them), and the owners whose partials are loaded.
    const bool own_here = __shfl_sync(kFullMask, static_cast<int>(r.own), l) != 0;
    const int n_own = own_here ? __shfl_sync(kFullMask, own.valid ? static_cast<int>(own.n) : 0, l) : 0;
    unsigned m = __shfl_sync(kFullMask, r.owners, l);
    if (own_here) m &= ~(1u << me);
    const int stages = n_own + __popc(m);
    if (stages == 0) {
      ring.acquire(j, lane);
      if (lane == 0) ring.post(j, Job{kOutRow, 0, tt, 0, 0, 0, 0, 0});
      ring.advance(j);
      continue;
    }
    const Job job{kOutRow, n_own, tt, stages, 0, 0, 0, 0};
    for_each_row(h, records, l, static_cast<unsigned>(n_own), lane, [&](int row) {
      ring.acquire(j, lane);
      if (lane == 0) post_row(ring, j, job, rows_here + static_cast<long long>(row) * words, row_bytes);
      ring.advance(j);
    });
    for (; m != 0; m &= m - 1) {
      const int d = __ffs(m) - 1;
      ring.acquire(j, lane);
      if (lane == 0) post_row(ring, j, job, partial_row(v, me, d, tt), row_bytes);
      ring.advance(j);
    }
  }
  return j;
}

template <class S>
__device__ void load(const CombineView& v, const HandleView& h, const CombineCall& c, const Ring& ring, unsigned epoch,
                     unsigned dispatch_epoch, int pipe, int lane) {
  const int R = v.ranks, me = v.rank;
  const int pipelines = static_cast<int>(gridDim.x) * S::pipes;
  const bool failed = c.failed_arg != 0;
  Ring::Slot j;  // the next job's stage
  const WaitContext reuse{v.status, v.timeout_ns, c.reuse_phase};
  // Nobody still reads the partials we are about to overwrite (every rank's previous operation on
  // this buffer is done).
  if (warp_wait_ranks(consumed_flag(v, me, 0), 1, R, epoch - 1, reuse, lane)) {
    // Level 1: every source's tokens that have rows here.
    auto all = [](int) { return false; };
    auto tokens = [&h](int s) { return tokens_of(h.control, s, h.max_tokens); };
    const PartSplit split1 = part_split(chunks_of_ranks(R, tokens, all), pipelines, v.part_tokens);
    const long long parts1 = parts_of_ranks(R, split1, tokens, all);
    ItemQueue items1{&v.work[kWorkFirst], parts1, pipe, pipelines};
    const auto read_item = [&](long long i) {
      Part p;
      parts_of_ranks(R, split1, tokens, all, i, &p);
      // This rank's own tokens have no jobs here when level 2 sums them. A rank whose checks failed
      // posts no rows at all, only the part ends: its flags still tell every source the chunk is done.
      return read_part(h, v, p, !failed && (p.source != me || !own_sums_at_level2(v, c)), lane);
    };
    long long i = items1.next(lane);
    PartRecords cur;
    if (i < parts1) cur = read_item(i);
    while (i < parts1) {
      long long next = parts1;
      PartRecords ahead;
      j = post_part(v, h, c, ring, j, cur, dispatch_epoch, lane, [&] {
        next = items1.next(lane);
        if (next < parts1) ahead = read_item(next);
      });
      ring.acquire(j, lane);
      if (lane == 0) ring.post(j, Job{kPartEnd, cur.source, cur.chunk, split1.per_chunk, 0, 0, 0, 0});
      ring.advance(j);
      i = next;
      cur = ahead;
    }
    // Level 2: this rank's tokens, once every rank has published the chunk's partials. A rank whose
    // checks failed has no output to write (its handle may be the bad argument).
    const WaitContext wait{v.status, v.timeout_ns, c.data_phase};
    const PartSplit split2 = part_split(num_chunks(h.tokens), pipelines, v.part_tokens);
    const long long parts2 = failed ? 0 : static_cast<long long>(num_chunks(h.tokens)) * split2.per_chunk;
    ItemQueue items2{&v.work[kWorkSecond], parts2, pipe, pipelines};
    const auto read_item2 = [&](long long i) {
      return read_out_part(v, h, c, part_in_rank(i, split2, h.tokens, me), lane);
    };
    long long i2 = items2.next(lane);
    OutPart out;
    if (i2 < parts2) out = read_item2(i2);
    while (i2 < parts2) {
      const PartRecords records = own_records(h, v, out, lane);
      // Every rank publishes every chunk of ours (also with no token of ours): lane d waits for
      // rank d's flag, all at once.
      if (!warp_wait_ranks(ready_flag(v, me, 0, out.chunk), v.max_chunks, R, epoch, wait, lane)) break;
      // A rank that failed its checks in this call released its flags without partials, its abort
      // word (this epoch) written before them: the call fails on this rank as an argument error of
      // that rank (lane d acquired rank d's flag above). The sums still run, on rows of no meaning.
      if (lane < R && ld_sys(abort_flag(v, me, lane), ::cuda::memory_order_relaxed) == epoch)
        report_status(v.status, StatusCode::abort, c.data_phase, lane,
                      ld_sys(abort_arg_flag(v, me, lane), ::cuda::memory_order_relaxed), 0);
      if (lane == 0) tma::fence_proxy_global();  // the bulk loads below read what the flags published
      long long next = parts2;
      OutPart ahead;
      j = post_out_part(v, h, c, ring, j, out, records, dispatch_epoch, lane, [&] {
        next = items2.next(lane);
        if (next < parts2) ahead = read_item2(next);
      });
      i2 = next;
      out = ahead;
    }
  }
  ring.acquire(j, lane);
  if (lane == 0) ring.post(j, Job{kExit, 0, 0, 0, 0, 0, 0, 0});
}

// ---- compute ----------------------------------------------------------------------------------------------

// acc = (First: +0.0f; else acc) + the stage's row, in fp32: all of the thread's W words loaded
// first, then the additions (add_bf16x8, in row order). Thread tid owns 16-byte words tid,
// tid + kComputeThreads, ...; stages span all W * kComputeThreads words (layout_for), so a word past
// the row's end is still inside the stage: it is loaded without a branch or a clamp (ncu: a branch
// per word kept the loads from being issued together; clamped indices were recomputed per row) and
// its sum is never stored. The offsets are constants: one shared load with an immediate each.
template <bool First, int W>
__device__ __forceinline__ void add_stage(float (&acc)[W][8], const Ring::Pos& pos) {
  uint4 x[W];
#pragma unroll
  for (int k = 0; k < W; ++k) x[k] = ld_shared_16(pos.data + static_cast<std::uint32_t>(k * kComputeThreads * 16));
#pragma unroll
  for (int k = 0; k < W; ++k) {
    if constexpr (First)
      first_bf16x8(acc[k], x[k]);
    else
      add_bf16x8(acc[k], x[k]);
  }
}

template <class S>
__device__ void compute(const CombineView& v, const HandleView& h, const CombineCall& c, const Ring& ring,
                        unsigned epoch, int tid, int pipe) {
  const int me = v.rank;
  constexpr int W = S::words;
  const int words = static_cast<int>(v.hidden / 8);  // 16-byte words in a row
  Ring::Pos pos = ring.first_pos(static_cast<std::uint32_t>(tid) * 16);
  while (true) {
    const Job job = ring.wait(pos);
    if (job.kind == kExit) break;
    if (job.kind == kPartEnd) {
      // Every thread's partial rows and prob gradients of the part are ordered before the group's
      // one count: the named barrier orders them before thread 0, whose system fence in count_part
      // is cumulative (one fence per part, not one per thread: ncu put 4% of the stall samples on
      // 128 threads' fences). The last part of (source, chunk) releases the ready flag there. The
      // source reads the rows with bulk loads (async proxy) after its acquire and its own proxy
      // fence; the writer-side proxy fence here is the conservative other half.
      tma::fence_proxy_global();
      tma::named_sync(1 + pipe, kComputeThreads);
      if (tid == 0 && count_part(&v.work[kWorkChunks + job.a * v.max_chunks + job.b], job.c)) {
        if (c.failed_arg != 0) {  // before the flag's release: the source reads them after its acquire
          st_sys(abort_arg_flag(v, job.a, me), static_cast<unsigned>(c.failed_arg), ::cuda::memory_order_relaxed);
          st_sys(abort_flag(v, job.a, me), epoch, ::cuda::memory_order_relaxed);
        }
        st_sys(ready_flag(v, job.a, me, job.b), epoch, ::cuda::memory_order_release);
      }
      ring.release(pos);  // this thread is done with the stage (one arrival per thread: ring.cuh)
      ring.advance(pos);
      continue;
    }
    // A sum over job.c stages (level 1: rows of one token here; level 2: partials of the owners,
    // after the job.a rows here whose sum stands for this rank's partial), from +0.0f in job order:
    // the first stage is added to +0.0f, the later ones (same descriptor) to the sums.
    float acc[W][8];
    const int rows = job.c;
    const int own_rows = job.kind == kOutRow ? job.a : 0;
    if (rows == 0) {  // a token that went nowhere: a descriptor-only job, a zero row
#pragma unroll
      for (int k = 0; k < W; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[k][e] = 0.0f;
    } else {
      add_stage<true>(acc, pos);
    }
    ring.release(pos);
    ring.advance(pos);
    for (int i = 1; i < rows; ++i) {
      if (i == own_rows) {  // this rank's partial, as level 2 would have loaded it: +0.0f + bf16(sum)
#pragma unroll
        for (int k = 0; k < W; ++k) round_bf16x8(acc[k]);
      }
      ring.wait_data(pos);
      add_stage<false>(acc, pos);
      ring.release(pos);
      ring.advance(pos);
    }
    if (own_rows == rows && rows > 0) {  // only this rank's partial: the output is bf16(+0.0f + it)
#pragma unroll
      for (int k = 0; k < W; ++k) round_bf16x8(acc[k]);
    }
    const long long t = job.b;
    uint4* dst = job.kind == kPartialRow ? partial_row(v, job.a, me, t) : static_cast<uint4*>(c.out) + t * words;
#pragma unroll
    for (int k = 0; k < W; ++k)
      if (tid + k * kComputeThreads < words) dst[tid + k * kComputeThreads] = to_bf16x8(acc[k]);
    if (job.kind == kPartialRow && c.grad_probs) {
      const RecordEntry* e = record_entries(record_at(h.records, job.a, t, h.max_tokens, h.record_bytes));
      for (int q = tid; q < rows; q += kComputeThreads) *grad_at(v, job.a, me, t, q) = c.grad_probs[__ldcg(&e[q].row)];
    }
    if (job.kind == kOutRow && c.grad_weights) {
      // Each slot's prob gradient, which owner d pushed into this rank's
      // window (the loader acquired the chunk's ready flags before posting this job).
      for (int jj = tid; jj < h.slots; jj += kComputeThreads) {
        const long long i = t * h.slots + jj;
        const int entry = h.slot_entry[i];
        float g = 0.0f;
        if (entry >= 0) {
          const int d = entry / v.width, q = entry % v.width;
          if (d < v.ranks) g = __ldcg(grad_at(v, me, d, t, q));
        }
        if (!h.multihot) {
          c.grad_weights[i] = g;
        } else {
          const int e = h.slot_expert[i];
          if (e >= 0 && e < h.experts) c.grad_weights[t * h.experts + e] = g;
        }
      }
    }
  }
}

template <class S>
__global__ void __launch_bounds__(S::threads, 1)
    combine_kernel(const __grid_constant__ CombineView v, const __grid_constant__ HandleView h,
                      const __grid_constant__ CombineCall c, const RingLayout layout) {
  extern __shared__ __align__(128) unsigned char smem[];
  const OpSession op(v.control);
  const unsigned epoch = op.epoch();
  __shared__ int s_broken;
  __shared__ unsigned s_dispatch_epoch;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);
    s_dispatch_epoch = ld_volatile(&h.control->op.epoch);  // the handle's dispatch was the last one
    for (int p = 0; p < S::pipes; ++p) Ring::make(smem, layout, p).init(kComputeThreads);
    tma::fence_mbar_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, pipe = warp / kWarpsPerPipe, role = warp % kWarpsPerPipe;
  if (!s_broken) {
    const Ring ring = Ring::make(smem, layout, pipe);
    if (role == 0)
      load<S>(v, h, c, ring, epoch, s_dispatch_epoch, static_cast<int>(blockIdx.x) * S::pipes + pipe, threadIdx.x % 32);
    else
      compute<S>(v, h, c, ring, epoch, threadIdx.x - (pipe * kWarpsPerPipe + 1) * 32, pipe);
  }
  finish_combine_side(v, op);
}

// Each shape's shared-memory budget on each device.
template <class S>
SmemBudget smem_budget;

// Stages span the W words of every compute thread (add_stage reads them all), which is the row
// itself for H = 128 * 8 * W (dsv3: 7168 = 7 words) and more for smaller rows.
template <class S>
RingLayout layout_for(long long hidden) {
  if (hidden > S::max_hidden) return RingLayout{1, 0, 128, 0};
  return fit_rings(S::pipes, static_cast<std::size_t>(S::max_hidden * 2), 0, kMinStages, kMaxStages,
                   smem_budget<S>.get(combine_kernel<S>));
}

template <class S>
void launch_shape(const CombineView& v, const HandleView& h, const CombineCall& c, const RingLayout& layout, int grid,
                  cudaStream_t stream) {
  launch_kernel(combine_kernel<S>, grid, S::threads, layout.total_bytes(), stream, false, v, h, c, layout);
}

}  // namespace

bool combine_supported(long long hidden) {
  return layout_for<Narrow>(hidden).stages >= kMinStages;
}

void prepare_combine() {
  raise_smem_limit(combine_kernel<Wide>);
  raise_smem_limit(combine_kernel<Narrow>);
}

void launch_combine(const CombineView& v, const HandleView& h, const CombineCall& c, int grid, cudaStream_t stream) {
  // The wide shape when H fits its rings, else the narrow one (combine_supported checked that).
  if (const RingLayout wide = layout_for<Wide>(v.hidden); wide.stages >= kMinStages) {
    launch_shape<Wide>(v, h, c, wide, grid, stream);
    return;
  }
  const RingLayout narrow = layout_for<Narrow>(v.hidden);
  FLEXEP_CHECK(narrow.stages >= kMinStages, "hybridep combine: H = ", v.hidden,
               " does not fit its rings (internal error: combine_supported decides)");
  launch_shape<Narrow>(v, h, c, narrow, grid, stream);
}

}  // namespace flexep::hybridep
