// DeepEP's rank-major dispatch layout (the `deepep` backend, and the `host` backend's oracle of it;
// docs/semantics.md, "Rank-major dispatch"):
//
//   - receiver d gets one row per (source token, d) whose token selected at least one of d's
//     experts, ordered by (source rank, source token): source s's rows start after the rows of
//     every source before it;
//   - each row carries the token's k slots, as local expert ids with -1 for experts elsewhere
//     (recv_topk_idx), and their weights (0 where -1);
//   - for every local expert, the rows that selected it, ascending, padded with -1 to a multiple of
//     pad_multiple; tokens_per_expert counts the padded lists, which lie end to end in expert order
//     (expert_rows). Reading recv_x through expert_rows gives the expert-major rows exactly;
//   - budget mode: recv_x has budget_rows rows. Rows at or beyond the budget raise an overflow
//     error or, with the drop policy, are dropped (their pairs counted), so the kept rows are a
//     deterministic prefix.
//
// The receive side follows from the row counts rows[s][d] alone (what a backend exchanges), the
// expert lists from the receiver's own received slots.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"

namespace flexep {

// Receive side of one rank.
struct RankMajorLayout {
  std::vector<std::int64_t> source_begin;  // [R] first row of source s
  std::vector<std::int64_t> source_rows;   // [R] rows kept from source s
  std::int64_t required_rows = 0;          // rows sent here (the blocking size)
  std::int64_t out_rows = 0;               // rows of recv_x: required_rows, or the budget
};

// Rows source rank `source` sends to each rank [R]: its tokens with at least one expert there.
std::vector<std::int64_t> rank_major_row_counts(const TensorView& indices, const PlanParams& params);

// Every receiver's layout from rows [R * R] (rows[s * R + d]: source s to receiver d). Throws an
// overflow Error naming the rank, its rows and the budget when the policy is `error`; every rank
// computes the same from the same counts, so every rank raises.
std::vector<RankMajorLayout> rank_major_layouts(const std::vector<std::int64_t>& rows, const PlanParams& params);

// Where source `source`'s tokens land: result[t * R + d] is the row on rank d, or -1 (no expert of
// d, or dropped).
std::vector<std::int64_t> rank_major_rows(const std::vector<RankMajorLayout>& layouts, int source,
                                          const TensorView& indices, const PlanParams& params);

// Length of expert_rows for `recv_rows` received rows of k slots: blocking mode sizes it exactly
// (sum of tokens_per_expert); budget mode, where nothing may wait for the counts, by this bound
// (every row names at most min(k, L) local experts, every list pads at most pad - 1).
std::int64_t expert_rows_capacity(std::int64_t recv_rows, std::int64_t k, int local_experts, std::int64_t pad);

struct ExpertRows {
  std::vector<std::int64_t> tokens_per_expert;  // [L], padded
  std::vector<std::int32_t> rows;               // the lists end to end, -1 = padding (and the tail)
  std::int64_t pairs = 0;                       // (row, local expert) pairs listed
};

// From the received slots local_idx [rows, k] (local expert ids, -1 = elsewhere). capacity < 0:
// exactly the padded lists; else `capacity` entries (the tail -1; an internal error if they do not
// fit, which expert_rows_capacity rules out).
ExpertRows expert_rows(const std::int32_t* local_idx, std::int64_t rows, std::int64_t k, int local_experts,
                       std::int64_t pad, std::int64_t capacity = -1);

}  // namespace flexep
