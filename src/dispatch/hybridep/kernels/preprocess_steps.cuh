// The steps of a hybridep dispatch's preprocessing, as device functions: the preprocess kernel
// (preprocess.cu) runs them on its own grid, the fused small-call dispatch kernel
// (dispatch.cu) at the start of every one of its CTAs. preprocess.cu's header comment
// lists the steps.
#pragma once

#include <cuda_runtime.h>

#include "dispatch/hybridep/kernels/access.cuh"
#include "dispatch/hybridep/kernels/chunk_plan.cuh"
#include "dispatch/hybridep/kernels/chunk_plan_math.h"
#include "dispatch/hybridep/device/count_words.cuh"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/device/phase_trace.cuh"
#include "dispatch/hybridep/kernels/warp_layout.cuh"

namespace flexep::hybridep::preprocess_steps {

// Tokens with at most this many slots build their records in registers and store them once.
constexpr int kRegisterSlots = 8;

// A token's slots as far as they are known before the layout: each slot's expert, its rank among
// this rank's pairs of that expert (the plan's), and its weight. expert -1: a slot the plan did not
// rank (no or an invalid expert).
struct TokenSlots {
  int expert[kRegisterSlots];
  int rank[kRegisterSlots];
  float prob[kRegisterSlots];
};

// Slot i of token t from the plan's results in device memory (the plan kernel's, or the inline
// plan's slot ranks): its rank among this rank's pairs of its expert, which goes to `expert`; -1 for
// no or an invalid expert.
__device__ inline long long plan_slot_rank(const DispatchCall& c, int experts, long long t, long long i, int& expert) {
  const int local = c.plan_slot_rows[i];
  if (local < 0) return -1;
  expert = static_cast<int>(plan_id_at(c.indices, c.indices_i64, i));  // valid: the plan ranked it
  return (c.inline_plan ? 0 : c.plan_chunk_base[(t / kPlanChunkTokens) * experts + expert]) + local;
}

__device__ inline TokenSlots load_token_slots(const DispatchCall& c, int experts, long long t) {
  TokenSlots s;
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    s.expert[j] = -1;
    s.rank[j] = -1;
    s.prob[j] = 0.0f;
    if (j < c.slots) {
      const long long i = t * c.slots + j;
      int e = -1;
      const long long rank = plan_slot_rank(c, experts, t, i, e);
      if (rank >= 0) {
        s.expert[j] = e;
        s.rank[j] = static_cast<int>(rank);
        s.prob[j] = c.weights[i];
      }
    }
  }
  return s;
}

// What a token's slots read from the inputs: the expert ids and the weights (-1 and 0 past the
// call's slots). The fused kernel's producers load them at the kernel's start, so that they arrive
// during the inline plan: nothing uses them before the count release.
struct SlotInputs {
  long long id[kRegisterSlots];
  float weight[kRegisterSlots];
};

__device__ inline SlotInputs load_slot_inputs(const DispatchCall& c, long long t) {
  SlotInputs in;
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    in.id[j] = -1;
    in.weight[j] = 0.0f;
    if (j < c.slots) {
      in.id[j] = plan_id_at(c.indices, c.indices_i64, t * c.slots + j);
      in.weight[j] = c.weights[t * c.slots + j];
    }
  }
  return in;
}

// From the inline plan's bits in shared memory (a one-chunk call: token t is chunk token t), the
// same ranks write_slot_ranks writes. The fused kernel's producers rank all their tokens so (it
// keeps the bits): their first part's while the counts travel, so that only the rows wait for the
// layout, and every later part's as they take it. Reads shared memory only.
__device__ inline TokenSlots token_slots_from_bits(const SlotInputs& in, const std::uint32_t* bits, int experts,
                                                   long long t) {
  TokenSlots s;
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    s.rank[j] = chunk_slot_rank(bits, in.id[j], experts, static_cast<int>(t));
    s.expert[j] = s.rank[j] >= 0 ? static_cast<int>(in.id[j]) : -1;
    s.prob[j] = s.rank[j] >= 0 ? in.weight[j] : 0.0f;
  }
  return s;
}

