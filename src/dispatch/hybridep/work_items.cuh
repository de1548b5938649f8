// Work items of the v2 hybridep kernels: the 32-token chunks of the protocol (one flag each) are
// split into PARTS of a power-of-two number of tokens, and the parts are handed out one at a time
// through an atomic counter, so every pipeline of the grid stays busy however the tokens are
// distributed (decode: 4 chunks per rank for 32+ pipelines; training: 128 chunks) and no pipeline
// waits for a slow one at the end. Which pipeline does a part changes nothing in the results: rows,
// records and flags have fixed places.
//
// A chunk's flag is released once all its parts are done: every part's pipeline counts itself in
// `work[kWorkChunks + chunk]` after its stores are complete, and the last one releases the flag and
// resets the counter (the next kernel on the buffer comes after this one in stream order). The two
// "next item" counters are reset by the grid's last CTA.
#pragma once

#include "dispatch/hybridep/flags.cuh"
#include "dispatch/hybridep/layout_math.h"

namespace flexep::hybridep {

// Words of the work array (plain device memory next to each buffer, zeroed at allocation).
constexpr int kWorkFirst = 0;   // next item of the kernel's first phase (dispatch: sends; combine: partials)
constexpr int kWorkSecond = 1;  // next item of the second phase (dispatch: fan-out; combine: outputs)
constexpr int kWorkChunks = 2;  // then one counter per chunk (dispatch) or per (source, chunk) (combine)

// The smallest part: below this a part costs more in hand-out and publishing than it saves.
constexpr int kMinPartTokens = 4;

struct PartSplit {
  int tokens = kChunkTokens;  // tokens per part: a power of two dividing kChunkTokens
  int per_chunk = 1;          // parts per chunk (the last chunk's trailing parts may hold no token)
};

// The largest part size that still gives at least 8 parts per pipeline (so that the hand-out
// balances the load to within ~1/8 of a pipeline's share), but not below kMinPartTokens.
__host__ __device__ inline PartSplit part_split(long long chunks, int pipelines) {
  int p = kChunkTokens;
  while (p > kMinPartTokens && chunks * (kChunkTokens / p) < 8LL * pipelines) p /= 2;
  PartSplit s;
  s.tokens = p;
  s.per_chunk = kChunkTokens / p;
  return s;
}

struct Part {
  int source = 0;  // the rank whose tokens these are
  int chunk = 0;
  long long t0 = 0, t1 = 0;  // tokens [t0, t1) of `source`; empty when t1 <= t0
};

// Part i (< num_chunks(tokens) * per_chunk) of a rank with `tokens` tokens.
__device__ inline Part part_in_rank(long long i, const PartSplit& sp, long long tokens, int source) {
  Part p;
  p.source = source;
  p.chunk = static_cast<int>(i / sp.per_chunk);
  p.t0 = static_cast<long long>(p.chunk) * kChunkTokens + (i % sp.per_chunk) * sp.tokens;
  p.t1 = p.t0 + sp.tokens < tokens ? p.t0 + sp.tokens : tokens;
  return p;
}

// Parts of several ranks, rank by rank in ascending order, skipping ranks for which skip(s) holds.
// tokens_of_rank(s) is rank s's T. Returns the number of parts; with `i` >= 0 also part i in *out.
template <class Tokens, class Skip>
__device__ inline long long parts_of_ranks(int ranks, const PartSplit& sp, Tokens tokens_of_rank, Skip skip,
                                           long long i = -1, Part* out = nullptr) {
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
__device__ inline long long chunks_of_ranks(int ranks, Tokens tokens_of_rank, Skip skip) {
  long long total = 0;
  for (int s = 0; s < ranks; ++s)
    if (!skip(s)) total += num_chunks(tokens_of_rank(s));
  return total;
}

// The next item for this warp: lane 0 takes it from the counter, every lane gets it.
__device__ inline long long grab_item(unsigned* counter, int lane) {
  unsigned i = 0;
  if (lane == 0) i = atomicAdd(counter, 1u);
  return static_cast<long long>(__shfl_sync(kFullMask, i, 0));
}

// Counts one finished part of the chunk whose counter is `done`; returns true in the caller that
// counted the last of `per_chunk` parts (it then owns the release of the chunk's flag). The caller
// has made everything the part wrote complete and fenced at system scope before; the returned true
// comes after an acquire fence, so that the release that follows publishes every part's writes.
__device__ inline bool count_part(unsigned* done, int per_chunk) {
  fence_sys();
  const unsigned before = atomicAdd(done, 1u);
  if (before + 1 != static_cast<unsigned>(per_chunk)) return false;
  fence_sys();
  *done = 0;  // every part of this call has counted itself; the next kernel comes in stream order
  return true;
}

}  // namespace flexep::hybridep
