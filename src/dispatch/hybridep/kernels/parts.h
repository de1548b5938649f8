// How the hybridep kernels split their work: the 32-token chunks of the protocol (one flag each)
// are cut into PARTS of a power-of-two number of tokens, handed out one at a time (work_items.cuh),
// so that every pipeline of the grid stays busy however the tokens are distributed (decode: 4
// chunks per rank for 32+ pipelines; training: 128 chunks). Which pipeline does a part changes
// nothing in the results: rows, records and flags have fixed places.
//
// Pure arithmetic, shared by the kernels and the CPU tests (tests/cpu/test_hybridep_parts.cpp).
// No CUDA headers: FLEXEP_HD (layout_math.h) marks functions __host__ __device__ only under nvcc.
#pragma once

#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

// The smallest part a caller may force (HybridEpOptions::part_tokens); the smallest the split
// chooses by itself for load balance (below it a part costs more in hand-out and publishing than it
// saves: dsv3-ep2, 4-token parts +10%); and the smallest it goes to so that every pipeline gets a
// part at all, as long as no pipeline gets two. Decode at 32 SMs: 2-token parts, kernel 38 -> 31
// us; at 64 SMs: 1-token parts on 64 CTAs, aligned call 38.8-39.1 us against 40.0-41.2 with
// 2-token parts on 32 (experiments/*-910b8d00-*). Several small parts per pipeline cost more than
// they spread: 1-token parts at 16 SMs (4 per pipeline) 50 us (experiments/*-8281ec4e-*); at 24
// SMs, 2-token parts gave 16 of the 48 pipelines a second part, 58 us against 52.7 at 16 SMs.
constexpr int kMinPartTokens = 1;
constexpr int kMinAutoPartTokens = 4;
constexpr int kMinSpreadPartTokens = 1;

struct PartSplit {
  int tokens = kChunkTokens;  // tokens per part: a power of two dividing kChunkTokens
  int per_chunk = 1;          // parts per chunk (the last chunk's trailing parts may hold no token)
};

// Whether `tokens` may be forced as the part size: a power of two in [kMinPartTokens, kChunkTokens].
FLEXEP_HD bool valid_part_tokens(int tokens) {
  return tokens >= kMinPartTokens && tokens <= kChunkTokens && (tokens & (tokens - 1)) == 0;
}

// The largest part size that still gives at least 8 parts per pipeline (so that the hand-out
// balances the load to within ~1/8 of a pipeline's share), but not below kMinAutoPartTokens, unless
// half that size still gives no pipeline more than one part (then down to kMinSpreadPartTokens: a
// small call's parts are latency chains, and a pipeline's second part runs after its first); or
// `forced` when it is a valid part size (HybridEpOptions::part_tokens, for sweeps).
FLEXEP_HD PartSplit part_split(long long chunks, int pipelines, int forced = 0) {
  // Halved and doubled together, without a division: a producer computes this on the critical path
  // of a decode call.
  PartSplit s;
  if (valid_part_tokens(forced)) {
    while (s.tokens > forced) s.tokens /= 2, s.per_chunk *= 2;
  } else {
    while (s.tokens > kMinAutoPartTokens && chunks * s.per_chunk < 8LL * pipelines) s.tokens /= 2, s.per_chunk *= 2;
    while (s.tokens > kMinSpreadPartTokens && 2 * chunks * s.per_chunk <= pipelines) s.tokens /= 2, s.per_chunk *= 2;
  }
  return s;
}

// Whether every pipeline of the grid has a send part of its own: a pipeline's first part is the one
// with its index (work_items.cuh). The fused small-call kernel relies on it to reuse its count slots:
// a CTA's first part cannot be published before that CTA has read the counts, so every chunk flag a
// peer needs to finish the call waits for every CTA's reads, and the peer cannot rewrite its count
// slot (its next call) while a late CTA still reads it.
FLEXEP_HD bool every_pipeline_sends(long long tokens, int pipelines, int forced = 0) {
  const long long chunks = num_chunks(tokens);
  return chunks * part_split(chunks, pipelines, forced).per_chunk >= pipelines;
}

// The fused small-call kernel's grid: the largest of at most `max_grid` CTAs of `per_cta`
// pipelines in which every pipeline has a send part of its own (every_pipeline_sends), but not
// below half of `max_grid`; 0 if there is none. A call given more SMs than its parts fill runs that
// kernel on fewer CTAs rather than taking the two kernels (decode at 24 SMs: 16 CTAs; at 48: 32; at
// 80: 64). The fan-out and the zeroing run on that grid too, hence the floor. A forced part size
// (HybridEpOptions::part_tokens: sweeps) keeps the grid as given: `max_grid` or 0.
FLEXEP_HD int fused_grid(long long tokens, int max_grid, int per_cta, int forced = 0) {
  if (valid_part_tokens(forced)) return every_pipeline_sends(tokens, max_grid * per_cta, forced) ? max_grid : 0;
  for (int g = max_grid; g > 0 && 2 * g >= max_grid; --g)
    if (every_pipeline_sends(tokens, g * per_cta)) return g;
  return 0;
}

struct Part {
  int source = 0;  // the rank whose tokens these are
  int chunk = 0;
  long long t0 = 0, t1 = 0;  // tokens [t0, t1) of `source`; empty when t1 <= t0
};

// Part i (< num_chunks(tokens) * per_chunk) of a rank with `tokens` tokens. per_chunk is a power of
// two: a mask and a shift instead of a 64-bit division (~100 dependent instructions on the GPU).
FLEXEP_HD Part part_in_rank(long long i, const PartSplit& sp, long long tokens, int source) {
  int shift = 0;
  while ((1 << shift) < sp.per_chunk) ++shift;
  Part p;
  p.source = source;
  p.chunk = static_cast<int>(i >> shift);
  p.t0 = static_cast<long long>(p.chunk) * kChunkTokens + (i & (sp.per_chunk - 1)) * sp.tokens;
  p.t1 = p.t0 + sp.tokens < tokens ? p.t0 + sp.tokens : tokens;
  return p;
}

// Parts of several ranks, rank by rank in ascending order, skipping ranks for which skip(s) holds.
// tokens_of_rank(s) is rank s's T. Returns the number of parts; with `i` >= 0 also part i in *out.
// (Templates: under nvcc they take the execution space of their caller's lambdas.)
template <class Tokens, class Skip>
FLEXEP_HD long long parts_of_ranks(int ranks, const PartSplit& sp, Tokens tokens_of_rank, Skip skip, long long i = -1,
                                   Part* out = nullptr) {
  long long total = 0;
  for (int s = 0; s < ranks; ++s) {
    if (skip(s)) continue;
    const long long T = tokens_of_rank(s);
    const long long n = static_cast<long long>(num_chunks(T)) * sp.per_chunk;
    if (i >= total && i < total + n && out) *out = part_in_rank(i - total, sp, T, s);
    total += n;
  }
  return total;
}

// Chunks of several ranks (as parts_of_ranks with one part per chunk).
template <class Tokens, class Skip>
FLEXEP_HD long long chunks_of_ranks(int ranks, Tokens tokens_of_rank, Skip skip) {
  long long total = 0;
  for (int s = 0; s < ranks; ++s)
    if (!skip(s)) total += num_chunks(tokens_of_rank(s));
  return total;
}

}  // namespace flexep::hybridep
