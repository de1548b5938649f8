// One warp copies one row of 16-byte vectors. A lane keeps kRowUnroll loads in flight before it
// stores them: with one load per lane in flight an SM moves ~20 GB/s (the sm-copy probes'
// warp-load/8x1), with four and 16 warps ~100 GB/s, above what its store path takes (~62 GB/s).
#pragma once

#include <cstdint>

namespace flexep::deepep {

inline constexpr int kRowUnroll = 4;

// How the source is read: `nc` through the read-only path (inputs no kernel of this grid writes),
// `l2` at L2 (a window a peer or an earlier kernel wrote: never a stale L1 line).
enum class RowSource { nc, l2 };

template <RowSource kSource, class V>
__device__ __forceinline__ V load_vector(const V* p) {
  if constexpr (kSource == RowSource::nc)
    return __ldg(p);
  else
    return __ldcg(p);
}

// V: uint4 for rows, float for FP8 scales.
template <RowSource kSource, class V>
__device__ __forceinline__ void copy_row(const V* __restrict__ from, V* __restrict__ to, std::int64_t vectors,
                                         int lane) {
  std::int64_t v = lane;
  for (; v + 32 * (kRowUnroll - 1) < vectors; v += 32 * kRowUnroll) {
    V r[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) r[u] = load_vector<kSource>(from + v + 32 * u);
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) to[v + 32 * u] = r[u];
  }
  for (; v < vectors; v += 32) to[v] = load_vector<kSource>(from + v);
}

// The zero row (padding entries of the expert-major layout).
template <class V>
__device__ __forceinline__ void zero_row(V* to, std::int64_t vectors, int lane) {
  for (std::int64_t v = lane; v < vectors; v += 32) to[v] = V{};
}

}  // namespace flexep::deepep
