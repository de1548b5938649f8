// The per-chunk steps of the single-GPU plan (chunk_plan_math.h), for the CTA that holds a chunk's
// bits [experts][kPlanChunkWords] in shared memory, a token of the chunk per thread. Shared by the
// chunk plan kernel (chunk_plan.cu: any number of chunks, one kernel) and the preprocess kernel
// (preprocess.cu: a call with one chunk of tokens plans it inline, without the plan kernel).
#pragma once

#include <cstdint>

#include "dispatch/hybridep/kernels/chunk_plan_math.h"

namespace flexep::hybridep {

__device__ __forceinline__ long long plan_id_at(const void* ids, int is64, long long i) {
  return is64 ? static_cast<const long long*>(ids)[i] : static_cast<const int*>(ids)[i];
}

// This rank's expert ids: [tokens, slots], int32 or int64.
struct PlanIds {
  const void* ids;
  int is64;
  int slots, experts;
  __device__ long long at(long long t, int j) const { return plan_id_at(ids, is64, t * slots + j); }
};

// Sets bit (e, i) of token t (chunk token i) for each of its slots' experts e, in slot order. A bad
// id (out of range, or a repeat of an earlier slot's expert) goes to on_bad(t, j, id) instead.
template <class OnBad>
__device__ void set_token_bits(std::uint32_t* bits, const PlanIds& p, long long t, int i, OnBad on_bad) {
  for (int j = 0; j < p.slots; ++j) {
    const long long id = p.at(t, j);
    if (id == -1) continue;
    if (id < 0 || id >= p.experts) {
      on_bad(t, j, id);
      continue;
    }
    // Only this thread sets token t's bits, in slot order: a bit already set is an earlier slot.
    const std::uint32_t bit = plan_bit(i);
    if (atomicOr(&bits[id * kPlanChunkWords + plan_word(i)], bit) & bit) on_bad(t, j, id);
  }
}

// The rank of chunk token i's slot of expert `id` among the chunk's pairs of that expert; -1 for no
// or an invalid expert. After every token's bits are set (a barrier).
__device__ inline int chunk_slot_rank(const std::uint32_t* bits, long long id, int experts, int i) {
  if (id < 0 || id >= experts) return -1;
  const int e = static_cast<int>(id);
  return plan_rank_in_chunk(bits, plan_word_prefix(bits, e, plan_word(i)), e, i);
}

// Each slot's rank (chunk_slot_rank) into slot_rank[t * slots + j].
__device__ inline void write_slot_ranks(const std::uint32_t* bits, const PlanIds& p, long long t, int i,
                                        int* slot_rank) {
  for (int j = 0; j < p.slots; ++j) slot_rank[t * p.slots + j] = chunk_slot_rank(bits, p.at(t, j), p.experts, i);
}

}  // namespace flexep::hybridep
