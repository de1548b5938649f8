// The single-GPU plan of a hybridep dispatch as bit arithmetic (bit_plan.cu runs it in one CTA,
// tests/cpu/test_hybridep_bit_plan.cpp checks it against core/plan.cpp on the CPU).
//
// The plan gives every (token t, slot j) pair routed to expert e its row in this rank's
// expert-major order: begin(e) + the number of this rank's tokens before t that also chose e
// (a token chooses an expert at most once, so "pairs before (t, j) in (token, slot) order" is
// "tokens before t"). With one bit per (expert, token) in a matrix of E rows of W = ceil(T / 32)
// words, laid out expert-major, that row is simply
//
//   row(t, e) = P(e * W + t / 32) + popc(word(e * W + t / 32) & bits below t % 32)
//
// where P(i) is the number of set bits in words [0, i): the pairs of every expert below e plus
// those of e in earlier words. begin(e) = P(e * W) and count(e) = P((e + 1) * W) - P(e * W). The
// kernel keeps P only at every `per`-th word (one exclusive scan over the threads) and adds the few
// words in between on demand.
//
// No CUDA headers: FLEXEP_HD marks functions __host__ __device__ only under nvcc.
#pragma once

#include <cstdint>

#include "layout_math.h"  // FLEXEP_HD; relative: see layout.h

namespace flexep::hybridep {

FLEXEP_HD int popc32(std::uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Words per expert row: one bit per token.
FLEXEP_HD long long bit_plan_words_per_expert(long long tokens) { return (tokens + 31) / 32; }

// The word holding (expert e, token t), and t's bit in it.
FLEXEP_HD long long bit_plan_word(int e, long long t, long long words_per_expert) {
  return static_cast<long long>(e) * words_per_expert + t / 32;
}
FLEXEP_HD std::uint32_t bit_plan_bit(long long t) { return 1u << (t % 32); }

// Words each scanning thread sums: the N words split into `threads` consecutive runs (at least one
// word per run, so that a rank without tokens divides by 1).
FLEXEP_HD long long bit_plan_per_thread(long long words, int threads) {
  const long long per = (words + threads - 1) / threads;
  return per > 0 ? per : 1;
}

// P(i): set bits in words [0, i), from the scan's value at the start of i's run (`run_prefix[r]` =
// set bits in words [0, r * per)) plus the words of the run before i.
FLEXEP_HD long long bit_plan_prefix(const std::uint32_t* bits, const long long* run_prefix, long long per,
                                    long long words, long long i) {
  if (i >= words) i = words;
  const long long run = i / per;
  long long p = run_prefix[run];
  for (long long w = run * per; w < i; ++w) p += popc32(bits[w]);
  return p;
}

// The row of (token t, expert e): see the top of this file.
FLEXEP_HD long long bit_plan_row(const std::uint32_t* bits, const long long* run_prefix, long long per,
                                 long long words, int e, long long t, long long words_per_expert) {
  const long long w = bit_plan_word(e, t, words_per_expert);
  return bit_plan_prefix(bits, run_prefix, per, words, w) + popc32(bits[w] & (bit_plan_bit(t) - 1u));
}

}  // namespace flexep::hybridep
