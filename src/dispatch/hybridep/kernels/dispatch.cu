// The hybridep dispatch kernel: the token rows move by the copy engine of each SM (bulk copies,
// tma.cuh) through shared-memory rings, along the records, chunk flags and epochs of the protocol
// (docs/hybridep.md, "Data flow of a dispatch").
//
// Why rings of bulk copies: a warp copying 16-byte words keeps ~2 KB in flight, so a register-copy
// kernel's time is latency x rows / warps (9.3 ms at 8 SMs for dsv3-ep2; docs/hybridep-history.md).
// Here each SM keeps up to 2 rings x `stages` rows (~200 KB) in flight, one thread per ring issues
// whole-row copies, and the work is handed out in parts of chunks so that every ring is busy even
// with 128 tokens per rank. docs/hybridep.md ("Where the time goes") has the timing model.
//
// CTA = 5 warps:
//   per pipeline p (2 per CTA), one ring of `stages` stages of one row (+ FP8 scales) each:
//     producer warp  sends first: grabs parts of this rank's chunks (work_items.cuh); per part it
//                    writes the probs of the token's LOCAL rows, posts one job per token with a
//                    destination (a bulk load of the row into the next free stage), then copies the
//                    part's records to every destination (epoch stamped; records with no entries
//                    tell the receiver "not for you" like a stale epoch does) and posts "part end";
//                    after its last part, "flush" (publish now: a peer may wait for that part).
//                    Then the fan-out: grabs parts of every OTHER rank's chunks; per part it acquires
//                    the chunk flag (deadline: dispatch:tokens), writes the probs of each received
//                    token and posts one job per token with more than one row here (a bulk load of
//                    the row that arrived into its first row). Finally "exit".
//     consumer warp  lane 0 issues the bulk stores of each job: a sent row once to each remote
//                    destination's first row and to EVERY row it has on this rank (so own tokens
//                    need no fan-out and no flag); a received row to its other rows. One bulk group
//                    per job; a stage is freed once its stores have read it (wait_group.read). A part
//                    is published once its stores are complete (wait_group, a few jobs later so that
//                    the ring never drains): async-proxy fence, system fence, count the part in the
//                    chunk's counter; the last part of a chunk releases the chunk flag on every rank.
//                    The fused kernel's parts of at most kHoldLocalTokens tokens: the local rows are
//                    held back until the part's remote rows are complete and the part published.
//   one warp zeroes this CTA's slice of the unfilled rows (padding, budget tail) with bulk stores
//   from a block of zeros in shared memory.
//
// Progress: a producer waits only for free stages (its consumer frees them unconditionally) and for
// remote chunk flags (with a deadline); a consumer waits only for its producer's jobs, and every
// producer ends with an exit job. Sends never wait for anything remote, so every chunk flag of
// every rank is released (the reuse argument of docs/hybridep.md holds unchanged).
//
// dispatch_small_kernel: a call whose tokens fit one plan chunk (decode) in one kernel. Every CTA
// first runs the preprocess steps (preprocess_steps.cuh) itself; the roles then read the layout
// from the CTA's shared memory (Env), and each producer stages the tokens of the parts it takes
// itself: it posts a part's row jobs as soon as its lanes know the rows, each with a send note (the
// rows, in shared memory) from which the consumer stores, and stages the records after them. Same
// protocol with the peers, so ranks on either path work together. With
// no grid boundary after the count reads, the count slots' reuse rests on every CTA having a send
// part (dispatch_small_grid, parts.h every_pipeline_sends). A CTA whose count wait times out
// skips its roles while the others may go on: its parts are never published, so the peers time out
// in dispatch:tokens rather than in the count exchange (an error either way, not a hang).
#include <cuda_runtime.h>

#include "dispatch/hybridep/kernels/access.cuh"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/kernels/launch.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/device/phase_trace.cuh"
#include "dispatch/hybridep/kernels/preprocess_steps.cuh"
#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/store_lag.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "dispatch/hybridep/kernels/work_items.cuh"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kPipes = 2;              // rings (producer + consumer warp pairs) per CTA
constexpr int kZeroWarp = 2 * kPipes;  // the warp that zeroes unfilled rows
constexpr int kRingThreads = 32 * (2 * kPipes + 1);
constexpr int kMinStages = 3, kMaxStages = 8;
constexpr int kZeroBytes = 4096;  // block of zeros the zeroing bulk stores read
// A producer waiting for the stage of job j + stages needs job j freed, which happens once job
// j + kFreeLag is committed (store_lag.cuh): with fewer stages than that the ring would deadlock.
static_assert(kFreeLag < kMinStages, "the consumer must free a stage before the producer needs it");
constexpr long long kMaxStageBytes = 32768;  // larger rows are refused when the dispatcher is made

enum Kind : int { kSendRow = 0, kFanOut = 1, kPartEnd = 2, kFlush = 3, kExit = 4 };
// kSendRow: a = token.  kFanOut: a = source, b = token, c = n (rows), d = first row.
// kPartEnd: a = chunk, b = parts per chunk.  kFlush, kExit: none.

// Where the fused kernel's sent token goes, handed by its producer to its consumer next to the job:
// slot q's rank (-1: no entry) and row. The consumer then reads no staged record and its stores
// start once the rows are known, while the producer stages the records (the step trace: the
// staging stores took ~3 us ahead of the first row's stores). Written and read by lane 0 only,
// under the ring's handshake, like the job descriptor of the same stage.
struct SendNote {
  int dest[preprocess_steps::kRegisterSlots];
  int row[preprocess_steps::kRegisterSlots];
};
constexpr std::size_t kSendNotesBytes = sizeof(SendNote) * kPipes * kMaxStages;

// The fused kernel's extra region, laid out once for the kernel and for its shared-memory size: the
// zero block, the preprocess steps' arrays, the inline plan's bits and the send notes (16-byte
// aligned). Offsets from the start of the region.
struct SmallExtra {
  std::size_t steps, bits, notes, bytes;
  __host__ __device__ constexpr explicit SmallExtra(int experts)
      : steps(kZeroBytes),
        bits(steps + preprocess_smem_bytes(experts)),
        notes((bits + static_cast<std::size_t>(plan_bits_bytes(experts)) + 15) / 16 * 16),
        bytes(notes + kSendNotesBytes) {}
};

