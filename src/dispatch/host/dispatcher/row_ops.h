// The two data movements of the host backend. Every operation of the dispatcher is one of them:
//   dispatch, combine_backward:  receiver pulls rows      (pull_rows)
//   combine, dispatch_backward:  source sums rows back    (sum_rows, gather_probs)
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep::host {

// One rank's sender-side layout plus the data it sends.
struct SenderRows {
  TensorView hidden;                        // [tokens, H]
  TensorView weights;                       // [tokens, slots] or undefined (combine_backward moves no probs)
  const std::int64_t* indices = nullptr;    // [tokens * slots] global expert ids
  const std::int64_t* slot_rows = nullptr;  // [tokens * slots] row on the owner, -1 = none
  std::int64_t tokens = 0;
  std::int64_t slots = 0;
};

// Receiver `me`: out_tokens[row] = hidden[t] and out_probs[row] = weights[t][j] for every slot of
// every sender that lands on `me`. Rows nobody fills (padding, budget tail) must be zero already.
// out_probs may be undefined; its dtype must equal the senders' weights (copied bit for bit).
void pull_rows(int me, int local_experts, const std::vector<SenderRows>& senders, const TensorView& out_tokens,
               const TensorView& out_probs);

// Source side: out[t] = sum over the kept slots of t, in ascending global expert id, of
// rows[owner][slot_row], accumulated in fp32 (fp64 for f64) and then cast to out's dtype.
// `rows[r]` is rank r's [N_r, H] tensor, of out's dtype.
void sum_rows(int local_experts, const std::int64_t* indices, const std::int64_t* slot_rows, std::int64_t slots,
              const std::vector<TensorView>& rows, const TensorView& out);

// Source side of the probs gradient: out[t][j] (top-k, out [T, slots]) or out[t][expert]
// (multihot, out [T, E]) = probs[owner][slot_row] for kept slots; everything else zero.
void gather_probs(int local_experts, const std::int64_t* indices, const std::int64_t* slot_rows, std::int64_t slots,
                  bool multihot, const std::vector<TensorView>& probs, const TensorView& out);

}  // namespace flexep::host