// Where the slots of this rank's tokens go, once every receiver's layout is known (steps 3 + 4).
struct TokenRows {
  const DispatchCall& c;
  const long long* src;    // [E] first row of this rank's pairs in each group
  const long long* begin;  // [E] first row of each group on its owner
  const long long* kept;   // [E] rows kept per group
  int experts;
  OwnerOf owner;  // expert -> owner rank
  bool abort;

  // The row of a slot of expert e with `rank` among this rank's pairs of e, on e's owner (-1:
  // dropped by the budget, or the call aborted), and that owner.
  __device__ long long row_of(int e, long long rank, int& dest) const {
    if (abort) return -1;
    dest = owner(e);
    return slot_destination_row(rank, 0, src[e], begin[e] + kept[e]);
  }

  // Slot i of token t, from the plan's results in device memory (-1 also for no or an invalid expert).
  __device__ long long row(long long t, long long i, int& dest) const {
    if (abort) return -1;
    int e = -1;
    const long long rank = plan_slot_rank(c, experts, t, i, e);
    return rank < 0 ? -1 : row_of(e, rank, dest);
  }
};

// A token's entries once every receiver's layout is known: slot j's row on rank dest[j] (-1: no
// row there, the budget dropped it, or the call aborted), its weight, and its place in that rank's
// record, whose entries are sorted by row. The rows of one token on one rank belong to distinct
// experts, hence distinct groups: an entry's place is the number of the token's entries for the
// same rank with a lower row. An entry whose place is not below the record's width has no room.
struct TokenEntries {
  int row[kRegisterSlots], dest[kRegisterSlots], place[kRegisterSlots];
  float prob[kRegisterSlots];

  // Slot j has an entry in dest[j]'s record.
  __device__ bool in_record(int j, int width) const { return row[j] >= 0 && place[j] < width; }

  __device__ static TokenEntries none() {
    TokenEntries e;
#pragma unroll
    for (int j = 0; j < kRegisterSlots; ++j) e.row[j] = e.dest[j] = -1, e.place[j] = 0, e.prob[j] = 0.0f;
    return e;
  }
};

