// The first kernel of a top-k dispatch on the GPU backends (alltoall, deepep): the ids validated,
// the (token, expert) pairs counted per expert, and every token counted once per destination rank.
// One thread per token: a token's k slots are few, and one thread per token lets the repeat check
// and the deduplication per destination run without atomics on flags. In the mask form a warp's 32
// tokens share one word per destination, a ballot per rank (up to 32 ranks; beyond, the warp clears
// its words and ORs its tokens' bits in with atomics), and each destination's tokens are counted as
// the word's set bits (so a token counts once per rank).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/cuda/device_errors.h"

namespace flexep {

struct CountRoutesCall {
  const void* indices = nullptr;  // [T, k] int32 or int64; may alias slot_expert when int32
  bool indices_i64 = false;
  std::int64_t tokens = 0;
  int k = 0, experts = 0, local_experts = 0, ranks = 0;
  int* slot_expert = nullptr;          // [T * k] out: the id, or -1 (none, or reported as bad)
  long long* expert_counts = nullptr;  // [E] += pairs per expert (zero on entry)
  long long* dest_counts = nullptr;    // [R] += tokens per destination rank (zero on entry)
  // Where each token goes, in one of two forms:
  int* dest_flag = nullptr;            // [R * T] = 1 where rank d owns one of t's experts (zero on entry)
  unsigned* dest_mask = nullptr;       // or [R, chunks]: bit l of (d, c) for token 32c + l (written whole)
  std::int64_t mask_chunks = 0;        // ceil(T / 32)
  cuda::DeviceErrorRecord* errors = nullptr;  // ids outside [-1, E) and repeats: "indices"
};

// The counts gather in a per-CTA shared histogram when E + R bins fit in 32 KiB (one global atomic
// per CTA and bin instead of one per pair, all on a few addresses), else straight in global memory.
void launch_count_routes(const CountRoutesCall& c, cudaStream_t stream);

}  // namespace flexep