// What the roles read of the call's layout: from the preprocess kernel's results in device memory
// (dispatch_kernel), or from the CTA's own shared memory (dispatch_small_kernel).
struct Env {
  unsigned epoch;
  bool move;           // the preprocess steps' decision (false: aborted call, flags only)
  long long out_rows;  // rows of this rank's output
  int pipelines;       // rings in the grid
  long long used_rows;                         // rows covered by this rank's groups
  const long long *begin, *kept, *tpe;         // [L] this rank's groups
  const long long* tokens;                     // [R] T of every rank (clamped)
  // Non-null in the fused kernel: its producers stage their parts' tokens.
  const preprocess_steps::TokenRows* token_rows = nullptr;
  // The fused kernel's producer lanes: the slots of their token of the pipeline's first send part,
  // loaded while the counts travelled (first_send_part).
  const preprocess_steps::TokenSlots* first_slots = nullptr;
  // The fused kernel: the inline plan's bits, kept in shared memory, from which the producers rank
  // the slots of their later parts (no slot ranks in device memory).
  const std::uint32_t* plan_bits = nullptr;
  // The fused kernel: each ring's send notes ([kPipes][kMaxStages] in shared memory, SendNote).
  SendNote* notes = nullptr;
  // The fused kernel with parts of at most kHoldLocalTokens tokens: how many send jobs' local rows
  // its consumer may hold back until their part's remote rows are complete (consume).
  int hold_local = 0;
};

// A part's publication, which the peers' fan-out of its rows waits for, needs only its remote rows.
// With parts this small the consumer holds a part's local rows back, waits for its remote rows,
// publishes the part and only then stores the local rows: decode's chunk flags came ~1.5 us earlier
// at 32 SMs (2-token parts). With 4-token parts (decode at 16 SMs) the SMs' store path is what
// limits, and holding the rows back cost ~0.8 us; local rows issued right behind the remote rows,
// without the wait, delayed the remote rows themselves (A/B runs, docs/hybridep-history.md).
constexpr int kHoldLocalTokens = 2;

// Ring `ring`'s note for job j.
__device__ SendNote* send_note(const Env& env, const Ring& ring, int ring_index, unsigned j) {
  return env.notes + ring_index * kMaxStages + ring.slot(j);
}

// A pipeline's first send part: the item with its own index (work_items.cuh).
__device__ Part first_send_part(const DispatchView& v, const DispatchCall& c, const PartSplit& split, int pipe) {
  return part_in_rank(pipe, split, c.tokens, v.rank);
}

// ---- records -----------------------------------------------------------------------------------------

// The local rows of a staged record all lie in this rank's output. The producer (probs) and the
// consumer (rows) apply this same test, so a bad record is skipped by both (the fused kernel's
// producer tests each entry as it builds the record instead: it writes the probs of the rows in
// range and reports the others).
__device__ bool local_rows_ok(const unsigned char* rec, unsigned n, int width, long long out_rows) {
  if (n > static_cast<unsigned>(width)) return false;
  const RecordEntry* e = record_entries(rec);
  for (unsigned q = 0; q < n; ++q)
    if (e[q].row < 0 || e[q].row >= out_rows) return false;
  return true;
}
__device__ bool warp_local_rows_ok(const unsigned char* rec, unsigned n, int width, long long out_rows, int lane) {
  bool bad = n > static_cast<unsigned>(width);
  const RecordEntry* e = record_entries(rec);
  for (unsigned q = lane; !bad && q < n; q += 32) bad = e[q].row < 0 || e[q].row >= out_rows;
  return !__any_sync(kFullMask, bad);
}

// The staged records of tokens [t0, t1) to every destination's record slots (me, t): 16-byte words,
// 4 loads in flight per lane; word 0 of each record gets the epoch when it has entries, else 0.
__device__ void copy_records(const DispatchView& v, const Part& p, unsigned epoch, int lane) {
  if (p.t1 <= p.t0) return;
  constexpr int kBatch = 4;
  const long long per_record = v.record_bytes / 16;
  const long long words = (p.t1 - p.t0) * per_record;  // per destination
  const long long total = words * v.ranks;
  for (long long i0 = 0; i0 < total; i0 += 32 * kBatch) {
    uint4 x[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const long long i = i0 + b * 32 + lane;
      if (i < total) {
        const int d = static_cast<int>(i / words);
        x[b] = reinterpret_cast<const uint4*>(staging_at(v, d, p.t0))[i - d * words];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const long long i = i0 + b * 32 + lane;
      if (i < total) {
        const int d = static_cast<int>(i / words);
        const long long w = i - d * words;
        if (w % per_record == 0) x[b].x = x[b].y > 0 ? epoch : 0u;
        reinterpret_cast<uint4*>(record_at(records_of(v, d), v.rank, p.t0, v.max_tokens, v.record_bytes))[w] = x[b];
      }
    }
  }
}

// ---- producer -------------------------------------------------------------------------------------------

// Lane 0: the job of token row `src` (+ its scales) into stage j.
__device__ void post_row_job(const Ring& ring, unsigned j, const Job& job, const DispatchCall& c, const void* row,
                             const void* scales) {
  ring.post_expecting(j, job, static_cast<std::uint32_t>(c.row_bytes + c.scale_bytes));
  tma::load_async(ring.stage(j), row, static_cast<std::uint32_t>(c.row_bytes), ring.full_bar(j));
  if (c.scale_bytes > 0)
    tma::load_async(ring.stage(j) + c.row_bytes, scales, static_cast<std::uint32_t>(c.scale_bytes), ring.full_bar(j));
}

// Lane l's token t0 + l (read from its staged records): does it go anywhere; the probs of its rows
// here are written on the way.
__device__ bool write_staged_probs(const DispatchView& v, const Part& p, const Env& env, int lane) {
  const int R = v.ranks, me = v.rank;
  const long long t = p.t0 + lane;
  bool any = false;
  if (t < p.t1) {
    for (int d = 0; d < R; ++d) {
      const unsigned n = record_header(staging_at(v, d, t))->n;
      if (n == 0) continue;
      any = true;
      if (d != me) continue;
      const unsigned char* rec = staging_at(v, me, t);
      if (local_rows_ok(rec, n, v.width, env.out_rows)) {
        const RecordEntry* e = record_entries(rec);
        for (unsigned q = 0; q < n; ++q) *prob_at(v, me, e[q].row) = e[q].prob;
      } else {
        report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, me, t, env.out_rows);
      }
    }
  }
  return any;
}