__device__ inline TokenEntries token_entries(const TokenRows& rows, const TokenSlots& slots) {
  const int k = rows.c.slots;
  TokenEntries e = TokenEntries::none();
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    if (j < k && slots.expert[j] >= 0) {
      int d = -1;
      const long long r = rows.row_of(slots.expert[j], slots.rank[j], d);
      if (r >= 0) {
        e.row[j] = static_cast<int>(r);
        e.dest[j] = d;
        e.prob[j] = slots.prob[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    int place = 0;
#pragma unroll
    for (int q = 0; q < kRegisterSlots; ++q) place += e.dest[q] == e.dest[j] && e.row[q] < e.row[j] ? 1 : 0;
    e.place[j] = place;
  }
  return e;
}

// Token t's record for each destination and its slots' entries, from its entries in registers.
// `on_entry(dest, row, prob)` sees each entry stored (the fused kernel's producer writes its local
// probs from these registers instead of reading the records back).
struct NoEntryHook {
  __device__ void operator()(int, int, float) const {}
};

template <class OnEntry = NoEntryHook>
__device__ inline void store_token_records(const DispatchView& v, const DispatchCall& c, long long t,
                                           const TokenEntries& e, OnEntry on_entry = {}) {
  const int k = c.slots;
  for (int d = 0; d < v.ranks; ++d) {
    unsigned n = 0;
#pragma unroll
    for (int j = 0; j < kRegisterSlots; ++j) n += e.dest[j] == d ? 1u : 0u;
    *record_header(staging_at(v, d, t)) = RecordHeader{0u, n < static_cast<unsigned>(v.width) ? n : v.width};
  }
#pragma unroll
  for (int j = 0; j < kRegisterSlots; ++j) {
    if (j >= k) break;
    int entry = -1;
    if (e.in_record(j, v.width)) {
      record_entries(staging_at(v, e.dest[j], t))[e.place[j]] = RecordEntry{e.row[j], e.prob[j]};
      entry = e.dest[j] * v.width + e.place[j];
      on_entry(e.dest[j], e.row[j], e.prob[j]);
    } else if (e.row[j] >= 0) {
      report_status(v.status, StatusCode::corrupt, Phase::dispatch_counts, v.rank, e.dest[j], v.width);
    }
    v.slot_entry[t * k + j] = entry;
  }
}

// Both, for the preprocess kernel's staging threads.
__device__ inline void stage_token_in_registers(const DispatchView& v, const TokenRows& rows, long long t,
                                                const TokenSlots& slots, bool stamp) {
  const TokenEntries e = token_entries(rows, slots);
  if (stamp) trace_stamp(rows.c.trace, kTraceStagingLoaded);  // rows known (prob loads may be in flight)
  store_token_records(v, rows.c, t, e);
  if (stamp) trace_stamp(rows.c.trace, kTraceStagingStored);
}

// Any number of slots: sorted inserts into the staged records, then a search for each slot's entry.
__device__ inline void stage_token_in_memory(const DispatchView& v, const TokenRows& rows, long long t) {
  const int k = rows.c.slots;
  for (int d = 0; d < v.ranks; ++d) record_clear(staging_at(v, d, t));
  for (int j = 0; j < k; ++j) {
    const long long i = t * k + j;
    int d = -1;
    const long long row = rows.row(t, i, d);
    if (row < 0) continue;
    if (!record_insert(staging_at(v, d, t), v.width, static_cast<int>(row), rows.c.weights[i]))
      report_status(v.status, StatusCode::corrupt, Phase::dispatch_counts, v.rank, d, v.width);
  }
  for (int j = 0; j < k; ++j) {
    const long long i = t * k + j;
    int d = -1;
    const long long row = rows.row(t, i, d);
    int entry = -1;
    if (row >= 0) {
      const int found = record_find(staging_at(v, d, t), static_cast<int>(row));
      if (found >= 0) entry = d * v.width + found;
    }
    v.slot_entry[i] = entry;
  }
}

// The tokens this CTA stages: thread i's is token(i), then every `stride` tokens after it.
//   one chunk (the inline plan, T <= blockDim): token t on CTA t % G, so that every CTA stages a few
//     (one CTA staging all of decode's 128 tokens was the preprocess kernel's slowest step in the
//     step trace, 6-7 us after its layout);
//   larger calls: blocks of blockDim tokens, block 0 on CTA 1 when there are several (CTA 0 first
//     publishes the layout, in blocking mode over PCIe).
struct StagingShare {
  long long first, step, stride;
  __device__ long long token(int i) const { return first + i * step; }
};

__device__ inline StagingShare staging_share(bool one_chunk) {
  const long long G = gridDim.x, B = blockDim.x;
  if (one_chunk) return StagingShare{blockIdx.x, G, G * B};
  return StagingShare{(blockIdx.x + G - 1) % G * B, 1, G * B};
}

// Step 0, a call whose T tokens fit one plan chunk (decode): the chunk plan kernel's work for that
// chunk, here, which saves the call a kernel and a dependent launch. Every CTA sets the chunk's
// bits and counts every expert's pairs into `counts` (the count exchange needs them in every CTA;
// the preprocess kernel's slot ranks follow once the counts are sent, write_inline_slot_ranks; the
// fused kernel ranks from the bits). The lowest bad slot
// (t * k + j) of the chunk is the same in every CTA; ~0 if none.
__device__ inline unsigned long long plan_inline(const DispatchCall& c, int experts, std::uint32_t* bits,
                                                 long long* counts) {
  __shared__ unsigned long long s_bad;
  const int tid = threadIdx.x;
  if (tid == 0) s_bad = ~0ull;
  for (int w = tid; w < experts * kPlanChunkWords; w += blockDim.x) bits[w] = 0;
  __syncthreads();
  const PlanIds ids{c.indices, c.indices_i64, c.slots, experts};
  const auto lowest = [&](long long t, int j, long long) {
    atomicMin(&s_bad, static_cast<unsigned long long>(t * c.slots + j));
  };
  for (long long t = tid; t < c.tokens; t += blockDim.x) set_token_bits(bits, ids, t, static_cast<int>(t), lowest);
  __syncthreads();
  for (int e = tid; e < experts; e += blockDim.x) counts[e] = plan_word_prefix(bits, e, kPlanChunkWords);
  __syncthreads();  // the counts are complete
  return s_bad;
}

// The slot ranks of the tokens this CTA stages (staging_share), for its staging threads to read
// back. Run while the counts travel: nothing before the layout needs them, and a system fence
// before the count release would wait for these stores too. (The fused small-call kernel writes
// none: its producers rank their tokens from the plan's bits, which it keeps.)
__device__ inline void write_inline_slot_ranks(const DispatchCall& c, const std::uint32_t* bits, int experts) {
  const PlanIds ids{c.indices, c.indices_i64, c.slots, experts};
  const long long mine = staging_share(true).token(threadIdx.x);
  if (mine < c.tokens) write_slot_ranks(bits, ids, mine, static_cast<int>(mine), c.plan_slot_rows);
}

// The header's device_* words: the call's first device error on this rank, identical in every CTA.
struct DeviceError {
  long long arg = 0, row = 0, column = -1, value = 0, limit = 0;
};

// With the plan kernel before (final by now) it is the error record. With the inline plan, CTA 0
// also reports the chunk's lowest bad slot there. `prior_arg` is the record's arg as read at the
// start of this kernel's steps, before any CTA of it reported: an earlier kernel's error (multihot
// routing, final) or none - so every CTA uses the same one. (Read there so that its round trip
// overlaps the inline plan instead of delaying the count stores.)
__device__ inline DeviceError device_error(const DispatchCall& c, unsigned long long bad, int experts, int prior_arg) {
  DeviceError found;  // by the inline plan
  if (c.inline_plan && bad != ~0ull) {
    const long long i = static_cast<long long>(bad);
    found = DeviceError{static_cast<long long>(cuda::DeviceArg::indices), i / c.slots, i % c.slots,
                        plan_id_at(c.indices, c.indices_i64, i), experts};
    if (blockIdx.x == 0 && threadIdx.x == 0)  // first error wins, as in the plan kernel
      cuda::report_device_error(c.errors, cuda::DeviceArg::indices, found.row, static_cast<int>(found.column),
                                found.value, found.limit);
  }
  if (prior_arg <= 0) return found;
  fence_sys(::cuda::memory_order_acq_rel);  // with the relaxed read of prior_arg: an acquire of the record's fields
  return DeviceError{prior_arg, __ldcg(&c.errors->row), __ldcg(&c.errors->column), __ldcg(&c.errors->value),
                     __ldcg(&c.errors->limit)};
}

// Blocking mode, CTA 0: [control | tokens_per_expert] (this CTA's stores) and the status to the
// host, then the call's number after them.
__device__ inline void publish_to_host(const DispatchView& v, const DispatchCall& c) {
  __syncthreads();
  const int words = static_cast<int>((sizeof(DispatchControl) + 8 * static_cast<std::size_t>(v.local_experts)) / 8);
  const auto* src = reinterpret_cast<const long long*>(v.control);
  auto* dst = reinterpret_cast<long long*>(c.host_control);
  for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
  if (threadIdx.x == 0) {
    const volatile Status* st = v.status;  // errors of this call's CTAs or of earlier calls
    c.host_status->code = st->code;
    c.host_status->phase = st->phase;
    c.host_status->peer = st->peer;
    c.host_status->value = st->value;
    c.host_status->limit = st->limit;
  }
  __threadfence_system();  // each thread's copies before the barrier, the barrier before the number
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned*>(c.host_seq_at) = c.host_seq;
}

// What steps 0-4 leave in a CTA's shared memory: every receiver's layout (this rank's groups at
// [me * L, (me + 1) * L)), this rank's first row in each group, every rank's T and the decision.
struct CtaLayout {
  bool ok = false;     // false: the count exchange timed out (status set; CTA 0 published an abort)
  bool abort = false;  // the call moves nothing (alike on every rank)
  long long* begin = nullptr;  // [E] first row of every expert's group on its owner
  long long* kept = nullptr;   // [E] real rows kept per group
  long long* tpe = nullptr;    // [E] tokens_per_expert per group
  long long* src = nullptr;    // [E] first row of THIS rank's pairs in the group
  const long long* tokens = nullptr;  // [R] T of every rank (as its header says, clamped)
  long long out_rows = 0, used_rows = 0;  // this rank's output
};

struct NoBitsHook {
  __device__ void operator()(const std::uint32_t*) const {}
};

// Step 1 of lay_out_call: this rank's slot into every rank's count region, as LL words
// (count_words.cuh): plain stores with the epoch in every word, no fence and no flag. Identical in
// every CTA (device_error says why for the device_* words), so a peer may read any CTA's.
__device__ inline void send_counts(const DispatchView& v, const DispatchCall& c, unsigned epoch,
                                   const long long* counts_of_mine, const DeviceError& err) {
  const int R = v.ranks, W = word::count + v.experts;
  for (int i = threadIdx.x; i < R * W; i += blockDim.x) {
    const int d = i / W, w = i - d * W;
    long long value = 0;
    if (w >= word::count)
      value = counts_of_mine ? counts_of_mine[w - word::count] : 0;
    else if (w == word::device_arg)
      value = err.arg;
    else if (w == word::device_row)
      value = err.row;
    else if (w == word::device_column)
      value = err.column;
    else if (w == word::device_value)
      value = err.value;
    else if (w == word::device_limit)
      value = err.limit;
    else
      value = c.header[w];
    unsigned long long* slot = count_slot(v, d, v.rank);
    const auto bits = static_cast<unsigned long long>(value);
    if (w < word::count) {
      ll_store(ll_header_word(slot, w, 0), epoch, static_cast<unsigned>(bits));
      ll_store(ll_header_word(slot, w, 1), epoch, static_cast<unsigned>(bits >> 32));
    } else {
      ll_store(ll_count_word(slot, w - word::count), epoch, static_cast<unsigned>(bits));
    }
  }
}

// Step 2: every rank's slot has arrived here. Each thread polls its words (all loads in flight)
// until every one carries this call's epoch; it keeps the header values in `head`, and for each of
// its experts the pairs from all sources (`pairs`) and from the sources before this rank
// (`before`). False (this thread): the wait timed out (status set).
__device__ inline bool gather_counts(const DispatchView& v, unsigned epoch, const WaitContext& wait,
                                     long long (*head)[word::count], long long* pairs, long long* before) {
  const int R = v.ranks, E = v.experts, me = v.rank, tid = threadIdx.x;
  const auto* region = reinterpret_cast<const unsigned char*>(v.peers.window[me] + v.off_counts);
  bool ok = true;
  for (int i = tid; ok && i < R * word::count; i += blockDim.x) {
    const int s = i / word::count, w = i % word::count;
    const unsigned long long* slot = ll_slot(region, v.slot_bytes, s);
    unsigned half[kLlBatch];
    ok = ll_wait([&](int h) { return ll_header_word(slot, w, h); }, 2, epoch, wait, [s](int) { return s; }, half);
    head[s][w] = static_cast<long long>((static_cast<unsigned long long>(half[1]) << 32) | half[0]);
  }
  for (int e = tid; ok && e < E; e += blockDim.x) {
    long long all = 0, sum_before = 0;
    for (int s0 = 0; ok && s0 < R; s0 += kLlBatch) {
      const int n = R - s0 < kLlBatch ? R - s0 : kLlBatch;
      unsigned count[kLlBatch];
      ok = ll_wait([&](int i) { return ll_count_word(ll_slot(region, v.slot_bytes, s0 + i), e); }, n, epoch, wait,
                   [s0](int i) { return s0 + i; }, count);
      for (int i = 0; i < n; ++i) {
        all += count[i];
        if (s0 + i < me) sum_before += count[i];
      }
    }
    pairs[e] = all;
    before[e] = sum_before;
  }
  return ok;
}

// Steps 3 + 4: every receiver's layout (warp w: receivers w, w + warps, ...) into begin / kept /
// tpe and `totals`, and the decision, alike on every rank: true when the call must abort (a
// failed or disagreeing header, an overflow, or more rows than the receive buffer holds).
__device__ inline bool lay_out_receivers(const DispatchView& v, const DispatchCall& c,
                                         const long long (*head)[word::count], const long long* pairs,
                                         long long* begin, long long* kept, long long* tpe, ReceiverTotals* totals) {
  __shared__ int s_bad[kMaxRanks];
  __shared__ int s_abort;
  const int R = v.ranks, L = v.local_experts, tid = threadIdx.x, lane = tid % 32;
  const LayoutParams lp{R, v.experts, c.pad_multiple, c.budget, c.drop != 0};
  for (int d = tid / 32; d < R; d += blockDim.x / 32) {
    const ReceiverTotals t = warp_receiver_layout(pairs + d * L, lp, begin + d * L, kept + d * L, tpe + d * L, lane);
    if (lane == 0) {
      totals[d] = t;
      s_bad[d] = header_failed(head[d]) || !header_agrees(head[0], head[d]) || t.overflow ||
                 t.out_rows > v.capacity_rows;
    }
  }
  __syncthreads();
  if (tid == 0) {
    int abort = 0;
    for (int d = 0; d < R; ++d) abort |= s_bad[d];
    s_abort = abort;
  }
  __syncthreads();
  return s_abort != 0;
}

// CTA 0 only: publishes the decision and this rank's receiver layout for the dispatch kernel and
// the host (blocking mode reads control + tokens_per_expert with one copy). The first unreported
// abort also keeps a snapshot of the count region: the host decodes from it why (layout.h,
// abort_reason), with the same message on every rank.
__device__ inline void publish_layout(const DispatchView& v, const DispatchCall& c, bool abort,
                                      const long long (*head)[word::count], const long long* tokens,
                                      const long long* begin, const long long* kept, const long long* tpe,
                                      const ReceiverTotals& mine) {
  __shared__ int s_claimed;
  const int R = v.ranks, L = v.local_experts, me = v.rank, tid = threadIdx.x;
  for (int le = tid; le < L; le += blockDim.x) {
    v.tpe[le] = tpe[me * L + le];
    v.begin[le] = begin[me * L + le];
    v.kept[le] = kept[me * L + le];
  }
  // T of every rank: the sender uses its own T, the receiver this copy of the sender's header,
  // so both count the same chunks (a rank whose checks failed sends T = 0 and reads no input).
  if (tid < R) v.control->tokens[tid] = tokens[tid];
  if (tid == 0) {
    v.control->abort = abort ? 1 : 0;
    v.control->out_rows = mine.out_rows;
    v.control->used_rows = mine.used;
    v.control->required_rows = mine.required;
    v.control->dropped = mine.dropped;
    s_claimed = abort && atomicCAS(&v.status->code, 0, -1) == 0;
  }
  __syncthreads();
  if (s_claimed) {
    // The values of every slot (header, then the counts), each slot slot_bytes apart as the host
    // reads them (layout.h, parse_snapshot). Every word carries this call's epoch by now (step 2
    // waited for all of them), so each count is the low half of its word.
    const auto* region = reinterpret_cast<const unsigned char*>(v.peers.window[me] + v.off_counts);
    const int W = word::count + v.experts;
    const long long stride = static_cast<long long>(v.slot_bytes / 8);
    for (int i = tid; i < R * W; i += blockDim.x) {
      const int s = i / W, w = i - s * W;
      const unsigned long long* slot = ll_slot(region, v.slot_bytes, s);
      v.snapshot[s * stride + w] =
          w < word::count ? head[s][w] : static_cast<unsigned>(ll_load(ll_count_word(slot, w - word::count)));
    }
    __syncthreads();
    if (tid == 0) {
      v.status->phase = static_cast<int>(Phase::dispatch_counts);
      v.status->peer = -1;
      __threadfence();
      atomicExch(&v.status->code, static_cast<int>(StatusCode::abort));
    }
  }
  if (c.host_control) publish_to_host(v, c);
}

// Steps 0-4 in every CTA of the calling grid, then CTA 0 publishes this rank's receiver layout and
// the decision (DispatchControl, tokens_per_expert; blocking mode: also to the host). `epoch`: the
// caller's OpSession epoch (read once per kernel: its shared word is written by thread 0 on each call, and a
// second call would rewrite it while other threads may still read the first). `smem`:
// preprocess_smem_bytes(E) of dynamic shared memory. The inline plan's bits (plan_bits_bytes(E)):
// with `kept_bits` null they live where the layout arrays will, and the CTA writes the slot ranks
// of the tokens it stages (write_inline_slot_ranks); else they go to `kept_bits`, stay there after
// the layout, and no slot rank is written (the caller ranks from the bits: token_slots_from_bits).
// With the inline plan, every thread calls `while_counts_travel(bits)` between the count release
// and the wait for the peers' counts.
template <class WhileCountsTravel = NoBitsHook>
__device__ inline CtaLayout lay_out_call(const DispatchView& v, const DispatchCall& c, unsigned epoch, long long* smem,
                                         std::uint32_t* kept_bits, WhileCountsTravel while_counts_travel = {}) {
  const int R = v.ranks, E = v.experts, me = v.rank, tid = threadIdx.x;
  const bool stamp = tid == 0;  // the CTA's stamps (phase_trace.h), after the steps' barriers
  if (stamp) trace_stamp(c.trace, kTracePreprocessStart);
  __shared__ long long s_tokens[kMaxRanks];
  long long* s_begin = smem;        // [E] first row of every expert's group on its owner
  long long* s_kept = smem + E;     // [E] real rows kept per group
  long long* s_tpe = smem + 2 * E;  // [E] tokens_per_expert per group
  long long* s_src = smem + 3 * E;  // [E] first row of THIS rank's pairs in the group
  long long* s_pairs = smem + 4 * E;  // [E] pairs of every expert from all sources
  __shared__ long long s_head[kMaxRanks][word::count];
  __shared__ ReceiverTotals s_totals[kMaxRanks];

  const WaitContext wait{v.status, v.timeout_ns, Phase::dispatch_counts};
  const int prior_arg = ld_volatile(&c.errors->arg);  // device_error

  // 0. The plan of a one-chunk call; its counts live where s_pairs will (step 2 overwrites them
  //    after the barriers of step 1), its bits in `kept_bits` or where the layout arrays will.
  long long* s_counts = s_pairs;
  std::uint32_t* bits = kept_bits != nullptr ? kept_bits : reinterpret_cast<std::uint32_t*>(smem);
  const unsigned long long bad = c.inline_plan ? plan_inline(c, E, bits, s_counts) : ~0ull;
  const long long* counts_of_mine = c.inline_plan ? s_counts : c.plan_counts;
  if (stamp && c.inline_plan) trace_stamp(c.trace, kTracePlanned);

  // 1. This rank's counts out.
  send_counts(v, c, epoch, counts_of_mine, device_error(c, bad, E, prior_arg));
  if (stamp) trace_stamp(c.trace, kTraceCountsSent);  // stores issued
  if (c.inline_plan) {
    // Bits in the layout's place stay there until every thread is past this (the barrier below).
    if (kept_bits == nullptr) write_inline_slot_ranks(c, bits, E);
    while_counts_travel(static_cast<const std::uint32_t*>(bits));
  }
  __syncthreads();  // the plan's counts and bits are read; step 2 writes over them
  if (stamp && c.inline_plan) trace_stamp(c.trace, kTraceSlotsRanked);

  // 2. Every rank's counts in, then an acquire fence: what this rank writes into the peers'
  //    windows next comes after their counts of this call.
  const bool ok = gather_counts(v, epoch, wait, s_head, s_pairs, s_src);
  fence_sys(::cuda::memory_order_acq_rel);
  if (!__syncthreads_and(ok)) {
    // Timed out (status set): the dispatch kernel sees the status and neither moves nor waits.
    if (blockIdx.x == 0 && tid == 0) v.control->abort = 1;
    if (blockIdx.x == 0 && c.host_control) publish_to_host(v, c);  // the host then waits and raises
    return CtaLayout{};  // ok = false
  }
  if (stamp) trace_stamp(c.trace, kTraceCountsArrived);
  for (int s = tid; s < R; s += blockDim.x) s_tokens[s] = clamp_ll(s_head[s][word::tokens], 0, v.max_tokens);
  __syncthreads();

  // 3 + 4. Every receiver's layout and the decision; this rank's rows as a source (source_begin:
  //    the pairs before it, from step 2, after its group's start).
  const bool abort = lay_out_receivers(v, c, s_head, s_pairs, s_begin, s_kept, s_tpe, s_totals);
  for (int e = tid; e < E; e += blockDim.x) s_src[e] += s_begin[e];
  __syncthreads();
  if (stamp) trace_stamp(c.trace, kTraceLayoutDone);

  if (blockIdx.x == 0) {
    publish_layout(v, c, abort, s_head, s_tokens, s_begin, s_kept, s_tpe, s_totals[me]);
    if (stamp) trace_stamp(c.trace, kTracePublished);
  }

  return CtaLayout{.ok = true,
                   .abort = abort,
                   .begin = s_begin,
                   .kept = s_kept,
                   .tpe = s_tpe,
                   .src = s_src,
                   .tokens = s_tokens,
                   .out_rows = s_totals[me].out_rows,
                   .used_rows = s_totals[me].used};
}

}  // namespace flexep::hybridep::preprocess_steps
