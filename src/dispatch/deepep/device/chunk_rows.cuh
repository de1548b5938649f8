// Where each token's row lands on a destination, from the count kernel's bit masks: bit l of
// mask[d][c] says token 32c + l goes to rank d. Its row there is the rank's first row on d, plus
// the tokens bound for d in the chunks before (chunk_base[d][c], a block scan of the masks' bit
// counts), plus those before it in its own chunk (one popc). The rows are the (source, token) order
// of docs/semantics.md, deterministic, and computing one costs two loads: the sender derives every
// row itself, with no kernel between the count exchange and the stores.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "dispatch/deepep/kernels/kernels.h"

namespace flexep::deepep {

// One destination's bases: base[c] = first + the set bits of mask[0 .. c). The whole CTA calls it.
template <int kThreads>
__device__ inline void chunk_bases(const unsigned* mask, std::int64_t chunks, long long first, int* base,
                                   typename cub::BlockScan<int, kThreads>::TempStorage& scan) {
  long long carry = first;
  for (std::int64_t c0 = 0; c0 < chunks; c0 += kThreads) {
    const std::int64_t c = c0 + threadIdx.x;
    const int bits = c < chunks ? __popc(__ldcg(mask + c)) : 0;
    int before = 0, total = 0;
    cub::BlockScan<int, kThreads>(scan).ExclusiveSum(bits, before, total);
    if (c < chunks) base[c] = static_cast<int>(carry + before);
    carry += total;
    __syncthreads();  // the scan storage is reused
  }
}

// Token t's row on the destination whose masks and bases these are, or -1 when it does not go there.
__device__ inline int token_row(const unsigned* mask, const int* base, std::int64_t t) {
  const std::int64_t c = t >> 5;
  const unsigned bit = 1u << (t & 31);
  const unsigned m = __ldcg(mask + c);
  return (m & bit) ? __ldcg(base + c) + __popc(m & (bit - 1)) : -1;
}

}  // namespace flexep::deepep