// The fused kernel's producer lane: stages its token t from its entries (records and slot entries;
// an aborted call's get none and -1, as in the preprocess kernel) and writes the probs of the
// token's rows here from the same registers, each entry tested against the output as it is built.
__device__ void stage_and_write_probs(const DispatchView& v, const DispatchCall& c, const Env& env, long long t,
                                      const preprocess_steps::TokenEntries& e) {
  preprocess_steps::store_token_records(v, c, t, e, [&](int d, int row, float prob) {
    if (d != v.rank) return;
    if (row < env.out_rows)
      *prob_at(v, v.rank, row) = prob;
    else
      report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, v.rank, t, env.out_rows);
  });
}

// One job per token of the part that goes somewhere (`any`: lane l's token p.t0 + l), its row loaded
// into the job's stage. `note(j, l)`, called by every lane, may hand lane l's token's note for job j
// to lane 0 before the post.
template <class Note>
__device__ unsigned post_send_jobs(const DispatchCall& c, const Ring& ring, unsigned j, const Part& p, bool any,
                                   int lane, Note note) {
  const auto* hidden = static_cast<const unsigned char*>(c.hidden);
  const auto* scales = static_cast<const unsigned char*>(c.scales);
  for (unsigned m = __ballot_sync(kFullMask, any); m != 0; m &= m - 1) {
    const int l = __ffs(m) - 1;
    const long long tt = p.t0 + l;
    ring.acquire(j, lane);
    note(j, l);
    if (lane == 0)
      post_row_job(ring, j, Job{kSendRow, static_cast<int>(tt), 0, 0, 0, 0, 0, 0}, c, hidden + tt * c.row_bytes,
                   scales ? scales + tt * c.scale_bytes : nullptr);
    ++j;
  }
  if (lane == 0) trace_stamp(c.trace, kTraceLoadsPosted);
  return j;
}

// The part's staged records to every destination, while the consumer stores the rows. No fence
// here: the __syncwarp orders every lane's record stores before lane 0's "part end" post (an
// mbarrier arrive: release, CTA scope), and the consumer that observes it fences at system scope
// before it counts the part, which publishes them with the rows (fences are cumulative). A fence
// here waited 2-4 us per part for the records' NVLink acknowledgements, on the critical path of a
// decode call (the step trace).
__device__ void send_records(const DispatchView& v, const DispatchCall& c, const Part& p, const Env& env, int lane) {
  copy_records(v, p, env.epoch, lane);
  __syncwarp();
  if (lane == 0) trace_stamp(c.trace, kTraceRecordsCopied);
}

// A part of the two-kernel path: its records staged by the preprocess kernel.
__device__ unsigned produce_staged_part(const DispatchView& v, const DispatchCall& c, const Ring& ring, unsigned j,
                                        const Part& p, const Env& env, int lane) {
  if (!env.move) return j;
  const bool any = write_staged_probs(v, p, env, lane);
  if (c.trace) {
    __syncwarp();
    if (lane == 0) trace_stamp(c.trace, kTraceProbsWritten);
  }
  j = post_send_jobs(c, ring, j, p, any, lane, [](unsigned, int) {});
  send_records(v, c, p, env, lane);
  return j;
}

// A part of the fused kernel: lane l stages token p.t0 + l itself. Its rows go to the consumer in
// the job's note first, so that the row stores need not wait for the staging; then the records and
// probs, then the records to every destination.
__device__ unsigned produce_fused_part(const DispatchView& v, const DispatchCall& c, const Ring& ring, int ring_index,
                                       unsigned j, const Part& p, long long i, int pipe, const Env& env, int lane) {
  namespace ps = preprocess_steps;
  const long long t = p.t0 + lane;
  ps::TokenEntries e = ps::TokenEntries::none();
  bool any = false;
  if (t < p.t1) {
    const bool first = i == pipe && env.first_slots != nullptr;  // ranked while the counts travelled
    const ps::TokenSlots slots =
        first ? *env.first_slots
              : ps::token_slots_from_bits(ps::load_slot_inputs(c, t), env.plan_bits, v.experts, t);
    e = ps::token_entries(*env.token_rows, slots);
#pragma unroll
    for (int q = 0; q < ps::kRegisterSlots; ++q) any |= e.in_record(q, v.width);
  }
  if (c.trace && lane == 0 && t < p.t1) trace_stamp(c.trace, kTraceStagingLoaded);
  if (env.move) {
    j = post_send_jobs(c, ring, j, p, any, lane, [&](unsigned job, int l) {
      SendNote n;
#pragma unroll
      for (int q = 0; q < ps::kRegisterSlots; ++q) {
        n.dest[q] = __shfl_sync(kFullMask, e.in_record(q, v.width) ? e.dest[q] : -1, l);
        n.row[q] = __shfl_sync(kFullMask, e.row[q], l);
      }
      if (lane == 0) *send_note(env, ring, ring_index, job) = n;
    });
  }
  if (t < p.t1) stage_and_write_probs(v, c, env, t, e);
  __syncwarp();  // the warp's other lanes copy the records after it, the consumer after the part end
  if (lane == 0 && t < p.t1) trace_stamp(c.trace, kTraceStagingStored);  // as staging_loaded: parts with a token
  if (lane == 0) trace_stamp(c.trace, kTraceProbsWritten);
  if (env.move) send_records(v, c, p, env, lane);
  return j;
}

// A received record of at most kRegisterSlots entries (a width this small: at most five 16-byte
// words), read with all its loads in flight: one round trip instead of three dependent ones (the
// header, then the rows to check, then the probs to write).
struct ReceivedRecord {
  static constexpr int kWords = record_bytes(preprocess_steps::kRegisterSlots) / 16;
  uint4 w[kWords];

