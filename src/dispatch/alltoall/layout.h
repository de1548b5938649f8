// Host-side logic of the alltoall backend that needs no GPU (tested on the CPU):
//   - the per-rank header that travels with the counts in the count exchange (local check result,
//     a device-side argument error, and the configuration every rank must agree on);
//   - the agreement rules applied to the gathered headers, identical on every rank so that all
//     ranks raise the same error together;
//   - what one rank needs from the DispatchPlan: NCCL message sizes and offsets per peer, and the
//     receiver's per-expert parameters for placing received rows.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::alltoall {

// Word positions of the header (int64 words). The device_* words are written by the header kernel
// from the DeviceErrorRecord of the count kernel.
namespace word {
constexpr int status = 0;         // 1: this rank's host-side checks failed
constexpr int argument = 1;       // 4 words: the failing argument's name, 8 chars each (truncated)
constexpr int argument_words = 4;
constexpr int device_arg = 5;     // DeviceErrorRecord: arg (DeviceArg, 0 = none), row, column, value, limit
constexpr int device_row = 6;
constexpr int device_column = 7;
constexpr int device_value = 8;
constexpr int device_limit = 9;
constexpr int experts = 10;
constexpr int multihot = 11;
constexpr int hidden = 12;
constexpr int topk = 13;          // k in the top-k form; compared only there
constexpr int mode = 14;
constexpr int pad_multiple = 15;
constexpr int budget_rows = 16;
constexpr int overflow = 17;
constexpr int tokens = 18;        // informational (T may differ per rank)
constexpr int count = 19;
}  // namespace word

struct RankHeader {
  bool failed = false;    // host-side checks failed
  std::string argument;   // their ArgumentError's argument ("" for other errors)
  int device_arg = 0;     // DeviceArg of a violation found by the count kernel (1 = indices)
  std::int64_t device_row = 0, device_column = -1, device_value = 0, device_limit = 0;
  int experts = 0;
  bool multihot = false;
  std::int64_t hidden = 0;
  std::int64_t topk = 0;
  DispatchMode mode = DispatchMode::blocking;
  std::int64_t pad_multiple = 1;
  std::int64_t budget_rows = 0;
  OverflowPolicy overflow = OverflowPolicy::error;
  std::int64_t tokens = 0;
};

std::vector<std::int64_t> encode(const RankHeader& h);  // word::count words
RankHeader decode(const std::int64_t* words);

// Words each rank contributes to the count exchange: header, counts per global expert, tokens per
// destination rank (deduplicated: a token goes once to each rank that owns one of its experts).
inline std::int64_t payload_words(int experts, int ranks) { return word::count + experts + ranks; }

struct Exchange {
  std::vector<RankHeader> headers;   // [R]
  std::vector<std::int64_t> counts;  // [R * E]: counts[s * E + e], pairs of source s for global expert e
  std::vector<std::int64_t> dest;    // [R * R]: dest[s * R + d], tokens source s sends to rank d
};
// `gathered` is the ncclAllGather result: R payloads of payload_words(E, R).
Exchange parse_exchange(const std::vector<std::int64_t>& gathered, int ranks, int experts);

// The error of a rank other than `me` whose local checks failed (the first such rank), quoted so
// that every rank raises an error of the same kind naming the same argument; null when none.
// (A failing rank raises its own, more precise error itself.)
std::exception_ptr peer_failure(const Exchange& ex, int me);
// Null when every rank agrees with rank 0 on the configuration; otherwise an ArgumentError naming
// the first field that differs, the first rank that differs and both values.
std::exception_ptr compare_headers(const std::vector<RankHeader>& headers);

PlanParams plan_params(const DispatchOptions& options, int ranks, int experts);

// Metadata entries per sent row: a token has at most min(k, E_local) experts on one rank.
inline int meta_width(std::int64_t slots, int local_experts) {
  const std::int64_t m = slots < local_experts ? slots : local_experts;
  return m < 1 ? 1 : static_cast<int>(m);
}

// What rank `me` needs from the plan. Rows travel ordered (peer, token); offsets are in rows.
struct RankPlan {
  std::int64_t out_rows = 0;
  std::int64_t dropped = 0;
  std::vector<std::int64_t> tokens_per_expert;  // [L]
  // Receiver: a received pair for local expert e whose position among all received pairs of e, in
  // (source rank, source token) order, is q lands at row expert_begin[e] + q when q < kept_rows[e]
  // (else it is dropped). q = (exclusive scan over expert-major flags) - pairs_before[e].
  std::vector<std::int64_t> expert_begin;  // [L]
  std::vector<std::int64_t> kept_rows;     // [L]
  std::vector<std::int64_t> pairs_before;  // [L]: received pairs of local experts < e (before drops)
  std::vector<std::int64_t> send_count, send_offset, recv_count, recv_offset;  // [R]
  std::int64_t total_send = 0, total_recv = 0;
};
RankPlan rank_plan(const DispatchPlan& plan, const Exchange& ex, int me);

// The kernels index rows and metadata with 32-bit integers: refuses (on every rank alike, since
// every rank checks every rank) exchanges that would not fit.
void check_index_range(const DispatchPlan& plan, const Exchange& ex, int meta_width);

}  // namespace flexep::alltoall
