// Private to the router kernels: small warp-level building blocks. A token's E scores live in one
// warp, expert e in lane e % 32 at register slot e / 32 (so row loads and stores are coalesced);
// loops over the slots are fully unrolled so the per-lane arrays stay in registers.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace flexep::cuda::router {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kWarpSize = 32;
constexpr int kMaxPerLane = 16;                // 512 experts / 32 lanes
constexpr int kNoIndex = 0x7fffffff;           // "no candidate": loses to every real one
constexpr int kTokensPerBlock = 4;             // warps (tokens) per block of the per-token kernels
constexpr int kTokenBlockThreads = kTokensPerBlock * kWarpSize;

template <class S>
__device__ inline S negative_infinity() {
  return static_cast<S>(-INFINITY);
}

__device__ inline float exp_of(float x) { return expf(x); }
__device__ inline double exp_of(double x) { return exp(x); }

// Every lane gets the same result: each butterfly step combines the same two values (in swapped
// order, and + and fmax are commutative).
template <class S>
__device__ inline S warp_sum(S v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullWarp, v, off);
  return v;
}

template <class S>
__device__ inline S warp_max(S v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = fmax(v, __shfl_xor_sync(kFullWarp, v, off));
  return v;
}

// The CPU select_top_k order (src/layer/gate_saved.h): a number beats NaN, a higher key beats a
// lower one, and among equal keys (or two NaNs) the lower index wins; kNoIndex loses to all.
// A strict total order on distinct indices, so the warp reduction below has one winner.
template <class S>
__device__ inline bool ranks_before(S key_a, int index_a, S key_b, int index_b) {
  if (index_a == kNoIndex || index_b == kNoIndex) return index_b == kNoIndex && index_a != kNoIndex;
  const bool nan_a = isnan(key_a), nan_b = isnan(key_b);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && key_a != key_b) return key_a > key_b;
  return index_a < index_b;
}

// A selection candidate: the key it is ranked by, its index (expert or group) and a value carried
// along (the score that becomes its weight).
template <class S>
struct Candidate {
  S key;
  int index;
  S payload;
};

template <class S>
__device__ inline Candidate<S> no_candidate() {
  return {negative_infinity<S>(), kNoIndex, S(0)};
}

// The best candidate of the warp, on every lane.
template <class S>
__device__ inline Candidate<S> warp_best(Candidate<S> c) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const Candidate<S> o{__shfl_xor_sync(kFullWarp, c.key, off), __shfl_xor_sync(kFullWarp, c.index, off),
                         __shfl_xor_sync(kFullWarp, c.payload, off)};
    if (ranks_before(o.key, o.index, c.key, c.index)) c = o;
  }
  return c;
}

// arr[slot of expert e] += v on the lane that owns e, for the k (expert, value) pairs held by lanes
// 0..k-1. Experts are compared, never used as addresses, so a bad id cannot write out of bounds.
__device__ inline void scatter_add_from_slots(double (&arr)[kMaxPerLane], int expert, double v, int topk,
                                              int lane) {
  for (int j = 0; j < topk; ++j) {
    const int ej = __shfl_sync(kFullWarp, expert, j);
    const double vj = __shfl_sync(kFullWarp, v, j);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + kWarpSize * i == ej) arr[i] += vj;
  }
}

}  // namespace flexep::cuda::router
