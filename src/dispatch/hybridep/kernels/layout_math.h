// The arithmetic of the hybridep layout, shared word for word by the CUDA kernels (preprocess.cu,
// dispatch.cu, combine.cu) and the CPU tests (tests/cpu/test_hybridep_layout.cpp):
//
//   - receiver_layout(): core/plan.cpp's DispatchPlan::build for ONE receiver, from the count
//     matrix counts(s, e) (pairs of source rank s for global expert e): expert groups, padding,
//     the budget cut (drop) or overflow (error), tokens_per_expert;
//   - source rows: the pairs of source s for expert e occupy rows [begin(e) + sum_{s'<s} counts(s', e), ...)
//     on e's owner, in source-token order; a slot's row is that start plus its rank among the
//     source's own pairs of e (computed on the source by the single-GPU plan), kept iff it lies
//     below the group's kept end (plan.cpp's slot_rows);
//   - records: what travels with a token to one destination rank: the (row, prob) pairs of its kept
//     slots on that rank, sorted by row (= ascending local expert, since groups are expert-major);
//   - the header words of the count exchange (per-call configuration every rank must agree on).
//
// No CUDA headers: FLEXEP_HD marks functions __host__ __device__ only under nvcc.
#pragma once

#include <cstdint>

#include "dispatch/common/signature_words.h"

#if defined(__CUDACC__)
#define FLEXEP_HD __host__ __device__ inline
#else
#define FLEXEP_HD inline
#endif

