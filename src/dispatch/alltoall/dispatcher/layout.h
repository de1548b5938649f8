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

#include "dispatch/common/call_signature.h"
#include "flexep/core/plan.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::alltoall {

// Word positions of the header (int64 words): the call signature's (common/signature_words.h).
// The device_* words are written by the header kernel from the DeviceErrorRecord of the count kernel.
namespace word {
using namespace call_signature::word;  // status, argument, device_*, experts ... tokens
constexpr int count = call_signature::kWords;
}  // namespace word

// The header of the count exchange (fp8 is always false: this backend has no FP8 dispatch).
using RankHeader = call_signature::CallSignature;

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
using call_signature::compare_headers;

using call_signature::plan_params;

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
