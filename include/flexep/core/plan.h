// The dispatch plan: where every (token, expert) pair of every rank lands. This is the one piece
// of semantics every backend must reproduce bit for bit (docs/semantics.md, "Dispatch"):
//
//   - rank r owns the contiguous experts [r*E_local, (r+1)*E_local);
//   - on rank r the received rows are expert-major: all rows of local expert 0, then 1, ...;
//   - inside one expert, rows are ordered by (source rank, source token index);
//   - each expert's group is padded with zero rows (prob 0) to a multiple of pad_multiple, and
//     tokens_per_expert reports the padded size;
//   - in budget mode the output has exactly `budget_rows` rows. Rows that would land at or beyond
//     the budget either raise an overflow error or, with the drop policy, are dropped (and
//     counted) in that same order, so the kept rows are a deterministic prefix.
//
// The plan is computed from a count matrix alone (counts[s][e]: valid pairs of source rank s
// routed to global expert e), which is exactly what the GPU backends exchange; the slot of one
// pair then follows from a running count over the source's own tokens.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep {

enum class OverflowPolicy { error, drop };

struct PlanParams {
  int ranks = 1;
  int experts = 1;                  // global E; must be divisible by ranks
  std::int64_t pad_multiple = 1;    // >= 1
  std::optional<std::int64_t> budget_rows;  // set: budget mode (multiple of pad_multiple)
  OverflowPolicy overflow = OverflowPolicy::error;

  int local_experts() const { return experts / ranks; }
  int owner(int expert) const { return expert / local_experts(); }
};
void validate(const PlanParams& p);

// Receive side of one rank.
struct RankLayout {
  std::vector<std::int64_t> tokens_per_expert;  // [E_local], padded size of each kept group
  std::vector<std::int64_t> expert_begin;       // [E_local], first row of each group
  std::vector<std::int64_t> kept_rows;          // [E_local], real (unpadded) rows kept
  std::vector<std::int64_t> source_begin;       // [E_local * R], first row of source s in expert e: [e*R + s]
  std::int64_t required_rows = 0;  // rows the blocking layout needs (sum of padded groups)
  std::int64_t out_rows = 0;       // rows of the output tensor (required_rows, or the budget)
  std::int64_t dropped = 0;        // (token, expert) pairs dropped on this receiver
};

struct DispatchPlan {
  PlanParams params;
  std::vector<RankLayout> ranks;  // [R]
  std::int64_t dropped() const;

  // Builds the layout of every rank from counts [R * E] (row s = source rank s). Throws an
  // overflow Error naming the rank, the rows it needs and the budget when the policy is `error`.
  static DispatchPlan build(const std::vector<std::int64_t>& counts, const PlanParams& params);
};

// Destination row of every slot of source rank `source`: result[t*k + j] is the row on rank
// owner(indices[t][j]) or -1 (no expert, or dropped).
std::vector<std::int64_t> slot_rows(const DispatchPlan& plan, int source, const TensorView& indices);

// Local (single-rank) permute and unpermute, the R = 1 special case used by the experts path
// without communication:
//   permute:   tokens[row] = x[t], probs[row] = weights[t][j] for every slot; other rows zero.
//   unpermute: out[t] = sum over the token's slots, ascending expert id, accumulated in fp32
//              (fp64 for f64 tensors), then cast to out's dtype.
void permute(const TensorView& x, const TensorView& weights, const std::vector<std::int64_t>& rows,
             const TensorView& out_tokens, const TensorView& out_probs);
void unpermute(const TensorView& expert_rows, const TensorView& indices, const std::vector<std::int64_t>& rows,
               const TensorView& out);

}  // namespace flexep
