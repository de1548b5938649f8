// Row helpers shared by the hybridep kernels: zeroing the rows no token lands in (padding of each
// expert group and the budget's tail). Rows are H bf16 = H / 8 16-byte words.
#pragma once

#include <cstdint>

#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

// Zeroes rows [first, end) of `rows` (and their probs when `probs` is given), warp `w` of `W`
// taking every W-th row; the lanes of a warp split each row.
__device__ inline void zero_row_range(uint4* rows, float* probs, long long words_per_row, long long first,
                                      long long end, int w, int W, int lane) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (long long r = first + w; r < end; r += W) {
    uint4* row = rows + r * words_per_row;
    for (long long i = lane; i < words_per_row; i += 32) row[i] = zero;
    if (probs && lane == 0) probs[r] = 0.0f;
  }
}

// Every row of an expert-major output that no (token, expert) pair fills: for each local expert
// le, rows [begin + kept, begin + tpe) (padding up to pad_multiple, cut by the budget), then the
// rows [used, out_rows) past the last group (budget mode). With core/plan.cpp's layout these and
// the kept rows tile [0, out_rows) exactly (docs/hybridep.md, end of "Data flow of a dispatch").
// Every range is clamped to [0, out_rows): nothing outside the output is ever written, whatever
// the layout arrays hold.
__device__ inline void zero_unfilled_rows(uint4* rows, float* probs, long long words_per_row, const long long* begin,
                                          const long long* kept, const long long* tpe, int local_experts,
                                          long long used, long long out_rows, int w, int W, int lane) {
  auto clamp_row = [out_rows](long long r) { return clamp_ll(r, 0, out_rows); };
  for (int le = 0; le < local_experts; ++le)
    zero_row_range(rows, probs, words_per_row, clamp_row(begin[le] + kept[le]), clamp_row(begin[le] + tpe[le]), w, W,
                   lane);
  zero_row_range(rows, probs, words_per_row, clamp_row(used), out_rows, w, W, lane);
}

}  // namespace flexep::hybridep