  // Written by the source rank over NVLink: read through L2.
  __device__ void load(const unsigned char* rec, int record_bytes) {
#pragma unroll
    for (int q = 0; q < kWords; ++q)
      if (q * 16 < record_bytes) w[q] = __ldcg(reinterpret_cast<const uint4*>(rec) + q);
  }
  __device__ unsigned epoch() const { return w[0].x; }
  __device__ unsigned n() const { return w[0].y; }
  // Entry q (a constant once unrolled) sits at byte 8 + 8q: the upper half of word (q + 1) / 2 for
  // even q, the lower half for odd q.
  __device__ RecordEntry entry(int q) const {
    const uint4& x = w[(q + 1) / 2];
    return q % 2 == 0 ? RecordEntry{static_cast<int>(x.z), __uint_as_float(x.w)}
                      : RecordEntry{static_cast<int>(x.x), __uint_as_float(x.y)};
  }
};

// Lane l's token p.t0 + l of source s, received on this rank: its probs written, and whether its
// row needs copies into other rows (n > 1; n and its first row returned). A bad record is reported.
__device__ bool write_received_probs(const DispatchView& v, const Part& p, const Env& env, long long t,
                                     unsigned& n, int& row0) {
  const int me = v.rank, s = p.source;
  const unsigned char* rec = record_at(records_of(v, me), s, t, v.max_tokens, v.record_bytes);
  long long bad_row = -1;
  bool bad = false;
  if (v.width <= preprocess_steps::kRegisterSlots) {
    ReceivedRecord r;
    r.load(rec, v.record_bytes);
    if (r.epoch() != env.epoch) return false;  // not for this rank
    n = r.n();
    row0 = r.entry(0).row;
    bad = n == 0 || n > static_cast<unsigned>(v.width);
#pragma unroll
    for (int q = 0; q < preprocess_steps::kRegisterSlots; ++q) {
      const int row = r.entry(q).row;
      if (!bad && q < static_cast<int>(n) && (row < 0 || row >= env.out_rows)) bad = true, bad_row = row;
    }
    if (!bad) {
#pragma unroll
      for (int q = 0; q < preprocess_steps::kRegisterSlots; ++q)
        if (q < static_cast<int>(n)) *prob_at(v, me, r.entry(q).row) = r.entry(q).prob;
    }
  } else {
    const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));  // {epoch, n, row0, prob0}
    if (head.x != env.epoch) return false;
    n = head.y;
    row0 = static_cast<int>(head.z);
    const RecordEntry* e = record_entries(rec);
    bad = n == 0 || n > static_cast<unsigned>(v.width);
    for (unsigned q = 0; !bad && q < n; ++q) {
      const int row = __ldcg(&e[q].row);
      if (row < 0 || row >= env.out_rows) bad = true, bad_row = row;
    }
    if (!bad)
      for (unsigned q = 0; q < n; ++q) *prob_at(v, me, __ldcg(&e[q].row)) = __ldcg(&e[q].prob);
  }
  if (bad) {
    report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, s, bad_row, env.out_rows);
    return false;
  }
  return n > 1;  // the row landed in entries[0]; the others need a copy
}

__device__ unsigned produce_fan_out_part(const DispatchView& v, const DispatchCall& c, const Ring& ring, unsigned j,
                                         const Part& p, const Env& env, int lane) {
  const int me = v.rank, s = p.source;
  const long long t = p.t0 + lane;
  unsigned n = 0;
  int row0 = 0;
  const bool copy = t < p.t1 && write_received_probs(v, p, env, t, n, row0);
  for (unsigned m = __ballot_sync(kFullMask, copy); m != 0; m &= m - 1) {
    const int l = __ffs(m) - 1;
    const unsigned nn = __shfl_sync(kFullMask, n, l);
    const int r0 = __shfl_sync(kFullMask, row0, l);
    ring.acquire(j, lane);
    if (lane == 0)
      post_row_job(ring, j, Job{kFanOut, s, static_cast<int>(p.t0 + l), static_cast<int>(nn), r0, 0, 0, 0}, c,
                   token_row(v, me, r0, c.row_bytes),
                   c.scale_bytes > 0 ? scale_row(v, me, r0, c.scale_bytes) : nullptr);
    ++j;
  }
  return j;
}

__device__ void produce(const DispatchView& v, const DispatchCall& c, const Ring& ring, int ring_index,
                        const Env& env, int pipe, int lane) {
  const int R = v.ranks, me = v.rank;
  unsigned j = 0;
  if (lane == 0) trace_stamp(c.trace, kTraceProducerStart);
  auto not_mine = [me](int s) { return s == me; };
  auto received_tokens = [&env](int s) { return env.tokens[s]; };

  // 1. This rank's tokens: never waits for anything remote.
  const PartSplit send = part_split(num_chunks(c.tokens), env.pipelines, v.part_tokens);
  const long long send_parts = static_cast<long long>(num_chunks(c.tokens)) * send.per_chunk;
  ItemQueue sends{&v.work[kWorkFirst], send_parts, pipe, env.pipelines};
  for (long long i = sends.next(lane); i < send_parts; i = sends.next(lane)) {
    const Part p = part_in_rank(i, send, c.tokens, me);
    if (env.token_rows != nullptr)
      j = produce_fused_part(v, c, ring, ring_index, j, p, i, pipe, env, lane);
    else
      j = produce_staged_part(v, c, ring, j, p, env, lane);
    ring.acquire(j, lane);
    if (lane == 0) ring.post(j, Job{kPartEnd, p.chunk, send.per_chunk, 0, 0, 0, 0, 0});
    ++j;
  }
  if (lane == 0) trace_stamp(c.trace, kTraceSendsPosted);

  // Every part sent so far must be published before this warp waits for a peer's flag: the peer
  // may be waiting for exactly that part (a publish held back by kReleaseLag would never come).
  ring.acquire(j, lane);
  if (lane == 0) ring.post(j, Job{kFlush, 0, 0, 0, 0, 0, 0, 0});
  ++j;

  // 2. The other ranks' tokens that arrived here: probs and the copies into their other rows.
  const PartSplit recv = part_split(chunks_of_ranks(R, received_tokens, not_mine), env.pipelines, v.part_tokens);
  const long long recv_parts = parts_of_ranks(R, recv, received_tokens, not_mine);
  const WaitContext wait{v.status, v.timeout_ns, Phase::dispatch_tokens};
  ItemQueue fan_outs{&v.work[kWorkSecond], recv_parts, pipe, env.pipelines};
  for (long long i = fan_outs.next(lane); i < recv_parts; i = fan_outs.next(lane)) {
    Part p;
    parts_of_ranks(R, recv, received_tokens, not_mine, i, &p);
    bool ok = true;
    if (lane == 0) {
      ok = wait_flag_at_least(chunk_flag(v, me, p.source, p.chunk), env.epoch, wait, p.source);
      if (ok) tma::fence_proxy_global();  // the bulk loads below read what the flag published
      if (ok) trace_stamp(c.trace, kTraceFlagArrived);
    }
    __syncwarp();  // lane 0's acquire is ordered before every lane's reads below
    if (!__shfl_sync(kFullMask, ok, 0)) break;
    if (env.move) j = produce_fan_out_part(v, c, ring, j, p, env, lane);
  }
  if (lane == 0) trace_stamp(c.trace, kTraceFanOutPosted);

  ring.acquire(j, lane);
  if (lane == 0) ring.post(j, Job{kExit, 0, 0, 0, 0, 0, 0, 0});
}

