// The host backend's data movements in the rank-major layout (core/rank_major.h), beside
// row_ops.h's expert-major ones:
//   dispatch, combine_backward:  receiver pulls one row per (token, this rank)  (pull_rank_rows)
//   combine, dispatch_backward:  source sums its rows back over the ranks      (sum_rank_rows,
//                                                                                gather_rank_weights)
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep::host {

// One rank's sender-side layout plus the data it sends.
struct RankMajorSender {
  TensorView hidden;                        // [tokens, H] (combine_backward: grad_out)
  TensorView weights;                       // [tokens, slots], or undefined (no slots move)
  const std::int64_t* indices = nullptr;    // [tokens * slots] global expert ids
  const std::int64_t* dest_rows = nullptr;  // [tokens * R] row on rank d, -1 = none
  std::int64_t tokens = 0;
  std::int64_t slots = 0;
};

// Receiver `me`: out_rows[row] = hidden[t] for every token a sender sends here; with out_idx
// ([rows, slots] int32) and out_weights, also its slots as local ids of `me` (-1 for experts
// elsewhere) and their weights (0 there), copied bit for bit. Rows nobody fills (the budget's
// tail) must be zero (out_idx: -1) already.
void pull_rank_rows(int me, int ranks, int local_experts, const std::vector<RankMajorSender>& senders,
                    const TensorView& out_rows, std::int32_t* out_idx, const TensorView& out_weights);

// Source side: out[t] = the sum over ranks d, ascending, of rows[d][dest_rows[t * R + d]] (rows kept
// there), accumulated in fp32 (fp64 for f64) and cast to out's dtype once: the second level of
// the expert-major combine (row_ops.h), whose first level the caller did.
void sum_rank_rows(int ranks, const std::int64_t* dest_rows, const std::vector<TensorView>& rows, const TensorView& out);

// Source side of the weights' gradient: out[t][j] = grads[d][row of (t, d)][j] for every slot j whose
// expert lives on a rank d that kept the token; 0 elsewhere.
void gather_rank_weights(int ranks, int local_experts, const std::int64_t* indices, const std::int64_t* dest_rows,
                         std::int64_t slots, const std::vector<TensorView>& grads, const TensorView& out);

}  // namespace flexep::host
