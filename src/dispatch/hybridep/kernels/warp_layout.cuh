// One receiver's layout computed by the 32 lanes of a warp: layout_math.h's receiver_layout() with
// the groups spread over the lanes and its running row as a warp scan. The same integers (every
// step is an integer sum, clamp or round-up; sums do not depend on their order): tests/gpu
// test_warp_layout.cpp compares the two. The preprocess kernel's layout step; one thread walking a
// receiver's groups was, after the group sums, still the largest part of that kernel in ncu.
#pragma once

#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

__device__ __forceinline__ long long warp_sum(long long x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Lane `lane` of a whole warp. `pairs`: group_pairs() of each of the receiver's L groups; writes
// begin / kept / tpe of the L groups, as receiver_layout() does; every lane returns the totals.
__device__ inline ReceiverTotals warp_receiver_layout(const long long* pairs, const LayoutParams& p, long long* begin,
                                                      long long* kept, long long* tpe, int lane) {
  const int L = p.experts / p.ranks;
  long long row = 0;  // rows of the groups of earlier rounds of 32
  for (int first = 0; first < L; first += 32) {
    const int le = first + lane;
    const long long real = le < L ? pairs[le] : 0;
    const long long padded = round_up(real, p.pad_multiple);
    long long through = padded;  // rows of the groups first .. le
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long before = __shfl_up_sync(0xffffffffu, through, o);
      if (lane >= o) through += before;
    }
    if (le < L) {
      begin[le] = row + through - padded;
      kept[le] = real;
    }
    row += __shfl_sync(0xffffffffu, through, 31);
  }
  ReceiverTotals tot;
  tot.required = row;
  tot.out_rows = p.budget >= 0 ? p.budget : row;
  const bool cut = p.budget >= 0 && row > p.budget;
  tot.overflow = cut && !p.drop;  // plan.cpp throws here; the caller aborts the call on every rank
  long long dropped = 0, used = 0;
  for (int le = lane; le < L; le += 32) {  // each lane reads back only what it wrote above
    if (cut && p.drop) {                   // keep the deterministic prefix of rows below the budget
      const long long k = clamp_ll(p.budget - begin[le], 0, kept[le]);
      dropped += kept[le] - k;
      kept[le] = k;
    }
    tpe[le] = clamp_ll(tot.out_rows - begin[le], 0, round_up(kept[le], p.pad_multiple));
    used += tpe[le];
  }
  tot.dropped = warp_sum(dropped);
  tot.used = warp_sum(used);
  return tot;
}

}  // namespace flexep::hybridep