// ---- consumer -------------------------------------------------------------------------------------------

// Lane 0: one row (+ scales) from `stage` to a destination row.
__device__ void store_row(const DispatchCall& c, const unsigned char* stage, void* row, void* scales) {
  tma::store_async(row, stage, static_cast<std::uint32_t>(c.row_bytes));
  if (c.scale_bytes > 0) tma::store_async(scales, stage + c.row_bytes, static_cast<std::uint32_t>(c.scale_bytes));
}

// Lane 0 stores the stage to `rows[0..count)` of rank `owner`, rows given by lane-parallel
// `row_at(q)` (the warp fetches 32 at a time and hands them to lane 0).
template <class RowAt>
__device__ void store_to_rows(const DispatchView& v, const DispatchCall& c, const unsigned char* stage, int owner,
                              unsigned first, unsigned count, long long out_rows, RowAt row_at, int lane) {
  for (unsigned base = first; base < count; base += 32) {
    const unsigned q = base + lane;
    const int row = q < count ? row_at(q) : -1;
    const unsigned batch = count - base < 32 ? count - base : 32;
    for (unsigned i = 0; i < batch; ++i) {
      const int r = __shfl_sync(kFullMask, row, static_cast<int>(i));
      if (lane == 0 && r >= 0 && r < out_rows)
        store_row(c, stage, token_row(v, owner, r, c.row_bytes),
                  c.scale_bytes > 0 ? scale_row(v, owner, r, c.scale_bytes) : nullptr);
    }
  }
}

__device__ void store_send_row(const DispatchView& v, const DispatchCall& c, const unsigned char* stage, long long t,
                               const Env& env, int lane) {
  const int R = v.ranks, me = v.rank;
  unsigned n = 0;
  int row0 = -1;
  if (lane < R) {
    const uint4 head = *reinterpret_cast<const uint4*>(staging_at(v, lane, t));  // {0, n, row0, prob0}
    n = head.y;
    row0 = static_cast<int>(head.z);
  }
  // Once to each remote destination, into the token's first row there (never outside the
  // peer's window, whatever the staging says).
  bool remote = lane < R && lane != me && n > 0;
  if (remote && (n > static_cast<unsigned>(v.width) || row0 < 0 || row0 >= v.capacity_rows)) {
    report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, me, row0, v.capacity_rows);
    remote = false;
  }
  for (unsigned m = __ballot_sync(kFullMask, remote); m != 0; m &= m - 1) {
    const int d = __ffs(m) - 1;
    const int row = __shfl_sync(kFullMask, row0, d);
    if (lane == 0)
      store_row(c, stage, token_row(v, d, row, c.row_bytes),
                c.scale_bytes > 0 ? scale_row(v, d, row, c.scale_bytes) : nullptr);
  }
  // Every row of the token on this rank, straight from the stage: no fan-out, no flag wait.
  const unsigned n_me = __shfl_sync(kFullMask, n, me);
  const unsigned char* rec = staging_at(v, me, t);
  if (n_me > 0 && warp_local_rows_ok(rec, n_me, v.width, env.out_rows, lane)) {
    const RecordEntry* e = record_entries(rec);
    store_to_rows(
        v, c, stage, me, 0, n_me, env.out_rows, [e](unsigned q) { return e[q].row; }, lane);
  }
}

// Which rows of a fused-kernel job store_noted_rows stores.
enum NotedRows : int { kRemoteRows = 1, kLocalRows = 2, kAllRows = kRemoteRows | kLocalRows };

// Lane 0: a fused-kernel job's row, from the stage to the rows its note names: once to each remote
// rank, into the token's lowest row there (the record's first entry, where the receiver's fan-out
// reads it), and to every row here (all of them or none: a row outside the output was reported by
// the producer, which wrote no prob). The same bounds as store_send_row.
template <int kWhich>
__device__ void store_noted_rows(const DispatchView& v, const DispatchCall& c, const unsigned char* stage,
                                 const SendNote& note, const Env& env) {
  constexpr int kSlots = preprocess_steps::kRegisterSlots;
  const int me = v.rank;
  bool local_ok = true;
#pragma unroll
  for (int q = 0; q < kSlots; ++q) {
    const int d = note.dest[q], row = note.row[q];
    if (d == me) local_ok &= row < env.out_rows;
    if ((kWhich & kRemoteRows) == 0 || d < 0 || d == me) continue;
    bool lowest = true;
#pragma unroll
    for (int o = 0; o < kSlots; ++o) lowest &= !(note.dest[o] == d && note.row[o] < row);
    if (!lowest) continue;
    if (row >= v.capacity_rows) {
      report_status(v.status, StatusCode::corrupt, Phase::dispatch_tokens, me, row, v.capacity_rows);
      continue;
    }
    store_row(c, stage, token_row(v, d, row, c.row_bytes),
              c.scale_bytes > 0 ? scale_row(v, d, row, c.scale_bytes) : nullptr);
  }
  if constexpr ((kWhich & kLocalRows) != 0) {
    if (!local_ok) return;
#pragma unroll
    for (int q = 0; q < kSlots; ++q)
      if (note.dest[q] == me)
        store_row(c, stage, token_row(v, me, note.row[q], c.row_bytes),
                  c.scale_bytes > 0 ? scale_row(v, me, note.row[q], c.scale_bytes) : nullptr);
  }
}

