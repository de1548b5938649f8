// DeepEP's low-latency (decode) layout: the `deepep` backend's low_latency_dispatch and
// low_latency_combine (docs/semantics.md, "Low-latency dispatch"), computed here on the CPU for
// every rank at once: their oracle.
//
//   - every (token, expert) pair travels on its own (no merging per rank): receiver d holds, for
//     each local expert e, a region of R * T_max rows; e's rows come first, ordered by (source rank,
//     source token), recv_count[e] of them; the rest of the region is left as it was;
//   - recv_src_info[e][i] is row i's source token; layout_range[e][s] = (begin << 32) | count of
//     source s's rows in e's region (DeepEP's packing);
//   - a slot sends when its id lies in [0, E) and no earlier slot of the same token has that id; any
//     other id sends nothing (-1 is "no expert"; any other is an error the backend reports);
//   - combine: out[t] = the fp32 sum, over token t's sending slots j in ascending order, of
//     w[t][j] * y_j, each product and each sum rounded to fp32 once (no fused multiply-add), then
//     rounded to bf16; y_j is the expert output row of (t, slot j)'s pair, read where the dispatch
//     put that pair. A token with no sending slot gets a zero row.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep {

// Whether slot j of token t sends: sends[t * k + j] (indices [T, k] int32 or int64).
std::vector<char> low_latency_sending_slots(const TensorView& indices, int experts);

// One receiver's layout.
struct LowLatencyReceiver {
  std::vector<std::int32_t> count;          // [L] rows per local expert
  std::vector<std::int64_t> layout_range;   // [L * R]
  std::vector<std::int32_t> src_rank;       // [L * R * T_max] the row's source rank (-1 past count)
  std::vector<std::int32_t> src_token;      // [L * R * T_max] its source token = recv_src_info (-1 past count)
};

// Every receiver's layout from every source's indices ([T_s, k], T_s <= max_tokens).
std::vector<LowLatencyReceiver> low_latency_layouts(const std::vector<TensorView>& indices, int experts,
                                                    std::int64_t max_tokens);

// Receiver d's recv_x from every source's rows ([T_s, row_bytes] of any element type): [L, R *
// T_max, row_bytes] bytes as u8-sized elements of `rows[0]`'s dtype layout (zero past each count).
Tensor low_latency_recv_x(const LowLatencyReceiver& layout, const std::vector<TensorView>& rows, int ranks,
                          std::int64_t max_tokens);

// Source s's combine: indices and weights [T, k] (f32) of its dispatch, every rank's expert outputs
// [L, R * T_max, H] bf16 (in the dispatch's places), the layouts -> out [T, H] bf16.
Tensor low_latency_combine_reference(const std::vector<LowLatencyReceiver>& layouts, int source,
                                     const TensorView& indices, const TensorView& weights,
                                     const std::vector<TensorView>& expert_out, int experts, std::int64_t max_tokens);

}  // namespace flexep
