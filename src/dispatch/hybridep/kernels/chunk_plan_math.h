// The single-GPU plan of a hybridep dispatch as chunked bit arithmetic (chunk_plan.cu runs it on
// the preprocess SMs, tests/cpu/test_hybridep_chunk_plan.cpp checks it against core/plan.cpp).
//
// What the preprocess kernel needs from this rank's own routing (pad 1, no budget):
//   - count(e): the (token, slot) pairs routed to global expert e (sent in the count exchange);
//   - rank(t, j): the rank of slot j of token t among the pairs of its expert e in (token, slot)
//     order. A token chooses an expert at most once, so that is "tokens before t that chose e".
//
// Tokens are cut into chunks of kPlanChunkTokens; one CTA thread per token of a chunk. A chunk keeps
// one bit per (expert, token) in kPlanChunkWords words per expert, so
//
//   rank(t, e) = chunk_base(g, e) + word_prefix(e, w) + popc(bits(e, w) & bits below t's)
//
// with g = t's chunk, w = t's word in it, word_prefix(e, w) = set bits of e in words [0, w) of the
// chunk, and chunk_base(g, e) = pairs of e in chunks [0, g) (an exclusive scan over the chunks'
// counts, which the last CTA to finish does). A few popcounts per slot and no sort: the general
// plan (src/cuda/local_plan*: keys, a CUB radix sort, the layout, the slot rows) took 68 us on
// dsv3-ep2, most of it launches and passes over all pairs.
//
// No CUDA headers: FLEXEP_HD marks functions __host__ __device__ only under nvcc.
#pragma once

#include <cstdint>

#include "dispatch/hybridep/kernels/layout_math.h"  // FLEXEP_HD

namespace flexep::hybridep {

constexpr int kPlanChunkTokens = 256;  // one CTA of kThreads: a token per thread
constexpr int kPlanChunkWords = kPlanChunkTokens / 32;

// Bytes of one chunk's bits: kPlanChunkWords 32-bit words per expert.
constexpr long long plan_bits_bytes(int experts) { return static_cast<long long>(experts) * kPlanChunkWords * 4; }

FLEXEP_HD int popc32(std::uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Chunks of a rank with `tokens` tokens (at least one: the last CTA still writes zero counts).
FLEXEP_HD long long plan_chunks(long long tokens) {
  const long long n = (tokens + kPlanChunkTokens - 1) / kPlanChunkTokens;
  return n > 0 ? n : 1;
}

// Token i of a chunk (0 <= i < kPlanChunkTokens): its word in an expert's bits, and its bit there.
FLEXEP_HD int plan_word(int i) { return i / 32; }
FLEXEP_HD std::uint32_t plan_bit(int i) { return 1u << (i % 32); }

// Set bits of expert e's words [0, w) in a chunk's bits [E][kPlanChunkWords].
FLEXEP_HD int plan_word_prefix(const std::uint32_t* bits, int e, int w) {
  int n = 0;
  for (int q = 0; q < w; ++q) n += popc32(bits[e * kPlanChunkWords + q]);
  return n;
}

// Rank of chunk token i among the chunk's tokens that chose e, given word_prefix(e, word(i)).
FLEXEP_HD int plan_rank_in_chunk(const std::uint32_t* bits, int word_prefix, int e, int i) {
  return word_prefix + popc32(bits[e * kPlanChunkWords + plan_word(i)] & (plan_bit(i) - 1u));
}

}  // namespace flexep::hybridep