__device__ void store_fan_out(const DispatchView& v, const DispatchCall& c, const unsigned char* stage, const Job& job,
                              const Env& env, int lane) {
  const unsigned char* rec = record_at(records_of(v, v.rank), job.a, job.b, v.max_tokens, v.record_bytes);
  const RecordEntry* e = record_entries(rec);
  // Entries 1..n: the producer validated them (rows inside the output) before posting the job.
  store_to_rows(
      v, c, stage, v.rank, 1, static_cast<unsigned>(job.c), env.out_rows, [e](unsigned q) { return __ldcg(&e[q].row); },
      lane);
}

// Lane 0: the stores of every job up to the part end `since` jobs ago are complete; count the part,
// and the chunk's last part releases the chunk flag on every rank.
// Also what publishes the part's records, which their producer lanes do not fence: lane 0 acquired
// the part's end (wait_lane0: the mbarrier's acquire after the producer's __syncwarp and release),
// and count_part's system fence by this same lane is cumulative. Keep the wait and the publication
// on one lane.
__device__ void publish_part(const DispatchView& v, int chunk, int per_chunk, int since, const Env& env,
                             PhaseTrace* trace) {
  tma::wait_groups_dyn(since);  // the newest `since` groups were committed after the part's end
  tma::fence_proxy_global();    // the completed bulk (async-proxy) writes before the generic fence and flags
  if (count_part(&v.work[kWorkChunks + chunk], per_chunk)) {
    for (int d = 0; d < v.ranks; ++d) st_sys(chunk_flag(v, d, v.rank, chunk), env.epoch, ::cuda::memory_order_release);
    trace_stamp(trace, kTraceChunkReleased);
  }
}

// Lane 0 of the fused kernel's consumer: the send jobs whose local rows wait for their part's remote
// rows (Env::hold_local), jobs [first, first + count) of the ring.
struct HeldRows {
  unsigned first = 0;
  int count = 0;
};

__device__ void consume(const DispatchView& v, const DispatchCall& c, const Ring& ring, int ring_index, const Env& env,
                        int lane) {
  // A held job's local rows are stored at most `hold` jobs later, and its stage is then read by
  // that job's group: freed kFreeLag jobs after it (so the ring needs more than kFreeLag + hold
  // stages; with fewer, nothing is held).
  const int hold = env.hold_local < ring.stages - kFreeLag ? env.hold_local : 0;
  StoreLag lag(kFreeLag + hold);
  HeldRows held;
  bool stamped_stores = false;  // kTraceFirstStores once per consumer
  auto publish = [&](int chunk, int parts, int since) { publish_part(v, chunk, parts, since, env, c.trace); };
  auto store_held = [&](int n) {  // lane 0: the oldest n held jobs' local rows
    for (; n > 0; --n, ++held.first, --held.count)
      store_noted_rows<kLocalRows>(v, c, ring.stage(held.first), *send_note(env, ring, ring_index, held.first), env);
  };
  for (unsigned j = 0;; ++j) {
    const Job job = ring.wait_lane0(j, lane);
    if (j == 0 && lane == 0) trace_stamp(c.trace, kTraceFirstJob);
    if (job.kind == kExit) break;
    bool part_end = job.kind == kPartEnd;
    if (job.kind == kSendRow) {
      if (env.notes == nullptr) {
        store_send_row(v, c, ring.stage(j), job.a, env, lane);
      } else if (lane == 0) {
        const SendNote& note = *send_note(env, ring, ring_index, j);
        if (hold == 0) {
          store_noted_rows<kAllRows>(v, c, ring.stage(j), note, env);
        } else {
          store_noted_rows<kRemoteRows>(v, c, ring.stage(j), note, env);
          if (held.count == 0) held.first = j;
          if (++held.count > hold) store_held(1);  // a part larger than Env::hold_local says
        }
      }
      if (!stamped_stores && lane == 0) trace_stamp(c.trace, kTraceFirstStores);
      stamped_stores = true;
    } else if (lane == 0 && held.count > 0) {
      if (part_end) {  // publish it once its remote rows are complete (since 0), then store its local rows
        publish(job.a, job.b, 0);
        part_end = false;
      }
      store_held(held.count);
    }
    if (job.kind == kFanOut) store_fan_out(v, c, ring.stage(j), job, env, lane);
    if (lane == 0) lag.after_job(ring, j, part_end, job.kind == kFlush, job.a, job.b, publish);
    __syncwarp();
  }
  if (lane == 0) {
    lag.finish(publish);  // waits for every store
    trace_stamp(c.trace, kTraceStoresDone);
  }
  __syncwarp();
}

// ---- zeroing --------------------------------------------------------------------------------------------

// This CTA's slice of bytes [0, bytes) at `base` (16-byte words split evenly over the grid), zeroed
// with bulk stores from the zero block by lane 0.
__device__ void zero_slice(unsigned char* base, long long bytes, const unsigned char* zeros, int lane) {
  const long long words = bytes / 16, G = gridDim.x, b = blockIdx.x;
  const long long lo = words * b / G, hi = words * (b + 1) / G;
  if (lane != 0) return;
  for (long long w = lo; w < hi; w += kZeroBytes / 16) {
    const long long n = hi - w < kZeroBytes / 16 ? hi - w : kZeroBytes / 16;
    tma::store_async(base + w * 16, zeros, static_cast<std::uint32_t>(n * 16));
  }
}