namespace flexep::hybridep {

// Ranks of one NVLink (LSA) domain the kernels handle: rank d is lane d of a warp in every
// per-rank loop, which keeps those loops branch-free.
constexpr int kMaxRanks = 32;
// Experts in all: the preprocess kernel keeps five int64 words per expert in shared memory.
constexpr int kMaxExperts = 4096;
// Tokens per chunk: the unit of work of the persistent kernels and of their ready flags.
constexpr int kChunkTokens = 32;

// m == 1 (no padding, the common case) skips the 64-bit division, a ~70-instruction routine on the GPU.
FLEXEP_HD constexpr long long round_up(long long x, long long m) { return m == 1 ? x : (x + m - 1) / m * m; }
FLEXEP_HD long long clamp_ll(long long x, long long lo, long long hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The owner rank of expert e, e / L, without a division instruction. The GPU's integer division is
// a ~50-instruction routine, and decode runs the fused kernel's copies of it once per SM and call
// from a cold instruction cache: ~400 instructions for a token's 8 slots, 17 of the `no_inst`
// stall samples of ncu at 877fe3e. The high half of e * m with m = ceil(2^32 / L) is exact while
// e * (L - 1) < 2^32, which e < kMaxExperts and L <= kMaxExperts keep; L = 1 (m would not fit)
// gives e itself.
struct OwnerOf {
  std::uint32_t magic = 0;  // 0: one expert per rank

  FLEXEP_HD static OwnerOf for_local_experts(int local_experts) {
    OwnerOf o;
    o.magic = local_experts > 1 ? 0xFFFFFFFFu / static_cast<std::uint32_t>(local_experts) + 1u : 0u;
    return o;
  }
  FLEXEP_HD int operator()(int e) const {
    if (magic == 0) return e;
#if defined(__CUDA_ARCH__)
    return static_cast<int>(__umulhi(static_cast<unsigned>(e), magic));
#else
    return static_cast<int>((static_cast<std::uint64_t>(static_cast<std::uint32_t>(e)) * magic) >> 32);
#endif
  }
};
// Chunks of a rank with `tokens` tokens: at least one, so that every (source, receiver) pair
// exchanges at least one flag per call even when the source has no token (see docs/hybridep.md,
// "Why the buffers can be reused").
FLEXEP_HD int num_chunks(long long tokens) {
  return tokens <= 0 ? 1 : static_cast<int>((tokens + kChunkTokens - 1) / kChunkTokens);
}

// ---- the receiver layout (core/plan.cpp, one rank) -----------------------------------------------

struct LayoutParams {
  int ranks = 1;
  int experts = 1;
  long long pad_multiple = 1;
  long long budget = -1;  // < 0: blocking mode (out_rows = the rows needed)
  bool drop = false;      // budget overflow policy: drop (else error)
};

struct ReceiverTotals {
  long long required = 0;  // rows of the blocking layout (sum of the padded groups)
  long long out_rows = 0;  // rows of the output (required, or the budget)
  long long used = 0;      // rows covered by the groups (sum of tokens_per_expert); later rows are zero
  long long dropped = 0;   // pairs dropped by the budget (drop policy)
  bool overflow = false;   // budget exceeded under the error policy: the call must fail
};

// The budget's cut of one expert group (the drop policy of DispatchPlan::build): the group begins at
// `begin` (after the padded groups of every pair before it) and holds `real` pairs; it keeps those
// below the budget, and its padded length (tokens_per_expert) reaches the budget at most. Within the
// budget it keeps every pair: {real, round_up(real, pad)}.
struct GroupCut {
  long long kept = 0, len = 0;
};
FLEXEP_HD GroupCut cut_group(long long begin, long long real, long long budget, long long pad) {
  GroupCut g;
  g.kept = clamp_ll(budget - begin, 0, real);
  g.len = clamp_ll(budget - begin, 0, round_up(g.kept, pad));
  return g;
}

// Pairs of global expert e from all sources: its group's rows before padding and the budget.
template <class Counts>
FLEXEP_HD long long group_pairs(const Counts& counts, int e, int ranks) {
  long long real = 0;
  for (int s = 0; s < ranks; ++s) real += counts(s, e);
  return real;
}

// Writes, for the L = experts / ranks local experts of `receiver`: begin[le] (first row of the
// group), kept[le] (real rows kept) and tpe[le] (tokens_per_expert: padded size, cut by the budget).
// `counts(s, e)` returns the pairs of source s for global expert e. Same operations, same order as
// DispatchPlan::build. (The preprocess kernel computes the same integers with a warp per receiver:
// warp_receiver_layout in warp_layout.cuh.)
template <class Counts>
FLEXEP_HD ReceiverTotals receiver_layout(const Counts& counts, int receiver, const LayoutParams& p, long long* begin,
                                         long long* kept, long long* tpe) {
  const int L = p.experts / p.ranks;
  ReceiverTotals tot;
  long long row = 0;
  for (int le = 0; le < L; ++le) {
    const long long real = group_pairs(counts, receiver * L + le, p.ranks);
    begin[le] = row;
    kept[le] = real;
    row += round_up(real, p.pad_multiple);
  }
  tot.required = row;
  tot.out_rows = p.budget >= 0 ? p.budget : row;
  if (p.budget >= 0 && row > p.budget) {
    if (!p.drop) {
      tot.overflow = true;  // plan.cpp throws here; the caller aborts the call on every rank
    } else {
      // Keep the deterministic prefix of rows below the budget.
      for (int le = 0; le < L; ++le) {
        const long long k = cut_group(begin[le], kept[le], p.budget, p.pad_multiple).kept;
        tot.dropped += kept[le] - k;
        kept[le] = k;
      }
    }
  }
  for (int le = 0; le < L; ++le) {
    // A group cut by the budget keeps only rows below it (the budget is a multiple of the pad).
    tpe[le] = clamp_ll(tot.out_rows - begin[le], 0, round_up(kept[le], p.pad_multiple));
    tot.used += tpe[le];
  }
  return tot;
}

// First row of source s's pairs of global expert e on e's owner, given the group's first row.
template <class Counts>
FLEXEP_HD long long source_begin(const Counts& counts, int e, int source, long long group_begin) {
  long long row = group_begin;
  for (int s = 0; s < source; ++s) row += counts(s, e);
  return row;
}

// Row of a slot on its expert's owner, or -1 (no expert, or dropped by the budget).
//   local_row: the single-GPU plan's row of the slot (pad 1, no budget): local_begin + its rank
//              among this source's pairs of e, in (token, slot) order; -1 for no/invalid expert;
//   src_begin: source_begin() of this source for e; kept_end: begin + kept of e's group.
FLEXEP_HD long long slot_destination_row(long long local_row, long long local_begin, long long src_begin,
                                         long long kept_end) {
  if (local_row < 0) return -1;
  const long long row = src_begin + (local_row - local_begin);
  return row < kept_end ? row : -1;
}

// ---- records ----------------------------------------------------------------------------------------
// Layout of one record (16-byte aligned, `record_bytes(width)` bytes):
//   word 0: epoch of the dispatch that wrote it (0 in the sender's staging copy)
//   word 1: n, the number of entries (1 <= n <= width in a sent record; 0 = "not for this rank")
//   then n entries {int32 row, float prob}, sorted by row.
// A sent record occupies ceil((8 + 8n) / 16) 16-byte words; the first word {epoch, n, row0, prob0}
// therefore carries the header and the row the payload lands in.

struct RecordEntry {
  int row;
  float prob;
};
static_assert(sizeof(RecordEntry) == 8, "records are moved as raw 16-byte words");

struct RecordHeader {
  unsigned epoch;
  unsigned n;
};

FLEXEP_HD constexpr int record_bytes(int width) { return static_cast<int>(round_up(8 + 8LL * width, 16)); }
// 16-byte words a record of n entries occupies.
FLEXEP_HD int record_words(unsigned n) { return static_cast<int>((8 + 8 * static_cast<long long>(n) + 15) / 16); }

FLEXEP_HD RecordHeader* record_header(unsigned char* rec) { return reinterpret_cast<RecordHeader*>(rec); }
FLEXEP_HD const RecordHeader* record_header(const unsigned char* rec) {
  return reinterpret_cast<const RecordHeader*>(rec);
}
FLEXEP_HD RecordEntry* record_entries(unsigned char* rec) { return reinterpret_cast<RecordEntry*>(rec + 8); }
FLEXEP_HD const RecordEntry* record_entries(const unsigned char* rec) {
  return reinterpret_cast<const RecordEntry*>(rec + 8);
}

FLEXEP_HD void record_clear(unsigned char* rec) {
  record_header(rec)->epoch = 0;
  record_header(rec)->n = 0;
}

// Inserts (row, prob) keeping the entries sorted by row. False when the record is full (cannot
// happen for valid input: a token has at most min(k, L) kept pairs on one rank, and width is that).
FLEXEP_HD bool record_insert(unsigned char* rec, int width, int row, float prob) {
  RecordHeader* h = record_header(rec);
  RecordEntry* e = record_entries(rec);
  int i = static_cast<int>(h->n);
  if (i >= width) return false;
  while (i > 0 && e[i - 1].row > row) {
    e[i] = e[i - 1];
    --i;
  }
  e[i].row = row;
  e[i].prob = prob;
  h->n += 1;
  return true;
}

// Index of `row` among the entries (binary search), or -1.
FLEXEP_HD int record_find(const unsigned char* rec, int row) {
  const RecordEntry* e = record_entries(rec);
  int lo = 0, hi = static_cast<int>(record_header(rec)->n);
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (e[mid].row < row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < static_cast<int>(record_header(rec)->n) && e[lo].row == row ? lo : -1;
}

// ---- the count exchange --------------------------------------------------------------------------
// Every rank writes one slot into every rank's window: kHeaderWords int64 header words, then its E
// pair counts per global expert. The device_* words come from the DeviceErrorRecord of the
// single-GPU plan (bad expert ids found on the device).
namespace word {
using namespace call_signature::word;  // status, argument, device_*, experts ... tokens (signature_words.h)
constexpr int fp8 = call_signature::kWords;  // 1: rows travel as e4m3 with fp32 scales per 128 elements (dispatch_fp8)
constexpr int count = fp8 + 1;
}  // namespace word

// Words (8 bytes) of one rank's slot in a count region as written (count_words.cuh): each header
// value as two words (low and high half), then one word per expert, each with the call's epoch.
FLEXEP_HD int ll_slot_words(int experts) { return 2 * word::count + experts; }

// FP8 rows: one fp32 scale per this many elements travels with each row.
constexpr int kFp8ScaleBlock = 128;

// A rank whose header says it failed makes every rank abort the call.
FLEXEP_HD bool header_failed(const long long* h) { return h[word::status] != 0 || h[word::device_arg] != 0; }

// The configuration fields every rank must share with rank 0 (as the host's compare_headers()).
FLEXEP_HD bool header_agrees(const long long* h0, const long long* h) {
  if (h[word::experts] != h0[word::experts] || h[word::multihot] != h0[word::multihot] ||
      h[word::hidden] != h0[word::hidden] || h[word::mode] != h0[word::mode] ||
      h[word::pad_multiple] != h0[word::pad_multiple] || h[word::fp8] != h0[word::fp8])
    return false;
  if (h0[word::multihot] == 0 && h[word::topk] != h0[word::topk]) return false;
  if (h0[word::mode] != 0 && (h[word::budget_rows] != h0[word::budget_rows] || h[word::overflow] != h0[word::overflow]))
    return false;
  return true;
}

}  // namespace flexep::hybridep