// Rows [a, b) of this rank's output: rows, probs and (FP8) scales; this CTA's slice of each.
__device__ void zero_rows(const DispatchView& v, const DispatchCall& c, long long a, long long b,
                          const unsigned char* zeros, int lane) {
  if (b <= a) return;
  zero_slice(reinterpret_cast<unsigned char*>(token_row(v, v.rank, a, c.row_bytes)), (b - a) * c.row_bytes, zeros,
             lane);
  if (c.scale_bytes > 0)
    zero_slice(reinterpret_cast<unsigned char*>(scale_row(v, v.rank, a, c.scale_bytes)), (b - a) * c.scale_bytes, zeros,
               lane);
  const long long G = gridDim.x, bid = blockIdx.x, n = b - a;
  float* probs = prob_at(v, v.rank, a);
  for (long long i = n * bid / G + lane; i < n * (bid + 1) / G; i += 32) probs[i] = 0.0f;
}

// The rows no (token, expert) pair fills (rows.cuh's zero_unfilled_rows, same ranges and clamps).
__device__ void zero_unfilled(const DispatchView& v, const DispatchCall& c, const Env& env, unsigned char* zeros,
                              int lane) {
  for (int i = lane; i < kZeroBytes / 16; i += 32) reinterpret_cast<uint4*>(zeros)[i] = make_uint4(0u, 0u, 0u, 0u);
  tma::fence_proxy_shared();  // the ordinary stores above before the bulk stores that read them
  __syncwarp();
  const long long out_rows = env.out_rows;
  auto clamp_row = [out_rows](long long r) { return clamp_ll(r, 0, out_rows); };
  // 32 experts' ranges loaded at once, a lane each (one after another, the loads took 13 us of a
  // decode call for 32 experts: the step trace), then zeroed one range after another by the warp.
  for (int le0 = 0; le0 < v.local_experts; le0 += 32) {
    const int le = le0 + lane;
    long long a = 0, b = 0;
    if (le < v.local_experts) {
      a = clamp_row(env.begin[le] + env.kept[le]);
      b = clamp_row(env.begin[le] + env.tpe[le]);
    }
    const int n = v.local_experts - le0 < 32 ? v.local_experts - le0 : 32;
    for (int i = 0; i < n; ++i)
      zero_rows(v, c, __shfl_sync(kFullMask, a, i), __shfl_sync(kFullMask, b, i), zeros, lane);
  }
  zero_rows(v, c, clamp_row(env.used_rows), out_rows, zeros, lane);
  if (lane == 0) {
    tma::commit();
    tma::wait_groups<0>();
    trace_stamp(c.trace, kTraceZeroed);
  }
  __syncwarp();
}

// The roles of the CTA's warps: per pipeline a producer and a consumer, and the zero warp.
__device__ void run_roles(const DispatchView& v, const DispatchCall& c, const RingLayout& layout, unsigned char* smem,
                          const Env& env) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 2 * kPipes) {
    const int ring_index = warp / 2;
    const Ring ring = Ring::make(smem, layout, ring_index);
    if (warp % 2 == 0)
      produce(v, c, ring, ring_index, env, static_cast<int>(blockIdx.x) * kPipes + ring_index, lane);
    else
      consume(v, c, ring, ring_index, env, lane);
  } else if (warp == kZeroWarp && env.move) {
    zero_unfilled(v, c, env, smem + layout.off_extra(), lane);
  }
}

// The grid's last CTA: every CTA has taken its last item; the operation ends.
__device__ void finish_dispatch(const DispatchView& v, const DispatchCall& c, const OpSession& op) {
  if (op.last_cta_to_finish() && threadIdx.x == 0) {
    v.work[kWorkFirst] = 0;
    v.work[kWorkSecond] = 0;
    op.finish();
    trace_stamp(c.trace, kTraceDispatchEnd);
  }
}

__device__ void init_rings(unsigned char* smem, const RingLayout& layout) {
  for (int p = 0; p < kPipes; ++p) Ring::make(smem, layout, p).init(1);
  tma::fence_mbar_init();
}

// After the preprocess kernel, which left the layout and the staging records in device memory.
__global__ void __launch_bounds__(kRingThreads, 1)
    dispatch_kernel(const __grid_constant__ DispatchView v, const __grid_constant__ DispatchCall c,
                       const RingLayout layout) {
  extern __shared__ __align__(128) unsigned char smem[];
  tma::grid_dependency_wait();  // launched right after the preprocess kernel: wait for its results
  const OpSession op(&v.control->op);
  const unsigned epoch = op.epoch();
  __shared__ int s_broken, s_move;
  if (threadIdx.x == 0) {
    trace_stamp(c.trace, kTraceDispatchStart);
    s_broken = timed_out(v.status);               // the count exchange timed out: move nothing, wait for nothing
    s_move = !s_broken && v.control->abort == 0;  // the preprocess kernel's decision, alike on all ranks
    init_rings(smem, layout);
  }
  __syncthreads();
  if (!s_broken) {
    // control's tokens were clamped by the preprocess kernel (tokens_of's clamp).
    const Env env{.epoch = epoch,
                  .move = s_move != 0,
                  .out_rows = v.control->out_rows,
                  .pipelines = static_cast<int>(gridDim.x) * kPipes,
                  .used_rows = v.control->used_rows,
                  .begin = v.begin,
                  .kept = v.kept,
                  .tpe = v.tpe,
                  .tokens = v.control->tokens};
    run_roles(v, c, layout, smem, env);
  }
  finish_dispatch(v, c, op);
}

// A small call in one kernel (dispatch_small_grid): every CTA first runs the preprocess steps
// itself (count exchange, every receiver's layout, the decision; CTA 0 publishes them), then its
// roles read the layout from its own shared memory and each producer stages the tokens of the parts
// it takes. No CTA waits for another CTA of this grid, and there is no kernel boundary between
// the layout and the first send (the step trace: the boundary and one CTA staging every token were
// ~9 us of a decode call's 47).
__global__ void __launch_bounds__(kRingThreads, 1)
    dispatch_small_kernel(const __grid_constant__ DispatchView v, const __grid_constant__ DispatchCall c,
                          const RingLayout layout) {
  extern __shared__ __align__(128) unsigned char smem[];
  const OpSession op(&v.control->op);
  const unsigned epoch = op.epoch();
  if (threadIdx.x == 0) init_rings(smem, layout);  // ordered before the roles by lay_out_call's barriers
  const SmallExtra extra(v.experts);
  unsigned char* const extra_smem = smem + layout.off_extra();
  auto* steps_smem = reinterpret_cast<long long*>(extra_smem + extra.steps);
  auto* plan_bits = reinterpret_cast<std::uint32_t*>(extra_smem + extra.bits);
  auto* notes = reinterpret_cast<SendNote*>(extra_smem + extra.notes);
  // Each producer lane loads the ids and weights of its token of the pipeline's first part now (they
  // arrive during the inline plan) and ranks its slots while the counts travel: only the rows wait
  // for the layout (the step trace had ~4 us from a producer's start to its rows known, after the
  // layout). Loading them in the count wait instead delayed every CTA's barrier there by ~2 us.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pipelines = static_cast<int>(gridDim.x) * kPipes, pipe = static_cast<int>(blockIdx.x) * kPipes + warp / 2;
  const PartSplit first_split = part_split(num_chunks(c.tokens), pipelines, v.part_tokens);  // the call's send split
  const Part first = first_send_part(v, c, first_split, pipe);
  const bool stages_first = warp < 2 * kPipes && warp % 2 == 0 && first.t0 + lane < first.t1;  // producers
  preprocess_steps::SlotInputs first_inputs;
  if (stages_first) first_inputs = preprocess_steps::load_slot_inputs(c, first.t0 + lane);
  preprocess_steps::TokenSlots first_slots;
  const auto load_first_slots = [&](const std::uint32_t* bits) {
    if (stages_first)
      first_slots = preprocess_steps::token_slots_from_bits(first_inputs, bits, v.experts, first.t0 + lane);
  };
  const preprocess_steps::CtaLayout l =
      preprocess_steps::lay_out_call(v, c, epoch, steps_smem, plan_bits, load_first_slots);
  __shared__ int s_broken;
  if (threadIdx.x == 0) {
    s_broken = !l.ok || timed_out(v.status);  // a timeout: move nothing, wait for nothing
    if (!s_broken) trace_stamp(c.trace, kTraceDispatchStart);  // before the barrier: before every role
  }
  __syncthreads();
  if (!s_broken) {
    const int L = v.local_experts, me = v.rank;
    const preprocess_steps::TokenRows rows{c, l.src, l.begin, l.kept, v.experts, v.owner, l.abort};
    const Env env{.epoch = epoch,
                  .move = !l.abort,
                  .out_rows = l.out_rows,
                  .pipelines = pipelines,
                  .used_rows = l.used_rows,
                  .begin = l.begin + me * L,
                  .kept = l.kept + me * L,
                  .tpe = l.tpe + me * L,
                  .tokens = l.tokens,
                  .token_rows = &rows,
                  .first_slots = &first_slots,
                  .plan_bits = plan_bits,
                  .notes = notes,
                  .hold_local = first_split.tokens <= kHoldLocalTokens ? first_split.tokens : 0};
    run_roles(v, c, layout, smem, env);
  }
  finish_dispatch(v, c, op);
}

// The kernel's shared-memory budget on each device.
SmemBudget smem_budget;

RingLayout layout_for(long long row_bytes, long long scale_bytes) {
  if (row_bytes + scale_bytes > kMaxStageBytes) return RingLayout{1, 0, 128, 0};
  return fit_rings(kPipes, static_cast<std::size_t>(row_bytes + scale_bytes), kZeroBytes, kMinStages, kMaxStages,
                   smem_budget.get(dispatch_kernel));
}

// The fused kernel: its extra region holds the zero block, the preprocess steps' arrays, the inline
// plan's bits and the send notes.
SmemBudget small_smem_budget;

RingLayout small_layout_for(long long row_bytes, long long scale_bytes, int experts) {
  if (row_bytes + scale_bytes > kMaxStageBytes) return RingLayout{1, 0, 128, 0};
  return fit_rings(kPipes, static_cast<std::size_t>(row_bytes + scale_bytes), SmallExtra(experts).bytes, kMinStages,
                   kMaxStages, small_smem_budget.get(dispatch_small_kernel));
}

}  // namespace

bool dispatch_supported(long long row_bytes, long long scale_bytes) {
  return layout_for(row_bytes, scale_bytes).stages >= kMinStages;
}

void prepare_dispatch() {
  raise_smem_limit(dispatch_kernel);
  raise_smem_limit(dispatch_small_kernel);
}

int dispatch_small_grid(long long row_bytes, long long scale_bytes, int experts, int slots, long long tokens,
                        int max_grid, int part_tokens) {
  if (slots > preprocess_steps::kRegisterSlots || small_layout_for(row_bytes, scale_bytes, experts).stages < kMinStages)
    return 0;
  return fused_grid(tokens, max_grid, kPipes, part_tokens);
}

void launch_dispatch_small(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream) {
  const RingLayout layout = small_layout_for(c.row_bytes, c.scale_bytes, v.experts);
  FLEXEP_CHECK(layout.stages >= kMinStages && c.inline_plan &&
                   every_pipeline_sends(c.tokens, grid * kPipes, v.part_tokens),
               "hybridep fused dispatch: not for this call (internal error: dispatch_small_grid decides)");
  launch_kernel(dispatch_small_kernel, grid, kRingThreads, layout.total_bytes(), stream, false, v, c, layout);
}

void launch_dispatch(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream,
                        bool after_preprocess) {
  const RingLayout layout = layout_for(c.row_bytes, c.scale_bytes);
  FLEXEP_CHECK(layout.stages >= kMinStages, "hybridep dispatch: a row of ", c.row_bytes + c.scale_bytes,
               " bytes does not fit its rings (internal error: dispatch_supported decides)");
  launch_kernel(dispatch_kernel, grid, kRingThreads, layout.total_bytes(), stream, after_preprocess, v, c, layout);
}

}  // namespace flexep::hybridep
